"""Where a query leaves the cached tree, read-only: the answer to "why did this miss?".

A prefix match is page-granular and refreshes what it touches; an
explanation must be neither. It reports the exact token where the query
parts from the cache (inside a page too), which cached branch it parted
from, and changes nothing: no split, no access-time refresh, so asking
never reorders eviction.

Where several cached branches leave the same point, the closest is the one
sharing the most tokens with the query (inside the first page), then the
most recently used: the branch the user most likely meant to hit.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixrt.tree.keys import TOKEN_BYTES, Packed
from radixrt.tree.node import TreeNode
from radixrt.tree.walk import walk


@dataclass(frozen=True)
class Divergence:
    """How far a query runs along the cached tree.

    `matched_tokens` counts the leading query tokens present in the tree,
    token by token (a match can end inside a page). `whole_page_tokens` is
    the part a request could reuse: whole pages only. `branch` holds up to
    the asked number of tokens of the closest cached branch from
    `matched_tokens` on (empty when the tree holds nothing past that point).
    """

    matched_tokens: int
    whole_page_tokens: int
    branch: list[int]


def find_divergence(root: TreeNode | None, query: Packed, page_size: int, branch_tokens: int) -> Divergence:
    """Follow `query` down from `root` without changing anything; see `Divergence`."""
    page_bytes = page_size * TOKEN_BYTES
    path, offset, cut = walk(root, query, page_bytes)
    if root is None:
        return Divergence(0, 0, [])
    edge: TreeNode | None
    if cut is not None:
        edge, edge_offset = cut
    else:
        edge, edge_offset = _closest_child(path[-1] if path else root, query, offset, page_size), 0
    if edge is None:
        return Divergence(offset // TOKEN_BYTES, offset // TOKEN_BYTES, [])
    common = _common_tokens(query, offset, edge.key, edge_offset, page_size)
    matched_bytes = offset + common * TOKEN_BYTES
    branch = _branch_tokens(edge, edge_offset + common * TOKEN_BYTES, branch_tokens)
    return Divergence(matched_bytes // TOKEN_BYTES, offset // TOKEN_BYTES, branch)


def _closest_child(node: TreeNode, query: Packed, offset: int, page_size: int) -> TreeNode | None:
    """The child sharing the most leading tokens with `query[offset:]`, then the most recent.

    Children part from the query within their first page, so only that page is compared.
    """
    best: TreeNode | None = None
    best_rank = (-1, -1)
    for child in node.children.values():
        rank = (_common_tokens(query, offset, child.key, 0, page_size), child.last_access)
        if rank > best_rank:
            best, best_rank = child, rank
    return best


def _common_tokens(query: Packed, offset: int, key: bytes, key_offset: int, limit: int) -> int:
    """Leading tokens `query[offset:]` and `key[key_offset:]` share, at most `limit`.

    Called where whole pages already differ, so it compares at most one page.
    """
    count = 0
    end = min(len(query) - offset, len(key) - key_offset) // TOKEN_BYTES
    for i in range(min(end, limit)):
        start = i * TOKEN_BYTES
        if bytes(query[offset + start : offset + start + TOKEN_BYTES]) != key[
            key_offset + start : key_offset + start + TOKEN_BYTES
        ]:
            break
        count += 1
    return count


def _branch_tokens(edge: TreeNode, start_bytes: int, limit: int) -> list[int]:
    """Up to `limit` tokens of the cache from inside `edge` on, down its most recent children."""
    parts: list[int] = []
    node: TreeNode | None = edge
    start = start_bytes
    while node is not None and len(parts) < limit:
        want = limit - len(parts)
        parts.extend(memoryview(node.key[start : start + want * TOKEN_BYTES]).cast("Q").tolist())
        node = max(node.children.values(), key=lambda child: child.last_access, default=None)
        start = 0
    return parts
