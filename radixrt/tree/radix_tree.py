"""A token-level radix tree of KV-cache slots, shared across requests.

Ownership rule: the tree owns the slot indices stored in its nodes. A request
that matched a prefix borrows those slots and may use them only while it holds
a lock on `MatchResult.last_node`; `evict` hands unlocked slots back to the
caller, who returns them to the `PagePool`. `insert` copies the slots it keeps;
for the tokens that were already cached it keeps its own slots, and the caller
frees its duplicates.

Page rule: with `page_size > 1` the tree stores only whole pages. Keys are cut
to `len(tokens) // page_size * page_size` tokens, matches are whole pages, and
edges split only at page boundaries, so every node's slots are whole pages.
"""

from __future__ import annotations

import heapq
from array import array
from collections import deque
from collections.abc import Hashable

import torch

from radixrt.tree import debug
from radixrt.tree.events import CacheEvent
from radixrt.tree.explain import Divergence, find_divergence
from radixrt.tree.keys import (
    TOKEN_BYTES,
    Packed,
    Tokens,
    check_token_range,
    pack_slots,
    pack_tokens,
    release_views,
    unpack_slots,
)
from radixrt.tree.node import MatchResult, TreeNode
from radixrt.tree.snapshot import (
    ALL_NAMESPACES,
    HEAD_TOKENS,
    AllNamespaces,
    EvictedEdge,
    TreeSnapshot,
    take_snapshot,
)
from radixrt.tree.walk import walk

EVICTED_KEPT = 16
"""Evicted edges remembered for pictures (drawn as ghosts under their parent)."""
GHOST_KEY_BYTES = HEAD_TOKENS * TOKEN_BYTES


