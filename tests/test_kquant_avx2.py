"""The AVX2 product over format_layout.h's tiles (kernels/cpu/kquant_matmul_avx2.c) against the
portable C kernel and a float64 product of gguf's dequantized weights.

The kernels are built at the AVX2 level (-march=haswell) whatever this CPU's best level is, so
the AVX2 code is tested on AVX-512 machines too. The AVX2 kernel rounds each input to a 16-bit
integer of its group's step s = max|x| / 32767 (an input moves by at most 0.51 s: s / 2 and the
float32 rounding of s and 1 / s) and accumulates in float32, so per output

    |avx2 - exact| <= sum_k |w_k| a_k  +  4 K 2^-24 sum_k (|d sc q|_k + |offset|_k) (|x_k| + a_k)

with a_k = 0.51 s for the input's group (max|x| for a group below 2^-64, which counts as zeros)
and the weight's two parts (d sc q and -dmin m, or d q and m) taken apart, since float32 rounds
each before they cancel. The portable kernel is within the second term alone (a_k = 0).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.benchmarks.gguf_models import _random_blocks
from radixrt.kernels import cpu
from radixrt.kernels.cpu.format_matmul import FORMATS, FormatMatmul, FormatWeight
from radixrt.kernels.cpu.formats import BLOCKS

NATIVE = ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1")
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
TINY = 2.0**-64
KERNELS_DIR = Path(cpu.__file__).parent


def _cpu_runs_avx2() -> bool:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return {"avx2", "fma", "f16c"} <= set(flags.split(":", 1)[1].split())


def _compile_avx2(directory: Path) -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    target = directory / "radixrt_cpu_avx2.so"
    flags = ("-O3", "-march=haswell", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared")
    sources = sorted(map(str, KERNELS_DIR.glob("*.c")))
    subprocess.run([compiler, *flags, *sources, "-o", str(target), "-lm"], check=True, capture_output=True)
    return ctypes.CDLL(str(target))


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> ctypes.CDLL:
    """The kernels at the AVX2 level: the per-level build where the package has one, else compiled here."""
    if not _cpu_runs_avx2():
        pytest.skip("this CPU lacks AVX2, FMA or F16C")
    try:
        from radixrt.kernels.cpu import build  # one build per instruction-set level
    except ImportError:
        built = _compile_avx2(tmp_path_factory.mktemp("kernels_avx2"))
    else:
        built = build.library("avx2")
    if built is None:
        pytest.skip("no C compiler: the CPU kernels cannot be built")
    assert hasattr(built, "kquant_matmul_tiles_avx2"), "the AVX2 build lacks the AVX2 K-quant kernel"
    return built


@pytest.fixture(scope="module")
def kernels(library) -> FormatMatmul:
    return FormatMatmul(library)


def random_blocks(name: str, num_rows: int, num_cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid file rows: K-quants as random codes and sub-block scales, Q5_0/Q5_1 quantized by gguf."""
    qtype = gguf.GGMLQuantizationType[name]
    if name in K_QUANTS:
        return np.ascontiguousarray(_random_blocks(qtype, (num_rows, num_cols), rng))
    values = rng.standard_normal((num_rows, num_cols)).astype(np.float32)
    return np.ascontiguousarray(gguf.quants.quantize(values, qtype))


def dequantized(name: str, blocks: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[name])).double()


def weight_parts(name: str, blocks: np.ndarray) -> torch.Tensor:
    """|d sc q| + |offset| per weight: each block with its second fp16 (dmin or m), then its d, zeroed."""
    dense = dequantized(name, blocks)
    if name not in ("Q4_K", "Q5_K", "Q5_1"):  # no offset: the weight is its one part
        return dense.abs()
    block_bytes = BLOCKS[FORMATS[name]][1]
    parts = torch.zeros_like(dense)
    for zeroed in (slice(2, 4), slice(0, 2)):  # d at bytes 0-1, dmin or m at 2-3
        copy = blocks.copy().reshape(blocks.shape[0], -1, block_bytes)
        copy[:, :, zeroed] = 0
        parts += dequantized(name, copy.reshape(blocks.shape)).abs()
    return parts


