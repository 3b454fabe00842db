"""Decode-sized steps of a Llama layer on native 4-bit weights, in two C calls around attention.

A batch-1 decode step of the bundled model is ~30 small torch ops a layer;
their dispatch and allocations cost more than the arithmetic. With radixrt's
4-bit kernel available, a plain Llama layer (no biases, no q/k norms, SwiGLU,
full rotary) runs its norms, projections, RoPE, SwiGLU and residual adds in
`kernels/cpu/int4_layer.c`, rounding to bf16 where the torch layer does; only
attention stays with the backend, so every backend and attention variant
still applies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixrt.kernels import cpu
from radixrt.model.gguf_int4 import Int4Weight


@dataclass(frozen=True)
class Int4LayerSteps:
    """One layer's packed 4-bit weights and norms, and the two calls that use them."""

    kernels: cpu.Int4Layer
    qkv: cpu.PackedWeight
    o: cpu.PackedWeight
    gate_up: cpu.PackedWeight
    down: cpu.PackedWeight
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    eps: float
    heads: tuple[int, int, int]  # q heads, kv heads, head_dim

    @staticmethod
    def create(
        weights: dict[str, Int4Weight], input_norm: torch.Tensor, post_attention_norm: torch.Tensor, eps: float,
        num_heads: int, num_kv_heads: int, head_dim: int,
    ) -> Int4LayerSteps | None:
        """The steps for this layer, or None where the kernels do not run (no compiler or
        AVX512-BF16, non-bf16 norms, shapes outside the kernel's tiles)."""
        kernels, matmul = cpu.int4_layer(), cpu.quantized_matmul()
        if kernels is None or matmul is None or input_norm.dtype != torch.bfloat16:
            return None
        if not all(matmul.supports(weight.shape) for weight in weights.values()):
            return None
        packed = {name: matmul.pack_int4(w.codes, w.scales, w.offsets) for name, w in weights.items()}
        return Int4LayerSteps(
            kernels, packed["qkv"], packed["o"], packed["gate_up"], packed["down"], input_norm, post_attention_norm,
            eps, (num_heads, num_kv_heads, head_dim),
        )  # fmt: skip

    def attention_inputs(self, hidden: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """[T, q + k + v heads, head_dim]: q and k rotated, as the torch layer computes them."""
        num_heads, num_kv_heads, head_dim = self.heads
        qkv = self.kernels.attention_inputs(
            hidden, self.input_norm, self.eps, self.qkv, cos, signed_sin, num_heads + num_kv_heads, head_dim
        )
        return qkv.view(hidden.shape[0], -1, head_dim)

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """`hidden` with the attention output's projection and the MLP added, in place."""
        return self.kernels.finish(hidden, attn, self.o, self.post_attention_norm, self.eps, self.gate_up, self.down)
