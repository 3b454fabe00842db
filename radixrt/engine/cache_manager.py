"""Slots for requests: the page pool and the prefix cache behind one contract.

Ownership rule: every KV slot is owned by exactly one of
  - the pool's free list,
  - the prefix cache (shared, read-only KV; a request may borrow it only
    while it holds a lock on it, taken by `admit` or `cache_computed`),
  - one request's private tail (`slots[cached_len:]`).
`check_invariants` verifies free + cached + private == pool size.

The scheduler is the only caller: it admits, reserves, caches and releases.
Two implementations: `RadixCacheManager` (radix_cache.py) shares prefixes
through the radix tree; `NoPrefixCache` here is the same contract with
nothing shared, for `disable_radix_cache` (every slot a request holds is
private and goes back to the pool when it ends).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Hashable, Iterable, Sequence

import torch

from radixrt.engine.request import Request
from radixrt.memory.page_pool import PagePool
from radixrt.tree import ALL_NAMESPACES, AllNamespaces, Divergence, RadixTree, TreeSnapshot
from radixrt.tree.events import CacheEvent

EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)


class CacheManager(ABC):
    """Pool bookkeeping shared by every cache; subclasses decide what is shared between requests."""

    #: Whether requests can hit each other's tokens (policies and in-batch sharing need it).
    caches_prefixes: bool = False

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.page_size = pool.page_size
        self.evicted_tokens = 0

    # --- capacity -------------------------------------------------------------------
    @property
    def obtainable_tokens(self) -> int:
        """Slots an allocation can get now: free ones plus what eviction can free."""
        return self.pool.available + self.evictable_tokens

    def pages_needed(self, req: Request, num_new_tokens: int) -> int:
        """Slots (whole pages) `req` must newly allocate to hold `num_new_tokens` more tokens."""
        missing = req.num_computed + num_new_tokens - req.slots.numel()
        return self.pool.pages_for(missing) * self.page_size if missing > 0 else 0

    def make_room(self, num_tokens: int) -> bool:
        """Evict least recently used cached tokens until `num_tokens` slots are free; False if impossible."""
        short = num_tokens - self.pool.available
        if short > 0:
            freed = self._evict(short)
            self.evicted_tokens += freed.numel()
            self.pool.free(freed)
        return self.pool.available >= num_tokens

    def reserve(self, req: Request, num_new_tokens: int) -> bool:
        """Give `req` slots for its next `num_new_tokens` tokens, evicting if needed."""
        need = self.pages_needed(req, num_new_tokens)
        if need == 0:
            return True
        if not self.make_room(need):
            return False
        req.slots = torch.cat([req.slots, self.pool.alloc(need)])
        return True

    # --- what subclasses decide -----------------------------------------------------
    @property
    @abstractmethod
    def cached_tokens(self) -> int:
        """Slots the cache owns."""

    @property
    @abstractmethod
    def evictable_tokens(self) -> int:
        """Cached slots no request holds a lock on."""

    @property
    @abstractmethod
    def protected_tokens(self) -> int:
        """Cached slots some request is using."""

    @abstractmethod
    def match_length(self, req: Request) -> int:
        """How many of the request's leading tokens are cached now (read-only: no lock, no LRU touch)."""

    @abstractmethod
    def prefix_path(self, req: Request) -> tuple[Hashable, ...]:
        """Handles of the cached nodes along the request's matched prefix, root first (read-only)."""

    @abstractmethod
    def explain(self, tokens: Sequence[int], namespace: Hashable, branch_tokens: int) -> Divergence:
        """Where `tokens` leave what is cached, and the closest cached branch (read-only)."""

    @abstractmethod
    def snapshot(self, max_nodes: int, namespace: Hashable | AllNamespaces = ALL_NAMESPACES) -> TreeSnapshot:
        """A bounded plain-data copy of what is cached, for pictures (read-only)."""

    def drain_events(self) -> list[CacheEvent]:
        """Inserts and evictions since the last drain, for a router's mirror (none: nothing is shared)."""
        return []

    @abstractmethod
    def admit(self, req: Request) -> None:
        """Borrow the longest cached prefix of the request's tokens and lock it; sets num_computed."""

    @abstractmethod
    def cache_computed(self, req: Request) -> None:
        """Share the request's computed tokens now, while it runs (a prompt or a chunk of it is done)."""

    @abstractmethod
    def release(self, req: Request, keep_computed: bool = True) -> None:
        """The request stops holding KV: cache what it computed (if `keep_computed`), free the rest, unlock.

        Used when a request finishes, is aborted, or is retracted under memory
        pressure (its computed tokens stay cached as evictable entries, so its
        recomputation later is often a cache hit).
        """

    @abstractmethod
    def flush(self) -> None:
        """Drop every cached prefix (only valid when no request holds a lock)."""

    @abstractmethod
    def _evict(self, num_tokens: int) -> torch.Tensor:
        """Remove at least `num_tokens` unlocked cached tokens if possible; return their slots."""

    def _check_cache_invariants(self) -> None:
        """Subclass hook: the cache's own structure."""

    # --- integrity and numbers --------------------------------------------------------
    def check_invariants(self, active: Iterable[Request]) -> None:
        self.pool.check_invariants()
        self._check_cache_invariants()
        private = 0
        for req in active:
            assert req.cached_len <= req.num_computed <= req.slots.numel(), f"{req.rid}: slot bookkeeping broken"
            assert req.slots.numel() % self.page_size == 0, f"{req.rid}: holds a partial page"
            private += req.private_slots
        total = self.pool.available + self.cached_tokens + private
        assert total == self.pool.num_slots, (
            f"slot ownership does not add up: free {self.pool.available} + cached {self.cached_tokens} "
            f"+ private {private} != pool {self.pool.num_slots}"
        )

    def stats(self) -> dict[str, int]:
        return {
            "tree_tokens": self.cached_tokens,
            "evictable_tokens": self.evictable_tokens,
            "protected_tokens": self.protected_tokens,
            "evicted_tokens": self.evicted_tokens,
            "pool_used_tokens": self.pool.num_slots - self.pool.available,
            "pool_total_tokens": self.pool.num_slots,
        }


