"""Fresh anonymous memory for the big CPU buffers (the KV pool), and the bytes a
decode step streams in full kept side by side in it on 2 MB pages.

A batch-1 decode step reads every packed weight once, ~96 MB for the bundled
model. Packed one by one, the weights sat on 4 KB pages wherever the
allocator put them (torch's asks for huge pages only when
THP_MEM_ALLOC_ENABLE is set, and most weights are below 2 MB anyway):
~24,000 pages a step, a TLB entry each. Copied into one buffer that Linux
backs with transparent huge pages, the layers' and the LM head's weights
need a few dozen TLB entries instead, and the step is faster, most in the
minutes when memory reads fast (docs/benchmarks.md, "Huge pages for the
packed weights"). Where the OS gives no huge pages the buffer is still one
contiguous run.

The buffer is written on 4 KB pages and moved onto huge pages afterwards, by
a background thread at the lowest priority (`settle`: `MADV_COLLAPSE` a
stretch at a time, then `MADV_HUGEPAGE` for what the kernel's own collapsing
finds later). Faulting fresh huge pages in while loading made the start
several times slower on virtual machines, where a never-touched 2 MB page
costs the host a fault of its own (docs/benchmarks.md, "Start time from a
GGUF file"); the first requests run on small pages, later ones on huge pages,
with the same bytes throughout.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import mmap
import os
import threading
from collections.abc import Sequence

import torch

HUGE_PAGE = 2 << 20
ALIGNMENT = 64  # each copy starts on a cache line, as the kernels' loads expect
MADV_COLLAPSE = 25  # Linux 6.1: back a range with huge pages now (EINVAL on older kernels: nothing happens)
_COLLAPSE_STRETCH = 16 * HUGE_PAGE  # collapsed per call, so the thread yields between stretches

_unsettled: list[mmap.mmap] = []  # buffers asked for on huge pages, not yet moved onto them (`settle`)
_unsettled_lock = threading.Lock()


def anonymous_bytes(num_bytes: int, huge: bool = False) -> torch.Tensor | None:
    """`num_bytes` of fresh private anonymous memory as a uint8 tensor that keeps it alive,
    untouched (the kernel zeroes each page on first touch) and, if `huge`, moved onto huge
    pages by the next `settle`; None where the OS has no anonymous mappings (Windows)."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):
        return None
    # MAP_PRIVATE: a shared anonymous mapping is shmem, which gets no transparent huge pages
    buffer = mmap.mmap(-1, max(num_bytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        with _unsettled_lock:
            _unsettled.append(buffer)
    return torch.frombuffer(buffer, dtype=torch.uint8)[:num_bytes]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _madvise(buffer: mmap.mmap, advice: int, start: int = 0, length: int | None = None) -> bool:
    """madvise(2) over bytes [start, start + length) of `buffer` through libc, so that the call
    releases the GIL (mmap.madvise holds it: a long call would stall every Python thread);
    False where it failed or libc is not at hand."""
    libc = _libc()
    if libc is None:
        return False
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    except (TypeError, ValueError):
        return False
    length = len(buffer) - start if length is None else length
    return libc.madvise(ctypes.c_void_p(address + start), ctypes.c_size_t(length), ctypes.c_int(advice)) == 0


def settle() -> threading.Thread | None:
    """Move the buffers written since the last call onto huge pages, in a background thread at
    the lowest priority (see the module docstring); returns it (None: nothing to move). The
    buffers' bytes stay as they are: the kernel copies each stretch before remapping it."""
    with _unsettled_lock:
        buffers = _unsettled[:]
        _unsettled.clear()
    if not buffers:
        return None
    thread = threading.Thread(target=_collapse, args=(buffers,), name="radixrt-huge-pages", daemon=True)
    thread.start()
    return thread


def _collapse(buffers: list[mmap.mmap]) -> None:
    try:  # Linux: the priority of this thread alone
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass
    for buffer in buffers:
        if buffer.closed or not _madvise(buffer, mmap.MADV_HUGEPAGE):  # no transparent huge pages: 4 KB pages
            continue
        # a stretch that fails (an older kernel, memory too fragmented) stays on 4 KB pages, same bytes
        for start in range(0, len(buffer), _COLLAPSE_STRETCH):
            _madvise(buffer, MADV_COLLAPSE, start, min(_COLLAPSE_STRETCH, len(buffer) - start))


class SideBySide:
    """`side_by_side` for tensors built one at a time: the buffer for all of `sizes` (bytes, in
    order) is taken up front, untouched, and each tensor is copied into the next slot as it is
    built (`place`), so its original can go at once: a load holds one copy of the weights, not two.

    With `stored` (a mapping of `span(sizes)` bytes: a copy of such a buffer written earlier,
    `packed_copy`) every slot already holds its bytes: `written` is True, `take` hands the
    slots out to be described, not written, and `place` copies nothing."""

    def __init__(self, sizes: Sequence[int], stored: mmap.mmap | None = None):
        self._sizes = list(sizes)
        self._starts = [0, *itertools.accumulate(_aligned(size) for size in self._sizes)]
        total = self._total = self._starts.pop()
        if stored is not None:
            if len(stored) != total:
                raise ValueError(f"a stored buffer of {len(stored)} bytes for slots spanning {total}")
            self._whole: torch.Tensor | None = torch.frombuffer(stored, dtype=torch.uint8)
            self._first = 0
        else:
            self._whole = anonymous_bytes(total + HUGE_PAGE, huge=True) if total else None
            self._first = 0 if self._whole is None else -self._whole.data_ptr() % HUGE_PAGE
        self.written = stored is not None
        self._next = 0

    @staticmethod
    def span(sizes: Sequence[int]) -> int:
        """The bytes from the first slot's start to the last one's end (each slot 64-byte aligned)."""
        return sum(_aligned(size) for size in sizes)

    def take(self, num_bytes: int) -> torch.Tensor:
        """The next slot, to be written into (`num_bytes` must be its size); fresh memory where
        the OS has no anonymous mappings."""
        if self._next >= len(self._sizes) or num_bytes != self._sizes[self._next]:
            raise ValueError(f"slot {self._next} of {len(self._sizes)}: {num_bytes} bytes do not fit")
        start = self._first + self._starts[self._next]
        self._next += 1
        return torch.empty(num_bytes, dtype=torch.uint8) if self._whole is None else self._whole[start : start + num_bytes]

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """The next slot holding a copy of `tensor` (contiguous uint8 of the slot's size)."""
        slot = self.take(tensor.numel()).view(tensor.shape)
        return slot if self.written else slot.copy_(tensor)

    def contents(self) -> torch.Tensor:
        """Every slot's bytes as one run (`span(sizes)` bytes): what a stored copy holds. Empty where
        the OS gave no buffer (each slot then has memory of its own)."""
        if self._whole is None:
            return torch.empty(0, dtype=torch.uint8)
        return self._whole[self._first : self._first + self._total]


def _aligned(num_bytes: int) -> int:
    """`num_bytes` rounded up to whole `ALIGNMENT`s: a slot and the gap before the next one."""
    return -(-num_bytes // ALIGNMENT) * ALIGNMENT


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim): loading packs weights
    through temporaries the allocator otherwise keeps resident. A no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def side_by_side(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (contiguous uint8, on the CPU) in one buffer on huge pages where
    the OS has them, in order, each starting on a 64-byte boundary. The copies keep the
    buffer alive; the originals can go."""
    for i, tensor in enumerate(tensors):
        if tensor.dtype != torch.uint8 or tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(
                f"tensors[{i}]: expected a contiguous uint8 CPU tensor, got {tensor.dtype} on {tensor.device}"
                f"{'' if tensor.is_contiguous() else ' (not contiguous)'}"
            )
    placed = SideBySide([tensor.numel() for tensor in tensors])
    copies = [placed.place(tensor) for tensor in tensors]
    settle()
    return copies
