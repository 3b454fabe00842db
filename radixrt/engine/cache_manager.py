"""Slots for requests: the page pool and the radix tree behind one contract.

Ownership rule: every KV slot is owned by exactly one of
  - the pool's free list,
  - a radix-tree node (shared, read-only KV; a request may borrow it only
    while it holds a lock on the node's path),
  - one request's private tail (`slots[cached_len:]`).
`check_invariants` verifies free + tree + private == pool size.

With the radix cache disabled there is no tree: every slot a request holds is
private and goes back to the pool when it ends.
"""

from __future__ import annotations

from typing import Hashable, Iterable, Sequence

import torch

from radixrt.engine.request import Request
from radixrt.memory.page_pool import PagePool
from radixrt.tree import RadixTree

_EMPTY = torch.empty(0, dtype=torch.int64)


class CacheManager:
    def __init__(self, pool: PagePool, enable_radix_cache: bool = True):
        self.pool = pool
        self.page_size = pool.page_size
        self.tree = RadixTree(page_size=pool.page_size) if enable_radix_cache else None
        self.evicted_tokens = 0

    # --- capacity -------------------------------------------------------
    @property
    def free_tokens(self) -> int:
        return self.pool.available

    @property
    def evictable_tokens(self) -> int:
        return self.tree.evictable_tokens if self.tree else 0

    @property
    def obtainable_tokens(self) -> int:
        """Slots an allocation can get now: free ones plus what eviction can free."""
        return self.free_tokens + self.evictable_tokens

    def pages_needed(self, req: Request, num_new_tokens: int) -> int:
        """Slots (whole pages) `req` must newly allocate to hold `num_new_tokens` more tokens."""
        missing = req.num_computed + num_new_tokens - req.slots.numel()
        return self.pool.pages_for(missing) * self.page_size if missing > 0 else 0

    def make_room(self, num_tokens: int) -> bool:
        """Evict LRU tree leaves until `num_tokens` slots are free; False if impossible."""
        short = num_tokens - self.pool.available
        if short > 0 and self.tree is not None:
            freed = self.tree.evict(short)
            self.evicted_tokens += freed.numel()
            self.pool.free(freed)
        return self.pool.available >= num_tokens

    # --- request lifecycle ------------------------------------------------
    def admit(self, req: Request) -> None:
        """Borrow the longest cached prefix of the request's tokens and lock it."""
        if self.tree is None:
            req.slots, req.cached_len, req.last_node = _EMPTY, 0, None
        else:
            match = self.tree.match_prefix(req.fill_ids[: req.max_prefix_match()], namespace=req.namespace)
            self.tree.lock(match.last_node)
            req.slots, req.cached_len, req.last_node = match.indices, match.length, match.last_node
        req.num_computed = req.cached_len
        req.prompt_logprobs.clear()  # scoring restarts at or before its first scored token
        if req.cached_tokens is None:
            req.cached_tokens = req.cached_len

    def reserve(self, req: Request, num_new_tokens: int) -> bool:
        """Give `req` slots for its next `num_new_tokens` tokens, evicting if needed."""
        need = self.pages_needed(req, num_new_tokens)
        if need == 0:
            return True
        if not self.make_room(need):
            return False
        req.slots = torch.cat([req.slots, self.pool.alloc(need)])
        return True

    def cache_computed(self, req: Request) -> None:
        """Put the request's computed tokens into the tree and move its lock down to them.

        Called when a prompt (or a chunk of it) has been computed, so that
        later requests and requests still waiting hit it while this one runs.
        """
        if self.tree is None:
            return
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
        """The request stops holding KV: cache what it computed, free the rest, unlock.

        Used when a request finishes, is aborted, or is retracted under memory
        pressure (its computed tokens stay in the tree as evictable entries, so
        its recomputation later is often a cache hit).
        """
        if self.tree is not None:
            num_tokens = req.num_computed // self.page_size * self.page_size if keep_computed else 0
            if num_tokens > req.cached_len:
                self._insert_and_free_duplicates(req, req.fill_ids[:num_tokens], num_tokens)
            else:
                num_tokens = req.cached_len
            self.pool.free(req.slots[num_tokens:])
            self.tree.unlock(req.last_node)
        else:
            self.pool.free(req.slots)
        req.slots, req.cached_len, req.num_computed, req.last_node = _EMPTY, 0, 0, None

    def _insert_and_free_duplicates(self, req: Request, tokens: Sequence[int], num_tokens: int) -> None:
        already_cached = self.tree.insert(tokens, req.slots[:num_tokens], namespace=req.namespace)
        # Tokens the tree already had (another request inserted them since we
        # matched): our private copies of them are duplicates.
        if already_cached > req.cached_len:
            self.pool.free(req.slots[req.cached_len : already_cached])

    def flush(self) -> None:
        """Drop every cached prefix (only valid when no request holds a lock)."""
        if self.tree is None:
            return
        if self.tree.protected_tokens:
            raise RuntimeError("flush_cache needs an idle runtime: some requests still hold cached prefixes")
        freed = self.tree.evict(self.tree.total_tokens)
        self.pool.free(freed)

    # --- integrity --------------------------------------------------------
    def check_invariants(self, active: Iterable[Request]) -> None:
        self.pool.check_invariants()
        tree_tokens = 0
        if self.tree is not None:
            self.tree.check_invariants()
            tree_tokens = self.tree.total_tokens
        private = 0
        for req in active:
            assert req.cached_len <= req.num_computed <= req.slots.numel(), f"{req.rid}: slot bookkeeping broken"
            assert req.slots.numel() % self.page_size == 0, f"{req.rid}: holds a partial page"
            private += req.private_slots
        total = self.pool.available + tree_tokens + private
        assert total == self.pool.num_slots, (
            f"slot ownership does not add up: free {self.pool.available} + tree {tree_tokens} "
            f"+ private {private} != pool {self.pool.num_slots}"
        )

    def stats(self) -> dict[str, int]:
        tree = self.tree
        return {
            "tree_tokens": tree.total_tokens if tree else 0,
            "evictable_tokens": tree.evictable_tokens if tree else 0,
            "protected_tokens": tree.protected_tokens if tree else 0,
            "evicted_tokens": self.evicted_tokens,
            "pool_used_tokens": self.pool.num_slots - self.pool.available,
            "pool_total_tokens": self.pool.num_slots,
        }


def namespace_key(cache_salt: str | None) -> Hashable:
    return None if cache_salt is None else ("salt", cache_salt)