def input_moves(x: torch.Tensor) -> torch.Tensor:
    """a_k: how far the AVX2 kernel may move each input (see the module docstring)."""
    groups = x.double().reshape(x.shape[0], -1, 32)
    largest = groups.abs().amax(-1, keepdim=True)
    moves = torch.where(largest >= TINY, 0.51 * largest / 32767, largest)
    return moves.expand_as(groups).reshape(x.shape)


def bounds(x: torch.Tensor, dense: torch.Tensor, parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(portable's, avx2's) error bounds per output against the float64 product."""
    xd, moves = x.double().abs(), input_moves(x)
    float32 = 4 * x.shape[1] * 2.0**-24
    portable = float32 * (xd @ parts.t())
    return portable, float32 * ((xd + moves) @ parts.t()) + moves @ dense.abs().t()


def random_inputs(rng: np.random.Generator, m: int, num_cols: int, pad: int, spread: bool) -> torch.Tensor:
    """bf16 rows [m, num_cols] with row stride num_cols + pad; `spread`: groups of 32 scaled by
    0, 2^-70 (below the kernel's floor), 1e-3, 1 or 1e3."""
    values = rng.standard_normal((m, num_cols + pad))
    if spread:
        factors = rng.choice([0.0, 2.0**-70, 1e-3, 1.0, 1.0, 1e3], size=(m, (num_cols + pad + 31) // 32))
        values *= np.repeat(factors, 32, axis=1)[:, : num_cols + pad]
    return torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16)[:, :num_cols]


def tiles_product(library: ctypes.CDLL, x: torch.Tensor, weight: FormatWeight, first: int, last: int) -> torch.Tensor:
    """radixrt_format_matmul_tiles over tiles [first, last) into fp32 outputs filled with NaN."""
    scratch_bytes = library.radixrt_format_matmul_scratch_bytes
    scratch_bytes.argtypes, scratch_bytes.restype = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64], ctypes.c_int64
    matmul = library.radixrt_format_matmul_tiles
    matmul.restype = None
    m = x.shape[0]
    scratch = torch.empty(scratch_bytes(weight.format, m, weight.num_cols), dtype=torch.uint8)
    out = torch.full((m, weight.num_rows), float("nan"))
    matmul(ctypes.c_int(weight.format), ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.stride(0)),
           ctypes.c_int64(m), ctypes.c_void_p(weight.data.data_ptr()), ctypes.c_int64(weight.num_rows),
           ctypes.c_int64(weight.num_cols), ctypes.c_void_p(out.data_ptr()), None, ctypes.c_void_p(scratch.data_ptr()),
           ctypes.c_int64(first), ctypes.c_int64(last))
    return out


formats = st.sampled_from(NATIVE)


@settings(max_examples=60, deadline=None)
@given(name=formats, tiles=st.integers(1, 5), units=st.integers(1, 3), m=st.integers(1, 300), pad=st.integers(0, 40),
       spread=st.booleans(), seed=st.integers(0, 2**16))
def test_avx2_products_are_within_the_bound_of_the_exact_one(kernels, name, tiles, units, m, pad, spread, seed):
    """AVX2 and portable kernels against float64 (and each other), any M, x with a row stride."""
    rng = np.random.default_rng(seed)
    num_rows, num_cols = 16 * tiles, BLOCKS[FORMATS[name]][0] * units
    m = min(m, 24) if seed % 4 else m  # a few large batches, most small: the examples stay fast
    file_rows = random_blocks(name, num_rows, num_cols, rng)
    weight = kernels.pack_blocks(FORMATS[name], torch.from_numpy(file_rows))
    dense = dequantized(name, file_rows)
    x = random_inputs(rng, m, num_cols, pad, spread)
    exact = x.double() @ dense.t()
    portable_bound, avx2_bound = bounds(x, dense, weight_parts(name, file_rows))
    avx2 = kernels(x, weight, torch.empty(m, num_rows)).double()
    portable = kernels(x, weight, torch.empty(m, num_rows), portable=True).double()
    assert ((avx2 - exact).abs() <= avx2_bound).all(), (name, (avx2 - exact).abs().max())
    assert ((portable - exact).abs() <= portable_bound).all(), (name, (portable - exact).abs().max())
    assert ((avx2 - portable).abs() <= avx2_bound + portable_bound).all()
    as_bf16 = kernels(x, weight)
    assert torch.equal(as_bf16.view(torch.int16), avx2.float().to(torch.bfloat16).view(torch.int16))


@settings(max_examples=30, deadline=None)
@given(name=formats, tiles=st.integers(1, 6), m=st.integers(1, 20), seed=st.integers(0, 2**16), data=st.data())
def test_a_rows_bits_do_not_depend_on_its_batch_tiles_or_threads(library, kernels, name, tiles, m, seed, data):
    """Row j alone, in a sub-batch starting elsewhere, over a range of tiles, on 1-3 threads."""
    rng = np.random.default_rng(seed)
    num_rows, num_cols = 16 * tiles, BLOCKS[FORMATS[name]][0] * 2
    weight = kernels.pack_blocks(FORMATS[name], torch.from_numpy(random_blocks(name, num_rows, num_cols, rng)))
    x = random_inputs(rng, m, num_cols, 0, data.draw(st.booleans()))
    j = data.draw(st.integers(0, m - 1))
    start = data.draw(st.integers(0, j))
    first = data.draw(st.integers(0, tiles - 1))
    last = data.draw(st.integers(first + 1, tiles))
    with cpu.kernel_threads(1):
        whole = kernels(x, weight, torch.empty(m, num_rows))
    alone = kernels(x[j : j + 1], weight, torch.empty(1, num_rows))
    assert torch.equal(alone[0], whole[j])
    sub = kernels(x[start:], weight, torch.empty(m - start, num_rows))
    assert torch.equal(sub[j - start], whole[j])
    for threads in (2, 3):
        with cpu.kernel_threads(threads):
            assert torch.equal(kernels(x, weight, torch.empty(m, num_rows)), whole)
    ranged = tiles_product(library, x[start:], weight, first, last)
    columns = slice(16 * first, 16 * last)
    assert torch.equal(ranged[j - start, columns], whole[j, columns])
    assert ranged[:, : 16 * first].isnan().all() and ranged[:, 16 * last :].isnan().all()  # nothing else written


@pytest.mark.parametrize("name", NATIVE)
def test_the_dispatch_runs_the_avx2_kernel(library, kernels, name):
    """radixrt_format_matmul_tiles in an AVX2 build is kquant_matmul_tiles_avx2, bit for bit."""
    rng = np.random.default_rng(1)
    num_rows, num_cols, m = 32, BLOCKS[FORMATS[name]][0] * 2, 5
    weight = kernels.pack_blocks(FORMATS[name], torch.from_numpy(random_blocks(name, num_rows, num_cols, rng)))
    x = random_inputs(rng, m, num_cols, 0, False)
    scratch_bytes = library.kquant_matmul_scratch_bytes_avx2
    scratch_bytes.argtypes, scratch_bytes.restype = [ctypes.c_int64, ctypes.c_int64], ctypes.c_int64
    scratch = torch.empty(scratch_bytes(m, num_cols), dtype=torch.uint8)
    direct = torch.full((m, num_rows), float("nan"))
    kernel = library.kquant_matmul_tiles_avx2
    kernel.restype = None
    kernel(ctypes.c_int(weight.format), ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.stride(0)), ctypes.c_int64(m),
           ctypes.c_void_p(weight.data.data_ptr()), ctypes.c_int64(num_rows), ctypes.c_int64(num_cols),
           ctypes.c_void_p(direct.data_ptr()), None, ctypes.c_void_p(scratch.data_ptr()), ctypes.c_int64(0),
           ctypes.c_int64(num_rows // 16))
    assert torch.equal(tiles_product(library, x, weight, 0, num_rows // 16), direct)
    assert not torch.equal(kernels(x, weight, torch.empty(m, num_rows), portable=True), direct)  # not the C twin


def test_zero_and_tiny_inputs_give_zero(kernels):
    """Groups of zeros, or of inputs below 2^-64 (counted as zeros), contribute exactly nothing."""
    rng = np.random.default_rng(2)
    for name in NATIVE:
        num_cols = BLOCKS[FORMATS[name]][0]
        weight = kernels.pack_blocks(FORMATS[name], torch.from_numpy(random_blocks(name, 16, num_cols, rng)))
        x = torch.zeros(2, num_cols, dtype=torch.bfloat16)
        x[1] = torch.from_numpy(rng.standard_normal(num_cols) * 2.0**-70).to(torch.bfloat16)
        assert (kernels(x, weight, torch.empty(2, 16)) == 0).all(), name
