"""The token-level radix tree prefix cache (RadixAttention's core).

See docs/tree.md for the API, the ownership and page rules, and why matching
is fast.
"""

from __future__ import annotations

from radixrt.tree.node import MatchResult, TreeNode
from radixrt.tree.radix_tree import RadixTree

__all__ = ["MatchResult", "RadixTree", "TreeNode"]
