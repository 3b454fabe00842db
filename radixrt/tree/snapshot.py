"""A bounded, plain-data copy of the tree, for pictures and dashboards.

Taken on the thread that owns the tree (between engine steps), then drawn
anywhere: it holds no node, so the tree may change while it is rendered. A
big tree is summarized, not truncated at random: nodes are kept heaviest
subtree first (tokens below them), so the branches that hold the cache stay
visible, and each kept node's remaining children fold into one "+N more"
entry that still counts their nodes and tokens.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from radixrt.tree.keys import TOKEN_BYTES
from radixrt.tree.node import TreeNode

HEAD_TOKENS = 12
"""Tokens kept from the front of each edge: enough for a readable snippet."""

class AllNamespaces:
    """The type of `ALL_NAMESPACES`: a snapshot of every namespace (None is a namespace)."""

    def __repr__(self) -> str:
        return "ALL_NAMESPACES"


ALL_NAMESPACES = AllNamespaces()

NodeState = Literal["namespace", "locked", "evictable", "evicted", "folded"]


EvictedEdge = tuple[int, int, int, bytes, int]
"""What the tree remembers of an edge it evicted, to draw it as a ghost: (the dead
node's id, its parent's id, its tokens, the first `HEAD_TOKENS` of its key, the
tree's clock then). A plain tuple of small values: `RadixTree.evict` makes one per
evicted node on its hot path, and holding the node itself kept its key and slots
alive until 16 more evictions had passed, which slowed long-context traces
(docs/benchmarks.md, "Radix tree internals")."""


@dataclass(frozen=True)
class NodeView:
    """One box of the picture.

    `parent_id` is None for a namespace's root (and for a fold of whole
    namespaces). For a fold, `num_tokens` and `num_nodes` add up what it
    stands for; otherwise `num_nodes` is 1. `last_access` orders recency.
    """

    node_id: int
    parent_id: int | None
    state: NodeState
    num_tokens: int
    head: tuple[int, ...]
    last_access: int
    lock_ref: int = 0
    subtree_tokens: int = 0
    num_nodes: int = 1
    namespace: Hashable = None


@dataclass(frozen=True)
class TreeSnapshot:
    """The kept nodes, each parent before its children, and the totals of what was asked for."""

    nodes: list[NodeView]
    total_nodes: int
    total_tokens: int
    protected_tokens: int
    clock: int


_Pending = tuple[int, int, TreeNode, int | None]
"""A node not yet kept: (-tokens under it, node_id, node, its parent's id)."""


class _Sizes:
    """Tokens and nodes under every node of the chosen namespaces, in one pass.

    This pass is the only part of a snapshot that grows with the tree (the
    rest touches kept nodes and their children), and it runs on the
    engine's thread: it is kept to one loop, keyed by the nodes themselves.
    """

    def __init__(self, roots: Iterable[TreeNode]):
        self.tokens: dict[TreeNode, int] = {}
        self.nodes: dict[TreeNode, int] = {}
        self.locked_tokens = 0
        tokens, nodes = self.tokens, self.nodes
        for root in roots:
            order = [root]
            for node in order:  # grows while iterating: a breadth-first listing
                order.extend(node.children.values())
            for node in reversed(order):
                num_tokens, num_nodes = node.num_tokens, 1
                for child in node.children.values():
                    num_tokens += tokens[child]
                    num_nodes += nodes[child]
                tokens[node], nodes[node] = num_tokens, num_nodes
                if node.lock_ref:
                    self.locked_tokens += node.num_tokens


def take_snapshot(
    roots: Mapping[Hashable, TreeNode],
    evicted: Iterable[EvictedEdge],
    *,
    max_nodes: int,
    clock: int,
) -> TreeSnapshot:
    """Keep at most `max_nodes` nodes (heaviest subtrees first), fold the rest."""
    sizes = _Sizes(roots.values())
    kept: dict[int, NodeView] = {}
    children_of: dict[int | None, list[NodeView]] = {}
    heap: list[_Pending] = [(-sizes.tokens[r], r.node_id, r, None) for r in roots.values()]
    heapq.heapify(heap)
    while heap and len(kept) < max_nodes:
        _, _, node, parent_id = heapq.heappop(heap)
        view = _view(node, parent_id, sizes)
        kept[node.node_id] = view
        children_of.setdefault(parent_id, []).append(view)
        for child in node.children.values():
            heapq.heappush(heap, (-sizes.tokens[child], child.node_id, child, node.node_id))
    _add_folds(heap, sizes, children_of)
    _add_ghosts(evicted, kept, children_of)
    ordered: list[NodeView] = []
    stack = list(reversed(children_of.get(None, [])))
    while stack:
        view = stack.pop()
        ordered.append(view)
        stack.extend(reversed(children_of.get(view.node_id, [])))
    return TreeSnapshot(
        ordered,
        total_nodes=sum(sizes.nodes[r] - 1 for r in roots.values()),
        total_tokens=sum(sizes.tokens[r] for r in roots.values()),
        protected_tokens=sizes.locked_tokens,
        clock=clock,
    )


def _view(node: TreeNode, parent_id: int | None, sizes: _Sizes) -> NodeView:
    state: NodeState
    if node.parent is None:
        state = "namespace"
    else:
        state = "locked" if node.lock_ref else "evictable"
    return NodeView(
        node_id=node.node_id,
        parent_id=parent_id,
        state=state,
        num_tokens=node.num_tokens,
        head=_head(node.key),
        last_access=node.last_access,
        lock_ref=node.lock_ref,
        subtree_tokens=sizes.tokens[node],
        namespace=node.namespace if node.parent is None else None,
    )


def _add_folds(
    left: list[_Pending],
    sizes: _Sizes,
    children_of: dict[int | None, list[NodeView]],
) -> None:
    """One "+N more" entry per kept node for the children that did not fit."""
    folds: dict[int | None, tuple[int, int]] = {}
    for _, _, node, parent_id in left:
        tokens, nodes = folds.get(parent_id, (0, 0))
        folds[parent_id] = (tokens + sizes.tokens[node], nodes + sizes.nodes[node])
    for fold_id, (parent_id, (tokens, nodes)) in enumerate(folds.items(), start=1):
        children_of.setdefault(parent_id, []).append(
            NodeView(-fold_id, parent_id, "folded", tokens, (), 0, subtree_tokens=tokens, num_nodes=nodes)
        )


def _add_ghosts(
    evicted: Iterable[EvictedEdge], kept: dict[int, NodeView], children_of: dict[int | None, list[NodeView]]
) -> None:
    """Recently evicted edges, under their parent when that parent is still drawn.

    Kept nodes are live ones, so a parent evicted since is simply not found.
    """
    for node_id, parent_id, num_tokens, head, evicted_at in evicted:
        if parent_id in kept:
            children_of.setdefault(parent_id, []).append(
                NodeView(node_id, parent_id, "evicted", num_tokens, _head(head), evicted_at)
            )


def _head(key: bytes) -> tuple[int, ...]:
    return tuple(memoryview(key[: HEAD_TOKENS * TOKEN_BYTES]).cast("Q").tolist())
