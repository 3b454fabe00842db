"""Free-list of KV-cache pages.

Ownership rule: every page is owned by exactly one of the pool's free list, a
radix-tree node, or a running request's private tail. The pool only knows the
first; `check_invariants` in the engine checks that the three add up.
"""

from __future__ import annotations

import torch


class OutOfPages(RuntimeError):
    """Raised by `PagePool.alloc` when fewer free pages remain than asked for."""

    def __init__(self, requested_tokens: int, available_tokens: int):
        super().__init__(
            f"cannot allocate {requested_tokens} KV slots: only {available_tokens} free"
        )
        self.requested_tokens = requested_tokens
        self.available_tokens = available_tokens


class PagePool:
    """Allocates KV slots in whole pages of `page_size` consecutive slots.

    Slot `s` lives in page `s // page_size`. `alloc(n)` hands out
    `ceil(n / page_size)` whole pages, as the int64 tensor of all their slots
    in order, so a request's slots are always page-aligned and the paged
    kernels can address them by page index.
    """

    # Declared here: `_free_all`, which __init__ and `reset` share, sets them.
    _free_pages: torch.Tensor
    _num_free: int
    _is_free: torch.Tensor

    def __init__(self, num_pages: int, page_size: int = 1):
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be an int >= 1, got {num_pages!r}")
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._page_offsets = torch.arange(page_size, dtype=torch.int64)
        self._free_all()

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def available(self) -> int:
        """Free slots (a multiple of page_size)."""
        return self._num_free * self.page_size

    @property
    def available_pages(self) -> int:
        return self._num_free

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc(self, num_tokens: int) -> torch.Tensor:
        """Slots for `num_tokens` tokens, rounded up to whole pages."""
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        num_pages = self.pages_for(num_tokens)
        if num_pages > self._num_free:
            raise OutOfPages(num_tokens, self.available)
        start = self._num_free - num_pages
        pages = self._free_pages[start : self._num_free].flip(0)
        self._num_free = start
        self._is_free[pages] = False
        return self._slots_of(pages)

    def free(self, slots: torch.Tensor) -> None:
        """Return whole pages, given as their slots (as `alloc` or the tree gave them)."""
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype != torch.int64:
            raise ValueError("slots must be a 1-D int64 tensor")
        if slots.numel() == 0:
            return
        slots = slots.cpu()
        pages = self._pages_of(slots)
        if int(pages.min()) < 0 or int(pages.max()) >= self.num_pages:
            raise ValueError(f"slot out of range [0, {self.num_slots})")
        if torch.unique(pages).numel() != pages.numel():
            raise ValueError("the same page is freed twice in one call")
        if bool(self._is_free[pages].any()):
            raise ValueError("double free: a slot being freed is already free")
        self._is_free[pages] = True
        end = self._num_free + pages.numel()
        self._free_pages[self._num_free : end] = pages
        self._num_free = end

    def _pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        if self.page_size == 1:
            return slots
        if slots.numel() % self.page_size:
            raise ValueError(f"slots must be whole pages of {self.page_size}")
        grid = slots.view(-1, self.page_size)
        pages = grid[:, 0] // self.page_size
        if not torch.equal(grid, pages[:, None] * self.page_size + self._page_offsets):
            raise ValueError(f"slots must be whole, in-order pages of {self.page_size}")
        return pages

    def _slots_of(self, pages: torch.Tensor) -> torch.Tensor:
        if self.page_size == 1:
            return pages.clone()
        return (pages[:, None] * self.page_size + self._page_offsets).reshape(-1)

    def reset(self) -> None:
        """Mark every page free (the caller drops every other owner first)."""
        self._free_all()

    def _free_all(self) -> None:
        # Stack of free page ids; pop from the end. Lower ids are handed out
        # first, which keeps a fresh pool's slots contiguous.
        self._free_pages = torch.arange(self.num_pages - 1, -1, -1, dtype=torch.int64)
        self._num_free = self.num_pages
        self._is_free = torch.ones(self.num_pages, dtype=torch.bool)

    def check_invariants(self) -> None:
        free = self._free_pages[: self._num_free]
        assert 0 <= self._num_free <= self.num_pages
        assert torch.unique(free).numel() == self._num_free, "free list holds a page twice"
        assert int(self._is_free.sum()) == self._num_free, "free mask and free list disagree"
        if self._num_free:
            assert bool(self._is_free[free].all()), "free list holds a used page"
