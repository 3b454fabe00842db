"""The token-level radix tree prefix cache (RadixAttention's core).

See docs/tree.md for the API, the ownership and page rules, and why matching
is fast.
"""

from __future__ import annotations

from radixrt.tree.explain import Divergence
from radixrt.tree.node import MatchResult, TreeNode
from radixrt.tree.radix_tree import RadixTree
from radixrt.tree.snapshot import ALL_NAMESPACES, AllNamespaces, NodeView, TreeSnapshot
from radixrt.tree.svg import render_svg

__all__ = [
    "ALL_NAMESPACES",
    "AllNamespaces",
    "Divergence",
    "MatchResult",
    "NodeView",
    "RadixTree",
    "TreeNode",
    "TreeSnapshot",
    "render_svg",
]
