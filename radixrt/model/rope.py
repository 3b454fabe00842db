"""Rotary position embeddings, computed from each token's absolute position.

Positions come from the batch (a cached prefix shifts them), so cos/sin are
computed per forward from `positions`, once for all layers; only the
frequency tables are cached. The arithmetic follows transformers' rotary
embedding and its `ROPE_INIT_FUNCTIONS` step by step (fp32 frequencies,
`cat(freqs, freqs)`, the attention scaling, cast to the activation dtype) so
fp32 results match it to the last bit or two.

"dynamic" and "longrope" change frequencies past a threshold length. transformers
picks them from the longest sequence of the batch, so a token's rotation there
depends on its batch-mates; here each token's rotation depends on its own
position only (see docs/model.md), which is what transformers does for a lone
sequence decoded one token at a time.

A Llama 3 GGUF carries its "llama3" scaling as llama.cpp's per-frequency divisors
(`rope_freqs.weight`, `ModelConfig.rope_freq_factors`): ggml's rope divides each
frequency by its factor before its own scaling (`freq_factors`: theta / ff, then
linear's or YaRN's interpolation), so here the base inverse frequencies are divided by
them before `scaling` applies. They are folded into `inv_freq`, so the cos/sin of
`cos_sin` and `tables` (the layer path's and the whole-step kernel's) carry them.
"""

from __future__ import annotations

import math

import torch

from radixrt.model.config import RopeScaling


def _exponents(head_dim: int) -> torch.Tensor:
    return torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim


def rope_parameters(head_dim: int, theta: float, scaling: RopeScaling | None,
                    freq_factors: tuple[float, ...] = ()) -> tuple[torch.Tensor, float]:
    """(fp32 [head_dim // 2] inverse frequencies, attention scaling of cos/sin) for short positions.

    "Short" means below `long_position_threshold`; for every rope type but
    "dynamic" and "longrope" that is every position. `freq_factors` (head_dim // 2
    values, or none) divide the base frequencies before `scaling` (None, "linear" or
    "yarn" with them, as llama.cpp combines them: `ModelConfig` checks them).
    """
    factors = torch.tensor(freq_factors, dtype=torch.float32) if freq_factors else None
    base = 1.0 / (theta ** _exponents(head_dim))
    if factors is not None:
        base = base / factors
    if scaling is None:
        return base, 1.0
    rope_type = scaling.rope_type
    if rope_type == "linear":
        return base / scaling.factor, 1.0
    if rope_type == "llama3":
        return _llama3_scaled(base, scaling), 1.0
    if rope_type == "dynamic":
        return _dynamic_ntk_within_training(head_dim, theta, scaling), 1.0
    if rope_type == "yarn":
        return _yarn(head_dim, theta, scaling, factors)
    assert rope_type == "longrope", rope_type
    return _longrope(head_dim, theta, scaling.short_factor), _longrope_attention_factor(scaling)


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


