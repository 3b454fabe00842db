"""The arithmetic where Gemma 2 and Gemma 3 differ from a Llama-family decoder.

`LlamaForCausalLM` runs Gemma checkpoints too (`ModelConfig.is_gemma`): the
layer shape is the same fused q/k/v and gate/up, with norms after attention
and around the MLP. What differs numerically lives here, computed as
transformers computes it, so fp32 results match it and bf16 results round
where it rounds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(
    hidden: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """Gemma's RMSNorm: normalize in float32, multiply by (1 + weight) in float32, then round
    once to the activation dtype (Llama rounds before multiplying by the weight). With
    `residual`, `hidden += residual` first, in place, like the Llama norms."""
    if residual is not None:
        hidden.add_(residual)
    x = hidden.float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(hidden.dtype)


def embedding_scale(hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    """sqrt(hidden_size) rounded to the model dtype, the factor Gemma's embeddings are scaled by."""
    return torch.tensor(hidden_size**0.5, dtype=torch.float32).to(dtype)


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap): squashes logits smoothly into (-cap, cap)."""
    return torch.tanh(logits / cap) * cap


def gelu_tanh(gate: torch.Tensor) -> torch.Tensor:
    """GeGLU's activation: GELU with the tanh approximation ("gelu_pytorch_tanh")."""
    return F.gelu(gate, approximate="tanh")
