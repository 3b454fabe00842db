"""The quantized matmul C kernel (kernels/cpu/quantized_matmul.c) against a float64 product of the file's weights.

4-bit codes: the exact product accumulated in float32. 8-bit codes (and, on AVX2, 4-bit ones too):
each row's inputs rounded to 16-bit integers per group of 32 first, so the exact product up to
what that can move it by (`rounding_bound`). The kernel is the build in use (`cpu.isa()`);
tests/test_cpu_isa.py compares every level this CPU runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.kernels import cpu
from radixrt.model import linear
from radixrt.model.gguf_int4 import Int8Weight
from tests.test_native_weights import random_int4, random_int8


@pytest.fixture(scope="module")
def kernel() -> cpu.QuantizedMatmul:
    built = cpu.quantized_matmul()
    if built is None:
        pytest.skip("no C compiler: torch's 4-bit kernel runs instead")
    return built


def pack(kernel: cpu.QuantizedMatmul, weight) -> cpu.PackedWeight:
    if isinstance(weight, Int8Weight):
        return kernel.pack_int8(weight.codes, weight.scales)
    return kernel.pack_int4(weight.codes, weight.scales, weight.offsets)


def exact_product(x: torch.Tensor, weight) -> torch.Tensor:
    return x.double() @ weight.dequantize().double().t()


def x16_max(isa: str, bits: int) -> int | None:
    """The largest 16-bit integer an input is rounded to in this level's kernel (None: the inputs
    are used as they are): AVX-512 8-bit 32639 (two signed bytes), AVX2 32767 (both widths)."""
    if isa == "avx2":
        return 32767
    return 32639 if isa == "avx512" and bits == 8 else None


def rounding_bound(x: torch.Tensor, dense: torch.Tensor, bits: int, isa: str | None = None) -> torch.Tensor:
    """How far the kernel's x @ dense.T may be from the exact one, elementwise: float32
    accumulation over the terms; and where inputs are rounded to s * x16, each moves by at most
    half its group's step s = max|x| / x16_max (a hair more: the kernel divides in float32), times |w|."""
    xd, wd = x.double(), dense.double().abs()
    bound = 1e-5 * (xd.abs() @ wd.t())
    largest = x16_max(cpu.isa() if isa is None else isa, bits)
    if largest is not None:
        step = xd.abs().reshape(xd.shape[0], -1, 32).amax(-1) / largest
        bound += (0.5001 * step).repeat_interleave(32, 1) @ wd.t()
    return bound


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 19),
    tiles=st.integers(1, 11),
    groups=st.integers(1, 6),
    bits=st.sampled_from([4, 8]),
    seed=st.integers(0, 2**16),
)
def test_kernel_is_the_exact_product_accumulated_in_float32(kernel, rows, tiles, groups, bits, seed):
    """Any number of rows (blocks of 1-8 and their remainders), of 16-row tiles (blocks of 1-8,
    remainders) and of 32-input groups, 4- and 8-bit codes."""
    weight = (random_int4 if bits == 4 else random_int8)(16 * tiles, 32 * groups, seed=seed)
    x = torch.randn(rows, 32 * groups, generator=torch.Generator().manual_seed(seed)).bfloat16()
    packed = pack(kernel, weight)
    out = torch.empty(rows, 16 * tiles)
    kernel(x, packed, out=out)
    error = (out.double() - exact_product(x, weight)).abs()
    assert (error <= rounding_bound(x, weight.dequantize(), bits)).all()
    # bf16 output: the float32 result rounded once
    assert torch.equal(kernel(x, packed), out.bfloat16())


def test_a_row_gets_the_same_bits_in_any_batch(kernel):
    """Every row runs the same instructions whatever the batch size and blocking: batch invariance."""
    for weight in (random_int4(16 * 7, 32 * 5, seed=3), random_int8(16 * 7, 32 * 5, seed=3)):
        packed = pack(kernel, weight)
        x = torch.randn(13, 32 * 5, generator=torch.Generator().manual_seed(4)).bfloat16()
        together = kernel(x, packed)
        for row in range(13):
            assert torch.equal(kernel(x[row : row + 1], packed), together[row : row + 1])
        assert torch.equal(kernel(x[2:9], packed), together[2:9])


def test_strided_rows_are_read_with_their_stride(kernel):
    weight = random_int4(48, 64, seed=8)
    packed = pack(kernel, weight)
    wide = torch.randn(4, 100, generator=torch.Generator().manual_seed(9)).bfloat16()
    x = wide[:, 10:74]
    assert x.stride(0) == 100
    assert torch.equal(kernel(x, packed), kernel(x.contiguous(), packed))


def test_scales_that_float16_cannot_hold_are_refused(kernel):
    weight = random_int4(16, 32, seed=10)
    with pytest.raises(ValueError, match="float16"):
        kernel.pack_int4(weight.codes, weight.scales + 1e-9, weight.offsets)
    with pytest.raises(ValueError, match="multiple of 16"):
        kernel.pack_int4(weight.codes[:8], weight.scales[:8], weight.offsets[:8])


def test_float32_activations_stay_on_torchs_kernel(kernel):
    """The kernel takes bf16 rows (its dot products are bf16's); float32 models keep torch's kernel."""
    assert kernel.supports((32, 64)) and not kernel.supports((24, 64)) and not kernel.supports((32, 48))
    weight = random_int4(32, 64, seed=11)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(12))
    out = linear.int4(weight, torch.float32)(x)
    torch.testing.assert_close(out, F.linear(x, weight.dequantize()), atol=1e-5, rtol=1e-5)


def test_int4_linears_use_the_kernel_and_keep_leading_dimensions(kernel):
    weight = random_int4(64, 96, seed=13)
    bias = torch.randn(64).bfloat16()
    x = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(14)).bfloat16()
    out = linear.int4(weight, torch.bfloat16, bias)(x)
    assert out.shape == (2, 3, 64)
    assert torch.equal(out, (kernel(x.reshape(6, 96), pack(kernel, weight)) + bias).view(2, 3, 64))
