"""One build of the CPU kernels per instruction-set level, and the choice of the level to load.

The sources are compiled once per level, each with its own flags, and cached
under `cache_root()/kernels` by a hash of the sources, the flags, the
compiler's version and the CPU's flags. Only the level in use is built
(lazily, on the first kernel accessor call); tests may open several side by
side, each `ctypes.CDLL` keeping its own symbols.

    portable  plain C for the architecture's baseline (x86-64 without AVX);
              the reference every SIMD kernel is tested against
    avx2      AVX2 + FMA + F16C + BMI2 (-march=haswell)
    avx512    this CPU's own flags (-march=native) where it has AVX512F/BW/VL,
              AVX512-BF16 and AVX512-VNNI

The level loaded is the best the CPU runs, capped by the environment variable
RADIXRT_CPU_ISA (portable | avx2 | avx512). A CPU without a supported vector
extension, or not an x86 one, gets the portable build.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
import uuid
from pathlib import Path

from radixrt.paths import cache_root

logger = logging.getLogger(__name__)

LEVELS = ("portable", "avx2", "avx512")  # in order: each runs wherever a later one does
ENVIRONMENT_VARIABLE = "RADIXRT_CPU_ISA"
_SOURCES = tuple(sorted(Path(__file__).parent.glob("*.c")))
_HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))
# No -ffast-math: linking it would switch the whole process to flush-to-zero floats.
_FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared")
# The CPU flags (as /proc/cpuinfo names them) a level's code may use.
_LEVEL_CPU_FLAGS = {
    "avx2": frozenset({"avx", "avx2", "fma", "f16c", "bmi2"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}),
}
_X86 = platform.machine().lower() in {"x86_64", "amd64", "i686", "i386"}

_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL | None] = {}  # level -> its library (None: could not be built)
_logged: set[str] = set()


def level_flags(level: str) -> tuple[str, ...]:
    """The compiler flags of a level's build."""
    check_level(level, "level")
    if level == "portable":
        return ("-march=x86-64", "-mtune=generic") if _X86 else ()
    return ("-march=haswell",) if level == "avx2" else ("-march=native",)


def check_level(value: str, name: str) -> str:
    if value not in LEVELS:
        raise ValueError(f"{name} must be one of {', '.join(LEVELS)}, got {value!r}")
    return value


def cpu_level(flags: frozenset[str] | None = None) -> str:
    """The best level this CPU (or one with these /proc/cpuinfo `flags`) runs."""
    if flags is None:
        if not _X86:
            return "portable"
        flags = frozenset(_cpu_flags().split(":", 1)[-1].split())
    best = "portable"
    for level in LEVELS[1:]:
        if _LEVEL_CPU_FLAGS[level] <= flags:
            best = level
    return best


def selected_level(cap: str | None = None, cpu: str | None = None) -> str:
    """The level to load: the CPU's best (`cpu`), capped by `cap` (default: RADIXRT_CPU_ISA).
    A cap above the CPU gives the CPU's best; an unknown cap is a ValueError."""
    if cap is None:
        cap = os.environ.get(ENVIRONMENT_VARIABLE, "").strip().lower() or None
    if cap is not None:
        check_level(cap, ENVIRONMENT_VARIABLE)
    best = cpu_level() if cpu is None else cpu
    if best == "portable":
        _log_once(f"this CPU has no vector extension radixrt's kernels use ({platform.machine()}): portable C kernels")
    if cap is None or LEVELS.index(cap) >= LEVELS.index(best):
        if cap is not None and cap != best:
            _log_once(f"{ENVIRONMENT_VARIABLE}={cap}: this CPU runs at most {best}; using {best}", logging.WARNING)
        return best
    return cap


def library(level: str) -> ctypes.CDLL | None:
    """The kernels' library built for `level` (compiled on its first use on this machine), or
    None where it cannot be built (no C compiler, not Linux, the compiler failed)."""
    check_level(level, "level")
    with _lock:
        if level not in _libraries:
            _libraries[level] = _build_and_open(level)
        return _libraries[level]


def level_of(built: ctypes.CDLL) -> str:
    """The level a library was compiled at, as its C `radixrt_isa_level()` reports it."""
    return LEVELS[int(built.radixrt_isa_level())]


def _log_once(message: str, level: int = logging.INFO) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.log(level, message)


def _build_and_open(level: str) -> ctypes.CDLL | None:
    if platform.system() != "Linux":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found (set CC): radixrt's CPU kernels fall back to torch's slower ops")
        return None
    try:
        return ctypes.CDLL(str(_build(compiler, level)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.warning("could not build radixrt's CPU kernels (%s, %s); using torch's ops", level, detail)
        return None


def _build(compiler: str, level: str) -> Path:
    """The shared library for these sources, compiler, level and CPU, compiled if not cached yet."""
    flags = (*_FLAGS, *level_flags(level))
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256()
    for part in (*(source.read_bytes() for source in (*_SOURCES, *_HEADERS)), " ".join(flags).encode(),
                 version.encode(), _cpu_flags().encode()):
        digest.update(part)
    target = cache_root() / "kernels" / f"radixrt_cpu_{level}-{digest.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
    logger.info("compiling radixrt's CPU kernels (%s) for this CPU (once per machine, a few seconds)", level)
    subprocess.run([compiler, *flags, *map(str, _SOURCES), "-o", str(tmp), "-lm"], capture_output=True, text=True,
                   check=True)
    os.replace(tmp, target)  # a concurrent build writes the same bytes; readers see a whole file
    return target


def _cpu_flags() -> str:
    """The CPU's feature flags: -march=native code must not be reused on another CPU."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return platform.processor()
