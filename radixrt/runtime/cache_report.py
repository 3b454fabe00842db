"""The cache's answers in words: the explain report and the tree picture.

The engine thread only copies what the tree holds (a `Divergence`, a
`TreeSnapshot`); decoding tokens to text and drawing happen here, in the
caller's thread, so a long explanation never delays a step.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from radixrt.tree import Divergence, TreeSnapshot, render_svg

EXPLAIN_WINDOW = 32
"""Tokens of text shown on each side of a divergence point."""

Decode = Callable[[Sequence[int]], str]


def explain_report(ids: Sequence[int], divergence: Divergence, page_size: int, decode: Decode) -> dict[str, Any]:
    """`Runtime.explain_cache`'s dict, from where the prompt left the tree.

    `cached_tokens` is what a request for this prompt would reuse now:
    whole pages of the match, and never the last token, whose logits the
    request must compute. `diverged_at` is token-exact, so it can sit inside
    a page, past `cached_tokens`.
    """
    matched = divergence.matched_tokens
    reusable = min(divergence.whole_page_tokens, (len(ids) - 1) // page_size * page_size)
    start = max(matched - EXPLAIN_WINDOW, 0)
    return {
        "prompt_tokens": len(ids),
        "cached_tokens": reusable,
        "diverged_at": None if matched >= len(ids) else matched,
        "context_text": decode(ids[start:matched]),
        "prompt_text": decode(ids[matched : matched + EXPLAIN_WINDOW]),
        "cached_text": decode(divergence.branch[:EXPLAIN_WINDOW]),
    }


def tree_svg(snapshot: TreeSnapshot, decode: Decode) -> str:
    """The SVG picture of a snapshot, namespaces named as the API names them."""
    return render_svg(snapshot, decode, namespace_label)


def namespace_label(namespace: Hashable) -> str:
    if namespace is None:
        return "default namespace"
    if isinstance(namespace, tuple) and len(namespace) == 2 and namespace[0] == "cache_salt":
        return f"cache_salt {namespace[1]!r}"
    return f"namespace {namespace!r}"