class NoPrefixCache(CacheManager):
    """Nothing is shared: a request computes its whole prompt and frees every slot at the end."""

    caches_prefixes = False

    @property
    def cached_tokens(self) -> int:
        return 0

    @property
    def evictable_tokens(self) -> int:
        return 0

    @property
    def protected_tokens(self) -> int:
        return 0

    def match_length(self, req: Request) -> int:
        return 0

    def prefix_path(self, req: Request) -> tuple[Hashable, ...]:
        return ()

    def explain(self, tokens: Sequence[int], namespace: Hashable, branch_tokens: int) -> Divergence:
        return Divergence(0, 0, [])

    def snapshot(self, max_nodes: int, namespace: Hashable | AllNamespaces = ALL_NAMESPACES) -> TreeSnapshot:
        return RadixTree(self.page_size).snapshot(max_nodes, namespace)

    def admit(self, req: Request) -> None:
        req.slots, req.cached_len, req.last_node, req.num_computed = EMPTY_SLOTS, 0, None, 0
        req.clear_prompt_logprobs()
        if req.cached_tokens is None:
            req.cached_tokens = 0

    def cache_computed(self, req: Request) -> None:
        pass  # nothing is shared while the request runs

    def release(self, req: Request, keep_computed: bool = True) -> None:
        self.pool.free(req.slots)
        req.slots, req.cached_len, req.num_computed, req.last_node = EMPTY_SLOTS, 0, 0, None

    def flush(self) -> None:
        pass  # nothing cached

    def _evict(self, num_tokens: int) -> torch.Tensor:
        return EMPTY_SLOTS

