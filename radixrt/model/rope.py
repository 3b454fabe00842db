"""Rotary position embeddings, computed from each token's absolute position.

Positions come from the batch (a cached prefix shifts them), so cos/sin are
computed per forward from `positions`, once for all layers; only `inv_freq`
is cached. The arithmetic follows transformers' Llama rotary embedding step
by step (fp32 frequencies, `cat(freqs, freqs)`, cast to the activation dtype)
so fp32 results match it to the last bit or two.
"""

from __future__ import annotations

import math

import torch

from radixrt.model.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """fp32 [head_dim // 2] inverse frequencies, with "linear" or "llama3" scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    assert scaling.rope_type == "llama3", scaling.rope_type
    return _llama3_scaled(inv_freq, scaling)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend the band between."""
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables for a batch's positions, and their application to q and k.

    `rotate_half(x) * sin` is computed as `flip_halves(x) * signed_sin` with
    `signed_sin = cat(-sin, sin)`: the same products (negation is exact), two
    fewer ops per layer than transformers' `cat(-x2, x1)`.
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device):
        self.head_dim = head_dim
        self.inv_freq = inverse_frequencies(head_dim, theta, scaling).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin), each [num_tokens, 1, head_dim] in `dtype`."""
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        half = self.head_dim // 2
        sin = emb.sin()
        sin[:, :half].neg_()
        return emb.cos().to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """Rotate x: [num_tokens, num_heads, head_dim] (any heads: q and k stacked work too)."""
        flipped = x.unflatten(-1, (2, self.head_dim // 2)).flip(-2).flatten(-2)
        return x * cos + flipped * signed_sin
