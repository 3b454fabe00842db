"""Integrity check and readable dump of a RadixTree.

Kept apart from the tree's hot paths: both walk every node, and tests call
`check_invariants` after every step. The tree hands over its parts
explicitly, so this module needs nothing from the tree's own module.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping

import torch

from radixrt.tree.keys import TOKEN_BYTES, unpack_slots
from radixrt.tree.node import TreeNode

LruEntry = tuple[int, int, TreeNode]
"""An evictable leaf as the tree files it: (lru_stamp, node_id, node)."""

_SHOWN_HEAD = 4
_SHOWN_TAIL = 2


def check_invariants(
    roots: Mapping[Hashable, TreeNode],
    lru: Collection[LruEntry],
    *,
    page_size: int,
    evictable_tokens: int,
    protected_tokens: int,
) -> None:
    """Assert the tree's structure, sizes, locks, LRU index and slot ownership.

    The counters are the tree's running totals, checked against a recount.
    """
    page_bytes = page_size * TOKEN_BYTES
    seen: set[int] = set()
    slots: list[bytes] = []
    evictable = protected = filed = 0
    for namespace, root in roots.items():
        assert root.parent is None and root.key == b"" and root.num_tokens == 0
        assert root.namespace == namespace or root.namespace is namespace
        _check_lock_counts(root)
        assert root.node_id not in seen
        seen.add(root.node_id)
        stack = [root]
        while stack:
            node = stack.pop()
            for first_page, child in node.children.items():
                assert child.parent is node, "child's parent link is wrong"
                assert child.node_id not in seen, "node reachable twice"
                seen.add(child.node_id)
                assert child.key, "empty edge below a root"
                assert len(child.key) % page_bytes == 0, "edge is not whole pages"
                assert child.key[:page_bytes] == first_page, "child filed under a wrong first page"
                assert child.num_tokens == len(child.key) // TOKEN_BYTES
                assert len(child.slots) == len(child.key), "slots and tokens differ in length"
                _check_lock_counts(child)
                if node.parent is not None:
                    assert child.last_access <= node.last_access, "child used after its parent"
                if child.lock_ref:
                    protected += child.num_tokens
                else:
                    evictable += child.num_tokens
                if not child.children and not child.lock_ref:
                    assert 0 <= child.lru_stamp <= child.last_access, "evictable leaf not filed"
                if child.lru_stamp >= 0:
                    filed += 1
                slots.append(child.slots)
                stack.append(child)
    assert evictable == evictable_tokens, "evictable_tokens is off"
    assert protected == protected_tokens, "protected_tokens is off"
    live = [(stamp, node_id, node) for stamp, node_id, node in lru if node.parent is not None]  # not forgotten
    assert len(live) == filed, "LRU list and node stamps disagree"
    for stamp, node_id, node in live:
        assert node.lru_stamp == stamp and node.node_id == node_id and node_id in seen
    all_slots = unpack_slots(slots)
    assert torch.unique(all_slots).numel() == all_slots.numel(), "a slot is held twice"


def _check_lock_counts(node: TreeNode) -> None:
    # A node's count is its own locks plus its children's counts, so it is
    # >= each child's, and no count is negative.
    assert node.own_lock_ref >= 0, "negative own lock count"
    below = sum(child.lock_ref for child in node.children.values())
    assert node.lock_ref == node.own_lock_ref + below, "lock counts do not add up"


def pretty(
    roots: Mapping[Hashable, TreeNode], *, page_size: int, evictable_tokens: int, protected_tokens: int
) -> str:
    """One line per node, indented as a tree, children ordered by first token."""
    lines = [
        (
            f"RadixTree(page_size={page_size}): {evictable_tokens + protected_tokens} tokens, "
            f"{evictable_tokens} evictable, {protected_tokens} protected"
        )
    ]
    for namespace, root in roots.items():
        lines.append(f"namespace {namespace!r}: root lock={root.lock_ref}")
        _pretty_children(root, "", lines)
    return "\n".join(lines)


def _pretty_children(node: TreeNode, indent: str, lines: list[str]) -> None:
    children = sorted(node.children.values(), key=lambda child: child.tokens()[0])
    for position, child in enumerate(children):
        last = position == len(children) - 1
        lines.append(
            f"{indent}{'`-- ' if last else '|-- '}{_abbreviate(child.tokens())} "
            f"len={child.num_tokens} lock={child.lock_ref} t={child.last_access}"
        )
        _pretty_children(child, indent + ("    " if last else "|   "), lines)


def _abbreviate(tokens: list[int]) -> str:
    if len(tokens) <= _SHOWN_HEAD + _SHOWN_TAIL + 1:
        return "[" + " ".join(map(str, tokens)) + "]"
    head = " ".join(map(str, tokens[:_SHOWN_HEAD]))
    tail = " ".join(map(str, tokens[-_SHOWN_TAIL:]))
    return f"[{head} ... {tail}]"
