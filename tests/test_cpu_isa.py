"""The CPU kernels' builds per instruction-set level (kernels/cpu/build.py), side by side.

Every level this CPU runs is loaded in this process (each library keeps its own symbols) and its
quantized and rowwise matmuls are compared with the portable build's, the reference:

    |level - portable| <= 4 K 2^-24 sum_k |w_k| |x_k|  (+ the activation rounding, where there is one)

float32 sums of K terms in two different orders each lie within about K 2^-24 sum |w x| of the
exact sum. For a 4-bit weight |w| is taken as |d q| + |m|: the kernels add the offset's term
m sum x apart from the codes' one. Where a level rounds activations to 16-bit integers per group
of 32 (AVX2 both widths, AVX-512 8-bit), each input moves by at most half its group's step
s = max|x| / x16_max, adding sum_k |w_k| s_g / 2. Within a level, a row's bits do not depend on
the rows beside it or on the range of tiles computed.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.kernels import cpu
from radixrt.kernels.cpu import build
from tests.test_native_weights import random_int4, random_int8
from tests.test_quantized_matmul import x16_max

RUNNABLE = build.LEVELS[: build.LEVELS.index(build.cpu_level()) + 1]


def library(level: str) -> ctypes.CDLL:
    built = build.library(level)
    if built is None:
        pytest.skip("no C compiler: the kernels cannot be built")
    return built


def quantized(level: str) -> cpu.QuantizedMatmul:
    return cpu.QuantizedMatmul(library(level))


def weight_of(bits: int, num_rows: int, num_cols: int, seed: int):
    return (random_int4 if bits == 4 else random_int8)(num_rows, num_cols, seed=seed)


def pack(kernel: cpu.QuantizedMatmul, weight, bits: int) -> cpu.PackedWeight:
    if bits == 8:
        return kernel.pack_int8(weight.codes, weight.scales)
    return kernel.pack_int4(weight.codes, weight.scales, weight.offsets)


def magnitudes(weight, bits: int) -> torch.Tensor:
    """|d q| + |m| per weight, float64 [N, K]."""
    scales = weight.scales.double().repeat_interleave(32, 1)
    codes = weight.codes.double()
    if bits == 8:
        return (codes * scales).abs()
    return (codes * scales).abs() + weight.offsets.double().repeat_interleave(32, 1).abs()


def tolerance(x: torch.Tensor, weight, bits: int, level: str) -> torch.Tensor:
    xd, wd = x.double(), magnitudes(weight, bits)
    bound = 4 * x.shape[1] * 2.0**-24 * (xd.abs() @ wd.t())
    largest = x16_max(level, bits)
    if largest is not None:
        step = xd.abs().reshape(xd.shape[0], -1, 32).amax(-1) / largest
        bound += (0.5001 * step).repeat_interleave(32, 1) @ wd.t()
    return bound + 1e-30


def tiles_call(level: str, x: torch.Tensor, packed: cpu.PackedWeight, first: int, last: int) -> torch.Tensor:
    """`radixrt_quantized_matmul_tiles` of one level over tiles [first, last), float32 out (the
    other columns left at NaN)."""
    fn = library(level).radixrt_quantized_matmul_tiles
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.argtypes = [pointer, i64, i64, pointer, i32, i64, i64, pointer, pointer, pointer, i64, i64]
    fn.restype = None
    scratch_bytes = library(level).radixrt_quantized_matmul_scratch_bytes
    scratch_bytes.argtypes, scratch_bytes.restype = [i64, i64], i64
    rows, num_cols = x.shape
    scratch = torch.empty(scratch_bytes(rows, num_cols), dtype=torch.uint8)
    out = torch.full((rows, packed.num_rows), float("nan"))
    fn(x.data_ptr(), x.stride(0), rows, packed.data.data_ptr(), packed.bits, packed.num_rows, num_cols,
       out.data_ptr(), None, scratch.data_ptr(), first, last)
    return out


def test_each_build_reports_its_level():
    for level in RUNNABLE:
        assert build.level_of(library(level)) == level
    assert cpu.isa() == build.selected_level()


@settings(max_examples=25, deadline=None)
@given(
    rows=st.one_of(st.integers(1, 12), st.integers(13, 300)),
    tiles=st.integers(1, 6),
    groups=st.integers(1, 5),
    bits=st.sampled_from([4, 8]),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_quantized_matmul_of_every_level_is_the_portable_product(rows, tiles, groups, bits, seed, data):
    weight = weight_of(bits, 16 * tiles, 32 * groups, seed)
    x = (3 * torch.randn(rows, 32 * groups, generator=torch.Generator().manual_seed(seed))).bfloat16()
    reference = quantized("portable")
    expected = reference(x, pack(reference, weight, bits), out=torch.empty(rows, 16 * tiles))
    first = data.draw(st.integers(0, tiles - 1))
    last = data.draw(st.integers(first + 1, tiles))
    row = data.draw(st.integers(0, rows - 1))
    for level in RUNNABLE:
        kernel = quantized(level)
        packed = pack(kernel, weight, bits)
        out = kernel(x, packed, out=torch.empty(rows, 16 * tiles))
        error = (out.double() - expected.double()).abs()
        assert (error <= tolerance(x, weight, bits, level)).all(), level
        # bitwise: a row alone, a tile range, bf16 out the float32 result rounded once
        assert torch.equal(kernel(x[row : row + 1], packed, out=torch.empty(1, 16 * tiles)), out[row : row + 1])
        part = tiles_call(level, x, packed, first, last)[:, 16 * first : 16 * last]
        assert torch.equal(part, out[:, 16 * first : 16 * last]), level
        assert torch.equal(kernel(x, packed), out.bfloat16()), level


def rowwise(level: str) -> cpu.RowwiseMatmul:
    return cpu.RowwiseMatmul(library(level))


@settings(max_examples=25, deadline=None)
@given(
    rows=st.one_of(st.integers(1, 12), st.integers(13, 300)),
    num_out=st.integers(1, 40),
    num_cols=st.integers(1, 200),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_rowwise_matmul_of_every_level_is_the_portable_product(rows, num_out, num_cols, dtype, seed, data):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, num_cols, generator=generator).to(dtype)
    weight = torch.randn(num_out, num_cols, generator=generator).to(dtype)
    expected = rowwise("portable")(x, weight, float_out=True)
    bound = 4 * num_cols * 2.0**-24 * (x.double().abs() @ weight.double().abs().t()) + 1e-30
    row = data.draw(st.integers(0, rows - 1))
    for level in RUNNABLE:
        kernel = rowwise(level)
        out = kernel(x, weight, float_out=True)
        assert ((out.double() - expected.double()).abs() <= bound).all(), level
        assert torch.equal(kernel(x[row : row + 1], weight, float_out=True), out[row : row + 1]), level
        assert torch.equal(kernel(x[row:], weight, float_out=True), out[row:]), level


def test_cpu_flags_give_the_best_level_they_run():
    assert build.cpu_level(frozenset()) == "portable"
    assert build.cpu_level(frozenset({"avx", "avx2", "fma", "f16c", "bmi2"})) == "avx2"
    assert build.cpu_level(frozenset({"avx", "avx2", "fma", "bmi2"})) == "portable"  # no F16C
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
    assert build.cpu_level(frozenset({"avx", "avx2", "fma", "f16c", "bmi2", *avx512})) == "avx512"
    assert build.cpu_level(frozenset({"avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw"})) == "avx2"


def test_the_cap_lowers_the_level_and_never_raises_it():
    assert build.selected_level("portable", "avx512") == "portable"
    assert build.selected_level("avx2", "avx512") == "avx2"
    assert build.selected_level("avx512", "avx2") == "avx2"  # above the CPU: the best below
    assert build.selected_level("avx512", "portable") == "portable"
    with pytest.raises(ValueError, match="RADIXRT_CPU_ISA must be one of portable, avx2, avx512, got 'sse'"):
        build.selected_level("sse", "avx512")


def isa_in_subprocess(cap: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, build.ENVIRONMENT_VARIABLE: cap}
    return subprocess.run([sys.executable, "-c", "from radixrt.kernels import cpu; print(cpu.isa())"],
                          capture_output=True, text=True, env=environment, timeout=300)


@pytest.mark.parametrize("cap", ["portable", "avx2", "avx512", "AVX2", ""])
def test_the_environment_variable_caps_the_loaded_build(cap):
    result = isa_in_subprocess(cap)
    assert result.returncode == 0, result.stderr
    expected = build.cpu_level() if not cap else build.LEVELS[min(build.LEVELS.index(cap.lower()),
                                                                  build.LEVELS.index(build.cpu_level()))]
    assert result.stdout.strip() == expected


def test_an_unknown_cap_is_a_value_error_naming_the_variable():
    result = isa_in_subprocess("avx1024")
    assert result.returncode != 0
    assert "ValueError: RADIXRT_CPU_ISA must be one of portable, avx2, avx512, got 'avx1024'" in result.stderr