def _eviction_event(node: TreeNode) -> CacheEvent:
    """The event of evicting `node`: its whole path from the root, and where its edge starts."""
    keys = []
    top = node
    while top.parent is not None:
        keys.append(top.key)
        top = top.parent
    path = b"".join(reversed(keys))
    return CacheEvent("evict", top.namespace, path, (len(path) - len(node.key)) // TOKEN_BYTES)


def _check_indices(indices: torch.Tensor, num_tokens: int) -> None:
    if not isinstance(indices, torch.Tensor):
        raise ValueError(f"indices must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dim() != 1 or indices.dtype != torch.int64:
        raise ValueError(
            f"indices must be a 1-D int64 tensor, got {indices.dim()}-D {indices.dtype}"
        )
    if indices.numel() != num_tokens:
        raise ValueError(
            f"indices must have one slot per token: {num_tokens} tokens, "
            f"{indices.numel()} indices"
        )


class RadixTree:
    """Prefix cache: token sequences -> KV slots, with LRU eviction of leaves.

    Each namespace (any hashable, e.g. a tenant salt; None by default) has its
    own root, so equal tokens under different namespaces never match.

    Eviction order is least recently used first, where "used" is the last
    `match_prefix` or `insert` whose path covered the node. Nodes record that
    time on the walk; the heap of evictable leaves, keyed by
    (last_access, node_id), is only brought up to date inside `evict`, so a
    match costs no heap work at all.
    """

    def __init__(self, page_size: int = 1):
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        self.page_size = page_size
        self._page_bytes = page_size * TOKEN_BYTES
        self._roots: dict[Hashable, TreeNode] = {}
        # A min-heap of evictable leaves as (lru_stamp, node_id, node); see
        # _file_if_evictable. node_ids are unique, so nodes are never compared.
        self._lru: list[tuple[int, int, TreeNode]] = []
        self._clock = 0
        self._next_id = 0
        self._evictable_tokens = 0
        self._protected_tokens = 0
        self._evicted: deque[EvictedEdge] = deque(maxlen=EVICTED_KEPT)
        # Changes of the token set for a mirror (see radixrt.tree.events); None while nobody listens.
        self._events: list[CacheEvent] | None = None
        self._stale_entries = 0  # LRU entries of forgotten nodes (see forget)
        self._mirror_slots = 0  # slot numbers handed out by apply_events

    # ----------------------------------------------------------------- sizes
    @property
    def total_tokens(self) -> int:
        """Tokens (= slots) held by the tree."""
        return self._evictable_tokens + self._protected_tokens

    @property
    def evictable_tokens(self) -> int:
        """Tokens on nodes that no lock covers."""
        return self._evictable_tokens

    @property
    def protected_tokens(self) -> int:
        """Tokens on locked paths: `evict` never frees them."""
        return self._protected_tokens

    # -------------------------------------------------------------- matching
    def match_prefix(self, tokens: Tokens, namespace: Hashable = None) -> MatchResult:
        """The longest cached whole-page prefix of `tokens`.

        Refreshes the access time of the matched path. Where the match ends
        inside an edge the node is split, so `last_node` ends exactly at the
        match; with nothing matched it is the namespace's root.
        """
        packed = pack_tokens(tokens)
        query = self._whole_pages(packed)
        try:
            root = self._find_root(namespace)
            path, offset, cut = walk(root, query, self._page_bytes)
            check_token_range(packed, offset)
            last_node = self._commit(root or self._new_root(namespace), path, cut)
        finally:
            release_views(query, packed)
        return MatchResult(offset // TOKEN_BYTES, last_node, [node.slots for node in path])

    def insert(self, tokens: Tokens, indices: torch.Tensor, namespace: Hashable = None) -> int:
        """Cache `tokens` -> `indices`; return how many leading tokens were cached.

        `indices` is a 1-D int64 tensor with one slot per token. The tree
        copies the slots of the tokens it did not have (whole pages only) and
        keeps its own slots for the returned number of leading tokens: the
        caller frees `indices[:returned]` where they differ from the tree's,
        and any tail beyond the last whole page stays the caller's.
        """
        packed = pack_tokens(tokens)
        query = self._whole_pages(packed)
        try:
            _check_indices(indices, len(packed) // TOKEN_BYTES)
            root = self._find_root(namespace)
            path, offset, cut = walk(root, query, self._page_bytes)
            check_token_range(packed, offset)
            node = self._commit(root or self._new_root(namespace), path, cut)
            if offset < len(query):
                # A copy: the caller may reuse its tensor (e.g. a request-table row).
                slots = pack_slots(indices, offset // TOKEN_BYTES, len(query) // TOKEN_BYTES)
                leaf = TreeNode(node, bytes(query[offset:]), slots, self._clock, self._new_id())
                node.children[leaf.key[: self._page_bytes]] = leaf
                self._evictable_tokens += leaf.num_tokens
                self._file_if_evictable(leaf)
                if self._events is not None:
                    self._events.append(CacheEvent("insert", namespace, bytes(query)))
        finally:
            release_views(query, packed)
        return offset // TOKEN_BYTES

    def _commit(
        self, root: TreeNode, path: list[TreeNode], cut: tuple[TreeNode, int] | None
    ) -> TreeNode:
        """Refresh the walked path's access time, make its split; return its end.

        A split node joins `path`, so `path` then lists exactly the nodes
        whose slots make up the matched prefix.
        """
        self._clock += 1
        clock = self._clock
        for node in path:
            node.last_access = clock
        if cut is not None:
            upper = self._split(*cut)
            upper.last_access = clock
            path.append(upper)
        return path[-1] if path else root

    # --------------------------------------------------------------- locking
    def lock(self, node: TreeNode) -> None:
        """Protect the path root..`node` from eviction (a reference count)."""
        self._check_handle(node)
        self._add_to_path(node, +1)
        node.own_lock_ref += 1

    def unlock(self, node: TreeNode) -> None:
        """Release one `lock(node)`; the path becomes evictable at count 0."""
        self._check_handle(node)
        if node.own_lock_ref <= 0:
            raise ValueError(f"unlock of a node that is not locked: {node!r}")
        node.own_lock_ref -= 1
        self._add_to_path(node, -1)
        if node.parent is not None:
            self._file_if_evictable(node)

    def _check_handle(self, node: TreeNode) -> None:
        if not isinstance(node, TreeNode):
            raise ValueError(f"expected a TreeNode, got {type(node).__name__}")
        top = node
        while top.parent is not None:
            top = top.parent
        if self._roots.get(top.namespace) is not top:
            raise ValueError(
                f"{node!r} is not in this tree (it was evicted, or the tree reset)"
            )

    def _add_to_path(self, node: TreeNode | None, delta: int) -> None:
        # Moves a node's tokens between evictable and protected exactly when
        # its count leaves or reaches zero.
        while node is not None:
            if node.lock_ref == 0:
                self._evictable_tokens -= node.num_tokens
                self._protected_tokens += node.num_tokens
            node.lock_ref += delta
            if node.lock_ref == 0:
                self._protected_tokens -= node.num_tokens
                self._evictable_tokens += node.num_tokens
            node = node.parent

    # -------------------------------------------------------------- eviction
    def evict(self, num_tokens: int) -> torch.Tensor:
        """Free at least `num_tokens` slots, least recently used leaves first.

        Removes whole unlocked leaves (a parent left childless becomes a
        leaf in turn) until enough slots are freed or nothing evictable is
        left; returns the freed slots, whole pages, in eviction order. The
        caller now owns them and returns them to its pool. A huge count
        empties everything evictable.
        """
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        lru, page_bytes = self._lru, self._page_bytes
        freed: list[bytes] = []
        num_freed = 0
        while num_freed < num_tokens and lru:
            stamp, node_id, node = heapq.heappop(lru)
            if node.children or node.lock_ref or node.parent is None:  # None: forgotten (see forget)
                node.lru_stamp = -1  # no longer an evictable leaf; refiled when it is again
                continue
            if node.last_access != stamp:
                node.lru_stamp = node.last_access  # used since it was filed
                heapq.heappush(lru, (node.last_access, node_id, node))
                continue
            node.lru_stamp = -1
            parent = node.parent
            assert parent is not None, "only nodes below a root are filed"
            if self._events is not None:
                self._events.append(_eviction_event(node))
            del parent.children[node.key[:page_bytes]]
            node.parent = None
            freed.append(node.slots)
            ghost_head = node.key[:GHOST_KEY_BYTES]
            self._evicted.append((node.node_id, parent.node_id, node.num_tokens, ghost_head, self._clock))
            num_freed += node.num_tokens
            self._evictable_tokens -= node.num_tokens
            if parent.parent is not None:
                self._file_if_evictable(parent)
        return unpack_slots(freed)

    # ------------------------------------------------------------ mirroring
    def record_events(self) -> None:
        """Start recording inserts and evictions for a mirror; `drain_events` hands them over.

        The first events insert every sequence already cached (one per leaf),
        so a mirror that starts from empty is exact from the start.
        """
        if self._events is not None:
            return
        self._events = []
        for namespace, root in self._roots.items():
            stack = [(root, b"")]
            while stack:
                node, path = stack.pop()
                path += node.key
                if not node.children and node.parent is not None:
                    self._events.append(CacheEvent("insert", namespace, path))
                stack.extend((child, path) for child in node.children.values())

    def drain_events(self) -> list[CacheEvent]:
        """The changes since the last drain, oldest first (empty when not recording)."""
        if self._events is None:
            return []
        events, self._events = self._events, []
        return events

    def apply_events(self, events: list[CacheEvent]) -> None:
        """Make this tree a mirror: replay another tree's inserts and evictions, in order.

        A mirror holds the same token sets; its slots are only numbered (so
        the invariant that no slot is held twice still checks it), and it
        never locks, so every edge it forgets is free to go.
        """
        for event in events:
            tokens = array("Q")
            tokens.frombytes(event.tokens)
            if event.kind == "insert":
                first, self._mirror_slots = self._mirror_slots, self._mirror_slots + len(tokens)
                self.insert(tokens, torch.arange(first, self._mirror_slots), event.namespace)
            else:
                self.forget(tokens, event.keep, event.namespace)

    def forget(self, tokens: Tokens, keep: int, namespace: Hashable = None) -> int:
        """Drop the cached tokens of `tokens` past its first `keep` that nothing else uses.

        For mirrors: when the mirrored tree evicts a leaf edge (`tokens[keep:]`
        of the path `tokens`), the mirror forgets the same tokens, whatever
        its own split points. Tokens another cached sequence continues from
        stay, and so do locked ones. `keep` must be whole pages. Returns how
        many tokens went.
        """
        packed = pack_tokens(tokens)
        query = self._whole_pages(packed)
        try:
            check_token_range(packed, 0)
            if isinstance(keep, bool) or not isinstance(keep, int) or not 0 <= keep * TOKEN_BYTES <= len(query):
                raise ValueError(f"keep must be an int in [0, {len(query) // TOKEN_BYTES}], got {keep!r}")
            if keep % self.page_size:
                raise ValueError(f"keep must be whole pages of {self.page_size} tokens, got {keep}")
            path, offset, cut = walk(self._find_root(namespace), query, self._page_bytes)
        finally:
            release_views(query, packed)
        if cut is not None or not path:
            return 0  # the path's last tokens continue in a longer cached sequence, or nothing is cached
        return self._drop_leaf_chain(path[-1], offset // TOKEN_BYTES, keep)

    def _drop_leaf_chain(self, node: TreeNode, end: int, keep: int) -> int:
        """Remove unlocked leaves upward from `node` (ending at token `end`) down to token `keep`."""
        dropped = 0
        parent = node.parent
        while parent is not None and not node.children and not node.lock_ref and end > keep:
            start = end - node.num_tokens
            if start < keep:
                parent = self._split(node, (keep - start) * TOKEN_BYTES)
                start = keep
            del parent.children[node.key[: self._page_bytes]]
            dropped += node.num_tokens
            self._stale_entries += node.lru_stamp >= 0
            node.parent, node.lru_stamp = None, -1  # a dead handle; evict skips its stale LRU entry
            node, end, parent = parent, start, parent.parent
        self._evictable_tokens -= dropped
        if dropped and node.parent is not None:
            self._file_if_evictable(node)
        if self._stale_entries * 2 > len(self._lru):  # amortized: a mirror never evicts to pop them
            self._lru = [entry for entry in self._lru if entry[2].parent is not None]
            heapq.heapify(self._lru)
            self._stale_entries = 0
        return dropped

    def reset(self) -> None:
        """Drop every node; every handle dies. The caller resets its pool."""
        self._roots = {}
        self._lru = []
        self._stale_entries = 0
        self._evictable_tokens = 0
        self._protected_tokens = 0
        self._evicted.clear()

    # ------------------------------------------------------------ explaining
    def explain(self, tokens: Tokens, namespace: Hashable = None, branch_tokens: int = 32) -> Divergence:
        """Where `tokens` leave the cached tree, token by token, and the closest branch.

        Changes nothing (no split, no access-time refresh), so explaining a
        prompt never reorders eviction. See `radixrt.tree.explain`.
        """
        packed = pack_tokens(tokens)
        try:
            check_token_range(packed, 0)
            return find_divergence(self._find_root(namespace), packed, self.page_size, branch_tokens)
        finally:
            release_views(packed)

    def snapshot(self, max_nodes: int, namespace: Hashable | AllNamespaces = ALL_NAMESPACES) -> TreeSnapshot:
        """A bounded plain-data copy for drawing: heaviest branches kept, the rest folded.

        `namespace` limits it to one namespace (a tenant sees only its own);
        by default every namespace is included.
        """
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
            raise ValueError(f"max_nodes must be an int >= 1, got {max_nodes!r}")
        if isinstance(namespace, AllNamespaces):
            roots = self._roots
        else:
            root = self._find_root(namespace)
            roots = {} if root is None else {namespace: root}
        return take_snapshot(
            roots, self._evicted, max_nodes=max_nodes, clock=self._clock
        )

    # ------------------------------------------------------------- debugging
    def check_invariants(self) -> None:
        """Assert every structural invariant (see `radixrt.tree.debug`)."""
        debug.check_invariants(
            self._roots,
            self._lru,
            page_size=self.page_size,
            evictable_tokens=self._evictable_tokens,
            protected_tokens=self._protected_tokens,
        )

    def pretty(self) -> str:
        """A readable dump: abbreviated tokens, sizes, lock counts, access times."""
        return debug.pretty(
            self._roots,
            page_size=self.page_size,
            evictable_tokens=self._evictable_tokens,
            protected_tokens=self._protected_tokens,
        )

    # ------------------------------------------------------------- internals
    def _whole_pages(self, packed: Packed) -> Packed:
        cut = len(packed) - len(packed) % self._page_bytes
        return packed if cut == len(packed) else packed[:cut]

    def _find_root(self, namespace: Hashable) -> TreeNode | None:
        try:
            return self._roots.get(namespace)
        except TypeError:
            raise ValueError(
                f"namespace must be hashable, got {type(namespace).__name__}"
            ) from None

    def _new_root(self, namespace: Hashable) -> TreeNode:
        root = TreeNode(None, b"", b"", 0, self._new_id(), namespace)
        self._roots[namespace] = root
        return root

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _split(self, child: TreeNode, matched_bytes: int) -> TreeNode:
        """Cut `child`'s edge after `matched_bytes`; return the new upper node.

        The new node becomes the parent and takes the front of the edge, so
        `child` (and any handle to it) keeps ending where it ended.
        """
        matched = matched_bytes // TOKEN_BYTES
        key, page_bytes, parent = child.key, self._page_bytes, child.parent
        assert parent is not None, "walk cuts only edges below a root"
        upper = TreeNode(
            parent,
            key[:matched_bytes],
            child.slots[:matched_bytes],
            child.last_access,
            self._new_id(),
        )
        upper.lock_ref = child.lock_ref
        upper.children[key[matched_bytes : matched_bytes + page_bytes]] = child
        parent.children[key[:page_bytes]] = upper
        child.parent = upper
        child.key = key[matched_bytes:]
        child.slots = child.slots[matched_bytes:]
        child.num_tokens -= matched
        return upper

    def _file_if_evictable(self, node: TreeNode) -> None:
        # Each node is filed at most once, under a stamp <= its last_access.
        # `evict` drops entries whose node stopped being an evictable leaf
        # and refiles those used since, so the first entry that survives is
        # the true LRU leaf (ties broken by node_id).
        if node.lru_stamp < 0 and not node.children and node.lock_ref == 0:
            node.lru_stamp = node.last_access
            heapq.heappush(self._lru, (node.last_access, node.node_id, node))
