"""Loading the kernels' library, once a process, and the thread count each call runs on."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from radixrt.kernels.cpu import build

# Shapes the kernels' fixed-size buffers hold (MAX_GROUP, MAX_HEAD_DIM in the source).
MAX_GROUP = 16
MAX_HEAD_DIM = 256

_Bound = TypeVar("_Bound")
_lock = threading.Lock()
_library: list[ctypes.CDLL | None] = []  # empty until the first accessor call, then [library or None]
_calling_thread = threading.local()  # .threads: the `kernel_threads` override of this thread's calls


class kernel_threads:
    """Run the kernels this thread calls inside the block on `count` threads (None: torch's
    count, the default), whatever torch's own thread count is meanwhile.

    A decode step's torch ops are too small to gain from a second thread and pay its wake-up
    instead, while the C kernels (one parallel region for a whole step, spin barriers inside)
    gain from every core: the model runner sets the two counts apart. (A class, not a
    generator: entered at every step, where a generator's context manager costs several
    times as much.)
    """

    def __init__(self, count: int | None):
        self._count = count
        self._previous: int | None = None

    def __enter__(self) -> None:
        self._previous = getattr(_calling_thread, "threads", None)
        _calling_thread.threads = self._count

    def __exit__(self, *exc_info: object) -> None:
        _calling_thread.threads = self._previous


def call_threads() -> int:
    """The threads a kernel called now runs on: this thread's `kernel_threads`, else torch's count."""
    return getattr(_calling_thread, "threads", None) or torch.get_num_threads()


def load_library() -> ctypes.CDLL | None:
    """The kernels' library at the level in use (`build.selected_level`), built on the first call
    in any process on this machine. ValueError for an unknown RADIXRT_CPU_ISA."""
    with _lock:
        if not _library:
            _library.append(build.library(build.selected_level()))
        return _library[0]


def library_name() -> str | None:
    """The file name of the library in use (`build` names it by a hash of its sources and level),
    or None where the kernels cannot be built: what bytes packed by these kernels depend on."""
    library = load_library()
    return None if library is None else Path(library._name).name


def isa() -> str:
    """The instruction-set level of the kernels in use: "portable", "avx2" or "avx512" (what the
    loaded build reports; "none" where the kernels cannot be built)."""
    library = load_library()
    return "none" if library is None else build.level_of(library)


def bind(kind: Callable[[ctypes.CDLL], _Bound]) -> _Bound | None:
    """`kind` over the kernels' library (a binding class); None where the kernels cannot be built."""
    library = load_library()
    return None if library is None else kind(library)
