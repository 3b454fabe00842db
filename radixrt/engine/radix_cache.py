"""The radix-tree prefix cache: requests borrow the tree's KV and give theirs back to it.

A request borrows the tree-owned part of its slots through a lock on the
deepest node of its match (`req.last_node`); the lock keeps the whole path
from eviction. When some of its own tokens are computed, `cache_computed`
inserts them, frees any private copies of tokens another request inserted
meanwhile, and moves the lock down to the new node:

    before:  slots [ tree (locked at A) | private, computed | private, not yet written ]
    after:   slots [ tree (locked at B, a child of A) .... | private, not yet written ]

With `page_size > 1` only whole pages enter the tree.
"""

from __future__ import annotations

from array import array
from typing import Hashable, Sequence

import torch

from radixrt.engine.cache_manager import EMPTY_SLOTS, CacheManager
from radixrt.engine.request import Request
from radixrt.memory.page_pool import PagePool
from radixrt.tree.events import CacheEvent
from radixrt.tree import ALL_NAMESPACES, AllNamespaces, Divergence, RadixTree, TreeNode, TreeSnapshot


class RadixCacheManager(CacheManager):
    """The only door to the radix tree: the scheduler never touches the tree itself."""

    caches_prefixes = True

    def __init__(self, pool: PagePool):
        super().__init__(pool)
        self.tree = RadixTree(page_size=pool.page_size)

    @property
    def cached_tokens(self) -> int:
        return self.tree.total_tokens

    @property
    def evictable_tokens(self) -> int:
        return self.tree.evictable_tokens

    @property
    def protected_tokens(self) -> int:
        return self.tree.protected_tokens

    def match_length(self, req: Request) -> int:
        return self.tree.match_prefix(self._matchable(req), namespace=req.namespace).length

    def prefix_path(self, req: Request) -> tuple[Hashable, ...]:
        node: TreeNode | None = self.tree.match_prefix(self._matchable(req), namespace=req.namespace).last_node
        path = []
        while node is not None:
            path.append(node.node_id)
            node = node.parent
        return tuple(reversed(path))

    def explain(self, tokens: Sequence[int], namespace: Hashable, branch_tokens: int) -> Divergence:
        return self.tree.explain(list(tokens), namespace, branch_tokens)

    def snapshot(self, max_nodes: int, namespace: Hashable | AllNamespaces = ALL_NAMESPACES) -> TreeSnapshot:
        return self.tree.snapshot(max_nodes, namespace)

    def drain_events(self) -> list[CacheEvent]:
        self.tree.record_events()  # the first drain starts recording: it returns everything cached
        return self.tree.drain_events()

    def admit(self, req: Request) -> None:
        match = self.tree.match_prefix(self._matchable(req), namespace=req.namespace)
        self.tree.lock(match.last_node)
        req.slots, req.cached_len, req.last_node = match.indices, match.length, match.last_node
        req.num_computed = req.cached_len
        req.clear_prompt_logprobs()
        if req.cached_tokens is None:
            req.cached_tokens = req.cached_len

    def cache_computed(self, req: Request) -> None:
        num_tokens = req.num_computed // self.page_size * self.page_size
        if num_tokens <= req.cached_len:
            return
        tokens = req.fill_ids[:num_tokens]
        self._insert_and_free_duplicates(req, tokens, num_tokens)
        match = self.tree.match_prefix(tokens, namespace=req.namespace)
        assert match.length == num_tokens, "a just-inserted sequence must match in full"
        self.tree.lock(match.last_node)
        self.tree.unlock(req.last_node)
        req.slots = torch.cat([match.indices, req.slots[num_tokens:]])
        req.cached_len, req.last_node = num_tokens, match.last_node

    def release(self, req: Request, keep_computed: bool = True) -> None:
        num_tokens = req.num_computed // self.page_size * self.page_size if keep_computed else 0
        if num_tokens > req.cached_len:
            self._insert_and_free_duplicates(req, req.fill_ids[:num_tokens], num_tokens)
        else:
            num_tokens = req.cached_len
        self.pool.free(req.slots[num_tokens:])
        self.tree.unlock(req.last_node)
        req.slots, req.cached_len, req.num_computed, req.last_node = EMPTY_SLOTS, 0, 0, None

    def flush(self) -> None:
        if self.tree.protected_tokens:
            raise RuntimeError("flush_cache needs an idle runtime: some requests still hold cached prefixes")
        self.pool.free(self.tree.evict(self.tree.total_tokens))

    def _evict(self, num_tokens: int) -> torch.Tensor:
        return self.tree.evict(num_tokens)

    def _check_cache_invariants(self) -> None:
        self.tree.check_invariants()

    def _matchable(self, req: Request) -> array:
        return req.fill_ids[: req.max_prefix_match()]

    def _insert_and_free_duplicates(self, req: Request, tokens: array, num_tokens: int) -> None:
        already_cached = self.tree.insert(tokens, req.slots[:num_tokens], namespace=req.namespace)
        # Tokens the tree already had (another request inserted them since we
        # matched): our private copies of them are duplicates.
        if already_cached > req.cached_len:
            self.pool.free(req.slots[req.cached_len : already_cached])
