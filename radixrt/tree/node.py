"""The tree's node and the result of a prefix match."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from radixrt.tree.keys import TOKEN_BYTES, unpack_slots


class TreeNode:
    """One edge of the radix tree and the node it leads to.

    `key` holds the edge's tokens packed as native uint64 bytes and `slots`
    the KV slot of each of those tokens packed as native int64 bytes (so the
    two always have the same length in bytes). A node handle
    stays valid while the node is in the tree: when a split cuts its edge the
    tree inserts a new node above it and shortens this node's key from the
    front, so the handle still ends where it ended. Once the node is evicted
    (or the tree reset) `parent` is None and the handle is dead.
    """

    __slots__ = (
        "parent",
        "children",
        "key",
        "slots",
        "num_tokens",
        "lock_ref",
        "own_lock_ref",
        "last_access",
        "lru_stamp",
        "node_id",
        "namespace",
    )

    def __init__(
        self,
        parent: TreeNode | None,
        key: bytes,
        slots: bytes,
        last_access: int,
        node_id: int,
        namespace: Hashable = None,
    ):
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}
        self.key = key
        self.slots = slots
        self.num_tokens = len(key) // TOKEN_BYTES
        # lock_ref counts the locks on this node and below it (what protects
        # it); own_lock_ref only those taken on this node itself, so unlock
        # can refuse a node that holds a lock only through a descendant.
        self.lock_ref = 0
        self.own_lock_ref = 0
        self.last_access = last_access
        # The last_access under which this node is filed in the tree's LRU
        # list, or -1 when it is not filed (see RadixTree._file_if_evictable).
        self.lru_stamp = -1
        self.node_id = node_id
        # Only meaningful on a root: the namespace it is the root of.
        self.namespace = namespace

    def tokens(self) -> list[int]:
        """The edge's tokens as ints (for debugging and tests)."""
        return memoryview(self.key).cast("Q").tolist()

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.node_id}, tokens={self.num_tokens}, "
            f"lock_ref={self.lock_ref}, last_access={self.last_access})"
        )


class MatchResult:
    """The longest cached prefix of a query.

    `length` is the number of matched tokens (a multiple of the page size),
    `last_node` the node that ends exactly there (a namespace root when
    nothing matched) and `indices` the int64 KV slots of those tokens.
    `indices` is built only when first read, by concatenating the matched
    nodes' packed slots: a caller that needs only the length never pays.
    The slots belong to the tree; they are safe to use only while
    `last_node` is locked.
    """

    __slots__ = ("length", "last_node", "_parts", "_indices")

    def __init__(self, length: int, last_node: TreeNode, parts: list[bytes]):
        self.length = length
        self.last_node = last_node
        self._parts = parts
        self._indices: torch.Tensor | None = None

    @property
    def indices(self) -> torch.Tensor:
        if self._indices is None:
            self._indices = unpack_slots(self._parts)
            self._parts = []
        return self._indices

    def __repr__(self) -> str:
        return f"MatchResult(length={self.length}, last_node={self.last_node!r})"