def _dynamic_ntk_within_training(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """NTK-aware frequencies for sequences within the trained length (the base formula at that length,
    computed rather than taken as `theta`, so its float rounding is transformers'; longer sequences
    take `RotaryEmbedding._dynamic_per_token`)."""
    trained = scaling.original_max_position_embeddings
    base = theta * ((scaling.factor * trained / trained) - (scaling.factor - 1)) ** (head_dim / (head_dim - 2))
    return 1.0 / (base ** _exponents(head_dim))


def _yarn(head_dim: int, theta: float, scaling: RopeScaling,
          freq_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, ramp between; scale attention by mscale.
    With `freq_factors`, both the kept and the interpolated frequencies are the divided ones
    (ggml's rope_yarn receives theta / ff); the ramp does not depend on them."""
    factor = scaling.factor

    def mscale(scale: float, coefficient: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * coefficient * math.log(scale) + 1.0

    attention_factor = scaling.attention_factor
    if attention_factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention_factor = float(mscale(factor, scaling.mscale) / mscale(factor, scaling.mscale_all_dim))
        else:
            attention_factor = mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        trained = scaling.original_max_position_embeddings
        return (head_dim * math.log(trained / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid dividing by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = theta ** _exponents(head_dim)
    if freq_factors is None:
        interpolation, extrapolation = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    else:
        extrapolation = 1.0 / pos_freqs / freq_factors
        interpolation = extrapolation / factor
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, attention_factor


def _longrope(head_dim: int, theta: float, factors: tuple[float, ...]) -> torch.Tensor:
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** _exponents(head_dim))


def _longrope_attention_factor(scaling: RopeScaling) -> float:
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(scaling.factor) / math.log(scaling.original_max_position_embeddings))


# The first `tables` cover this many positions (~0.5 MB for head_dim 64 in bf16).
_MIN_TABLE_POSITIONS = 2048


class RotaryEmbedding:
    """cos/sin tables for a batch's positions, and their application to q and k.

    `rotate_half(x) * sin` is computed as `flip_halves(x) * signed_sin` with
    `signed_sin = cat(-sin, sin)`: the same products (negation is exact), two
    fewer ops per layer than transformers' `cat(-x2, x1)`.

    With "dynamic" or "longrope", a token at position p >= `long_position_threshold`
    uses the frequencies transformers computes for a sequence of p + 1 tokens.
    `freq_factors`: llama.cpp's per-frequency divisors (`rope_parameters`).
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device,
                 freq_factors: tuple[float, ...] = ()):
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        inv_freq, self.attention_scaling = rope_parameters(head_dim, theta, scaling, freq_factors)
        self.inv_freq = inv_freq.to(device)
        self.long_position_threshold: int | None = None
        self.long_inv_freq: torch.Tensor | None = None
        if scaling is not None and scaling.rope_type in ("dynamic", "longrope"):
            self.long_position_threshold = scaling.original_max_position_embeddings
        if scaling is not None and scaling.rope_type == "longrope":
            self.long_inv_freq = _longrope(head_dim, theta, scaling.long_factor).to(device)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # see `tables`

    def _frequencies(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] -> fp32 angles [T, head_dim // 2]."""
        short = positions[:, None].float() * self.inv_freq
        threshold = self.long_position_threshold
        if threshold is None:
            return short
        long_inv_freq = self.long_inv_freq if self.long_inv_freq is not None else self._dynamic_per_token(positions)
        return torch.where(positions[:, None] >= threshold, positions[:, None].float() * long_inv_freq, short)

    def _dynamic_per_token(self, positions: torch.Tensor) -> torch.Tensor:
        """[T, head_dim // 2]: each token's NTK frequencies for a sequence ending at it."""
        assert self.scaling is not None
        trained = self.scaling.original_max_position_embeddings
        factor, dim = self.scaling.factor, self.head_dim
        seq_len = (positions.double() + 1).clamp(min=trained)
        base = self.theta * ((factor * seq_len / trained) - (factor - 1)) ** (dim / (dim - 2))
        # transformers computes base in Python floats, then the powers in fp32
        return 1.0 / (base.float()[:, None] ** _exponents(dim).to(positions.device))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin), each [num_tokens, 1, head_dim] in `dtype`.

        The angles are padded to a multiple of 64 values: torch's vectorized cos and sin
        leave a remainder shorter than its vectors to a scalar loop that may round
        differently, and which values fall there would otherwise depend on the number
        of tokens in the step (deterministic mode needs a position's table the same in
        any batch).
        """
        num_tokens = positions.shape[0]
        pad = -num_tokens % (64 // math.gcd(64, self.head_dim))
        if pad:
            positions = torch.cat((positions, positions.new_zeros(pad)))
        freqs = self._frequencies(positions)
        emb = torch.cat((freqs, freqs), dim=-1)
        half = self.head_dim // 2
        cos, sin = emb.cos()[:num_tokens], emb.sin()[:num_tokens]
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        sin[:, :half].neg_()
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def tables(self, num_positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin) [P, head_dim], row p what `cos_sin` gives position p, P >= num_positions.

        For kernels that look each token's row up instead of computing it (~10 torch ops a
        step): `cos_sin`'s values depend on the position alone, so the rows are computed once,
        the tables doubling as longer positions come.
        """
        cached = self._tables.get(dtype)
        if cached is None or cached[0].shape[0] < num_positions:
            size = max(_MIN_TABLE_POSITIONS, 1 << (num_positions - 1).bit_length())
            cos, signed_sin = self.cos_sin(torch.arange(size, device=self.inv_freq.device), dtype)
            cached = self._tables[dtype] = (cos[:, 0], signed_sin[:, 0])
        return cached

    def apply(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """Rotate x: [num_tokens, num_heads, head_dim] (any heads: q and k stacked work too).

        With a partial rotary factor (this embedding's `head_dim` is the rotated part) only
        the leading dims of each head rotate; the rest pass through.
        """
        if x.shape[-1] > self.head_dim:
            rotated = self.apply(x[..., : self.head_dim], cos, signed_sin)
            return torch.cat((rotated, x[..., self.head_dim :]), dim=-1)
        flipped = x.unflatten(-1, (2, self.head_dim // 2)).flip(-2).flatten(-2)
        return x * cos + flipped * signed_sin
