"""Linear projections: plain, prepacked for oneDNN (CPU, bf16), 4-bit (CPU, GGUF weights), or
batch-invariant (CPU, deterministic mode).

CPU decode reads every weight once per step. Handing oneDNN a weight
already reordered into its blocked layout, once at load time, makes the bf16
matmul faster at decode-sized batches (docs/model.md has the timing) and
gives bit-identical results, which `pack` checks before using it.
fp32 is left on `F.linear` (MKL): the packed fp32 path rounds differently,
and fp32 is the dtype our exactness tests compare against transformers.

`int4` and `lm_head` multiply by a GGUF file's own 4-bit (8-bit: the head)
weights (see `gguf_int4`), reading a quarter (half) of bf16's bytes. For
bf16 on the CPU that is radixrt's kernel (at every instruction-set level), exact
in the file's weights; elsewhere torch's CPU weight-only kernel, which takes its per-block
scales in the activations' dtype: exact in float32, but there it runs a
slow generic path, so bf16 models use it in bf16, which rounds each block's
scale and offset to 8 significant bits (the 4-bit codes stay the file's).
"""

from __future__ import annotations

import threading
from typing import Callable

import torch
import torch.nn.functional as F

from radixrt.kernels import cpu
from radixrt.model.gguf_int4 import GROUP_SIZE, Int4Weight, Int8Weight

Linear = Callable[[torch.Tensor], torch.Tensor]


