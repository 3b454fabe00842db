"""A model's packed weights kept on disk after its first start, so that later starts map them
instead of packing them again.

Packing writes every weight into fresh anonymous memory, and a process's
first touch of fresh memory is most of what packing costs (the kernel
zeroes each page; on a virtual machine the host faults it in too). A copy of
the packed buffer in a file needs none of that on a later start: its pages
are in the page cache, and Linux maps a file written in large folios with
huge pages straight away (`FilePmdMapped` in smaps), where anonymous memory
needs the background collapse of `huge_pages.settle` first.

    $RADIXRT_CACHE_DIR (default ~/.cache/radixrt)/packed/<source stem>-<source path hash>-<key>.packed

The key hashes everything the bytes depend on (the caller's `identity`: the
source file's identity and what was packed from it at which dtype; the
kernels' library, whose name hashes its sources and level, and the Python
code that lays weights out). A copy is written once, after the first start's
packing, by a background thread at the lowest priority, into a temporary
name that is synced and renamed when complete: a reader sees a whole copy or
none, even after a crash, and the first start does not wait for the disk (the
process's exit does). It is written only where it pays (`MIN_COPY_BYTES`) and
there is room for it (`_FREE_SPACE_FACTOR` times its size free). Writing a
copy of a source deletes its copies under older keys, and the folder keeps
the `MAX_COPIES` most recently used. RADIXRT_PACKED_COPIES=0 turns copies off
(neither read nor written).

A copy is mapped private and never written to: its pages stay the page
cache's, shared by every process that maps them.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from radixrt.memory import huge_pages
from radixrt.paths import cache_root

logger = logging.getLogger(__name__)

ENVIRONMENT_VARIABLE = "RADIXRT_PACKED_COPIES"
SUFFIX = ".packed"
MAX_COPIES = 8
# Below this many bytes packing costs too little for a copy to pay for its disk space.
MIN_COPY_BYTES = 64 << 20
_FREE_SPACE_FACTOR = 2  # a copy leaves at least its own size free on the disk
_WRITE_STRETCH = 32 << 20  # bytes per write call, so the writer yields between them
# The Python code that lays packed weights out; the C layouts are in the library's name.
_LAYOUT_SOURCES = ("kernels/cpu/matmul.py", "memory/huge_pages.py", "model/gguf_loader.py", "model/gguf_int4.py",
                   "model/linear.py", "model/quantize.py")
_FORMAT = b"radixrt-packed-copy-v1"  # a change to what a copy file holds changes this

_writers: list[threading.Thread] = []


def enabled() -> bool:
    """Whether packed copies are read and written (RADIXRT_PACKED_COPIES: 1, the default, or 0)."""
    value = os.environ.get(ENVIRONMENT_VARIABLE, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENVIRONMENT_VARIABLE}={value!r}: expected 1 (packed copies on) or 0 (off)")
    return value == "1"


def copy_path(name: str, sources: Sequence[Path], packed: object, library: str | None) -> Path | None:
    """Where the copy of the weights packed from the files `sources` lives: `packed` says what
    was packed from them and how (plain data, hashed through its repr), `library` is the name of
    the kernels' library that packed it (`cpu.library_name`). None where copies are off, or without a library or sources.
    The key holds each source's path, device, inode, size and modification time, so a changed
    file is packed again."""
    if library is None or not sources or not enabled():
        return None
    files = []
    for source in sources:
        stat = source.stat()
        files.append((str(source.resolve()), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns))
    digest = hashlib.sha256(b"\0".join([_FORMAT, repr((files, packed)).encode(), library.encode()]))
    root = Path(__file__).resolve().parents[1]
    for layout in _LAYOUT_SOURCES:
        digest.update(b"\0" + (root / layout).read_bytes())
    tag = hashlib.sha256(files[0][0].encode()).hexdigest()[:8]  # the copies of one source share it (`_prune`)
    return cache_root() / "packed" / f"{name}-{tag}-{digest.hexdigest()[:16]}{SUFFIX}"


def buffer(sizes: Sequence[int], path: Path | None) -> huge_pages.SideBySide:
    """The buffer for slots of `sizes`: the copy at `path` mapped, its slots already written
    (`SideBySide.written`), where a whole one is there; else fresh memory to pack into."""
    if path is not None and enabled():
        try:
            with open(path, "rb") as file:
                if os.fstat(file.fileno()).st_size == huge_pages.SideBySide.span(sizes):
                    stored = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_PRIVATE,
                                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
                    with contextlib.suppress(OSError):
                        os.utime(path)  # used now: pruned last
                    return huge_pages.SideBySide(sizes, stored=stored)
                logger.warning("%s has the wrong size for its key; packing again and replacing it", path)
        except (OSError, ValueError):
            pass
    return huge_pages.SideBySide(sizes)


def keep(placed: huge_pages.SideBySide, path: Path | None) -> None:
    """Write `placed`'s bytes to `path` in the background (see the module docstring), where it
    was packed here rather than mapped from a copy, copies are on, and it pays."""
    if path is None or placed.written or not enabled():
        return
    contents = placed.contents()
    if contents.numel() < MIN_COPY_BYTES:
        return
    # not a daemon: a process that ends soon after its first start still leaves the copy behind
    thread = threading.Thread(target=_write, args=(contents, path), name="radixrt-packed-copy")
    _writers.append(thread)
    thread.start()


def wait_for_writers() -> None:
    """Wait for the copies being written (a process about to end with `os._exit`, tests)."""
    while _writers:
        _writers.pop().join()


def _write(contents: torch.Tensor, path: Path) -> None:
    with contextlib.suppress(AttributeError, OSError):  # Linux: the priority of this thread alone
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    folder = path.parent
    tmp = folder / f".{path.name}.{os.getpid()}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(folder)
        if shutil.disk_usage(folder).free < _FREE_SPACE_FACTOR * contents.numel():
            logger.info("not enough free disk space for a packed copy of %s bytes in %s; later starts pack again",
                        contents.numel(), folder)
            return
        values = contents.numpy()
        with open(tmp, "wb") as file:
            for start in range(0, values.size, _WRITE_STRETCH):
                file.write(values[start : start + _WRITE_STRETCH].data)  # releases the GIL
            file.flush()
            os.fsync(file.fileno())  # on disk before it has its name: a crash never leaves a named partial copy
        os.replace(tmp, path)  # readers see a whole copy or none
        _prune(path)
    except OSError as error:
        logger.info("could not write the packed copy %s (%s); later starts pack again", path, error)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def _prune(written: Path) -> None:
    """Delete the copies of `written`'s source under other keys, then all but the `MAX_COPIES`
    most recently used (a concurrent pruner may get there first)."""
    same_source = written.name.rsplit("-", 1)[0] + "-"
    copies = [path for path in written.parent.glob(f"*{SUFFIX}") if path != written]
    for stale in [path for path in copies if path.name.startswith(same_source)]:
        stale.unlink(missing_ok=True)
    by_age = sorted(written.parent.glob(f"*{SUFFIX}"), key=_modified, reverse=True)
    for stale in by_age[MAX_COPIES:]:
        stale.unlink(missing_ok=True)


def _modified(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _remove_abandoned(folder: Path) -> None:
    """Temporary files whose writer process is gone (it ended before its copy was complete)."""
    for tmp in folder.glob(f".*{SUFFIX}.*.tmp"):
        try:
            os.kill(int(tmp.name.rsplit(".", 2)[-2]), 0)
        except ValueError:
            continue
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except PermissionError:  # a live process of another user
            continue