def plain(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """`F.linear` over the live parameters (they may be loaded into later)."""
    return lambda x: F.linear(x, weight, bias)


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """A prepacked oneDNN linear when the platform supports it exactly, else `plain`."""
    if not _can_pack(weight):
        return plain(weight, bias)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)
        fn = _packed_linear(packed, None if bias is None else bias.detach())
        probe = torch.randn(17, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        if not torch.equal(fn(probe), F.linear(probe, weight, bias)):
            return plain(weight, bias)
    except (RuntimeError, AttributeError):
        return plain(weight, bias)
    return fn


def rowwise(weight: torch.Tensor, bias: torch.Tensor | None = None, float_out: bool = False) -> Linear:
    """`x @ w.T (+ bias)` through radixrt's batch-invariant kernel (`kernels/cpu/rowwise_matmul.c`):
    a row's result is the same whatever other rows share the call, which no library GEMM here
    promises. Over the live parameters; float32 results with `float_out` (an LM head)."""
    kernel = cpu.rowwise_matmul() if weight.device.type == "cpu" else None
    if kernel is None or not kernel.supports(weight.dtype):
        raise ValueError(f"no batch-invariant matmul for {weight.dtype} on {weight.device}: it needs the CPU, "
                         "a C compiler, and bfloat16 or float32 weights")
    kernel.check_weight(weight, bias)  # once: a step calls this ~4 times a layer

    def linear(x: torch.Tensor) -> torch.Tensor:
        out = kernel.multiply(_rows(x, weight.shape[1]), weight, bias, float_out)
        return out.view(*x.shape[:-1], out.shape[-1])

    return linear


def on_first_call(make: Callable[[], Linear]) -> Linear:
    """The linear `make()` builds, built when it is first called.

    For a copy of the weights that only some steps need: oneDNN's packed
    copies serve only default-mode steps (deterministic ones read the weights
    as loaded), and with native weights the dense bf16 projections serve only
    steps the 4-bit kernels leave to them, which deterministic mode never
    does; a start does not build them up front.
    """
    built: list[Linear] = []

    def linear(x: torch.Tensor) -> torch.Tensor:
        if not built:
            built.append(make())
        return built[0](x)

    return linear


def int4(weight: Int4Weight, dtype: torch.dtype, bias: torch.Tensor | None = None) -> Linear:
    """`x @ w.T (+ bias)` for `dtype` activations, with `w` held as 4-bit codes (CPU only)."""
    kernel = _own_kernel(weight, dtype)
    if kernel is None:
        return _torch_int4(weight, dtype, bias)
    return packed(kernel.pack_int4(weight.codes, weight.scales, weight.offsets), bias)


# Rows from which `packed` multiplies densely: more than the whole-step kernel takes a step
# (llama.STACK_MAX_ROWS), i.e. prefill chunks. The quantized kernel's cost grows with every row
# (it is compute-bound there), while dequantizing the weight once costs the same for any rows
# and leaves a bf16 GEMM (docs/benchmarks.md, "Real models: loading a GGUF natively").
DENSE_MIN_ROWS = 65


def packed(weight: cpu.PackedWeight, bias: torch.Tensor | None = None) -> PackedLinear:
    """`x @ w.T (+ bias)` for bf16 rows over a weight already in radixrt's packed layouts
    (`Int4LayerSteps`' own, so a layer holds its projections once): through the quantized kernel,
    or from DENSE_MIN_ROWS rows by a bf16 GEMM over the weight dequantized into a scratch buffer
    the calls of this thread share (the weights' values rounded once to bf16). Steps whose rows
    must not depend on the batch take `PackedLinear.invariant()`, always the quantized kernel."""
    kernel = cpu.quantized_matmul()
    if kernel is None:
        raise ValueError("radixrt's quantized matmul is not available: it needs a C compiler")
    return PackedLinear(kernel, weight, bias, dense=True)


class PackedLinear:
    """`packed`'s linear (see there); `dense` False: the quantized kernel at every row count."""

    def __init__(self, kernel: cpu.QuantizedMatmul, weight: cpu.PackedWeight, bias: torch.Tensor | None, dense: bool):
        self.kernel, self.weight, self.bias, self.dense = kernel, weight, bias, dense

    def invariant(self) -> PackedLinear:
        """This product through the quantized kernel only: a row's result the same in any batch."""
        return PackedLinear(self.kernel, self.weight, self.bias, dense=False)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        rows = _rows(x, x.shape[-1])
        if self.dense and rows.shape[0] >= DENSE_MIN_ROWS and rows.dtype == torch.bfloat16:
            scratch = _dense_scratch(weight.num_rows * weight.columns())
            out = F.linear(rows, self.kernel.dequantize(weight, scratch), bias)
        else:
            out = self.kernel(rows, weight)
            if bias is not None:
                out = out + bias
        return out.view(*x.shape[:-1], weight.num_rows)


_scratch = threading.local()  # .buffer: the bf16 weight `packed` dequantizes into, grown as needed


def _dense_scratch(size: int) -> torch.Tensor:
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < size:
        _scratch.buffer = buffer = torch.empty(size, dtype=torch.bfloat16)
    return buffer


def lm_head(weight: Int4Weight | Int8Weight | cpu.PackedWeight, dtype: torch.dtype) -> Linear:
    """float32 logits `x @ w.T` for a GGUF file's own 4- or 8-bit LM head (CPU only); one already
    in radixrt's layout (`QuantizedMatmul.pack_gguf_q8`) is used as it is.

    radixrt's kernel multiplies by an 8-bit head as it is (a `PackedLMHead`); torch's 4-bit
    kernel takes it as two 4-bit weights (`Int8Weight.as_int4_pair`), each
    product rounded to `dtype` and the two added in float32.
    """
    if isinstance(weight, cpu.PackedWeight):
        matmul = cpu.quantized_matmul()
        if matmul is None or dtype != torch.bfloat16:
            raise ValueError("a head in radixrt's packed layout needs its kernel: bf16 activations and a C compiler")
        return PackedLMHead(matmul, weight)
    kernel = _own_kernel(weight, dtype)
    if kernel is None:
        parts = weight.as_int4_pair() if isinstance(weight, Int8Weight) else [weight]
        return _summed_in_float32([_torch_int4(part, dtype) for part in parts])
    if isinstance(weight, Int8Weight):
        return PackedLMHead(kernel, kernel.pack_int8(weight.codes, weight.scales))
    return PackedLMHead(kernel, kernel.pack_int4(weight.codes, weight.scales, weight.offsets))


class PackedLMHead:
    """A quantized LM head in radixrt's kernel layout, float32 logits: a `Linear` whose packed
    weight the whole-step kernel (`kernels/cpu/decode_stack.c`) reads too."""

    def __init__(self, kernel: cpu.QuantizedMatmul, packed: cpu.PackedWeight):
        self.kernel = kernel
        self.packed = packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        num_rows = self.packed.num_rows
        rows = _rows(x, x.shape[-1])
        out = self.kernel(rows, self.packed, out=torch.empty(rows.shape[0], num_rows, dtype=torch.float32))
        return out.view(*x.shape[:-1], num_rows)


def runs_own_kernel(shape: tuple[int, int], dtype: torch.dtype) -> bool:
    """Whether `int4`/`lm_head` of a weight of this shape run radixrt's kernel (its packed layout)."""
    kernel = cpu.quantized_matmul() if dtype == torch.bfloat16 else None
    return kernel is not None and kernel.supports(shape)


def runs_format(format: int, shape: tuple[int, int], dtype: torch.dtype) -> bool:
    """Whether a [N, K] weight stored in `format` (a GGUF type number) runs radixrt's kernels packed:
    bf16 activations, the kernels built, a format with a packed layout, whole tiles of rows."""
    kernel = cpu.quantized_matmul() if dtype == torch.bfloat16 else None
    return kernel is not None and kernel.format_runs(format, shape)


def _own_kernel(weight: Int4Weight | Int8Weight, dtype: torch.dtype) -> cpu.QuantizedMatmul | None:
    """radixrt's quantized kernel (`kernels/cpu/quantized_matmul.c`) where it runs: bf16
    activations, a C compiler (any x86 level: `cpu.isa()`), a weight shape its layout takes. It multiplies by the file's
    exact weights (torch's kernel rounds the scales to bf16) and is several times faster on a few rows."""
    kernel = cpu.quantized_matmul() if dtype == torch.bfloat16 else None
    return kernel if kernel is not None and kernel.supports(weight.shape) else None


def _rows(x: torch.Tensor, num_cols: int) -> torch.Tensor:
    rows = x.reshape(-1, num_cols)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _torch_int4(weight: Int4Weight, dtype: torch.dtype, bias: torch.Tensor | None = None) -> Linear:
    """torch's CPU weight-only kernel: any dtype and CPU, one row at a time."""
    num_rows, num_cols = weight.shape
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32), _INNER_K_TILES)
    # The kernel dequantizes (q - 8) * scale + zero: our offset is the weight at q = 0.
    zeros = weight.offsets + 8 * weight.scales
    scales_and_zeros = torch.stack([weight.scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()

    def linear(x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, num_cols), packed, GROUP_SIZE, scales_and_zeros)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], num_rows)

    return linear


def _summed_in_float32(parts: list[Linear]) -> Linear:
    """Each product rounded to the activations' dtype once, the parts added in float32."""

    def linear(x: torch.Tensor) -> torch.Tensor:
        out = parts[0](x).float()
        for part in parts[1:]:
            out += part(x)
        return out

    return linear


# The packing parameter torch's CPU int4 kernel takes; it accepts 2 for every K that is a multiple of 32.
_INNER_K_TILES = 2


def _can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _packed_linear(packed: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    def linear(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])

    return linear
