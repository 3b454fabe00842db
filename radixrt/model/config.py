"""What our forward pass needs to know about a checkpoint, read from a transformers config.

transformers has changed how it spells some fields (4.x: `rope_theta` plus a
`rope_scaling` dict; 5.x: one `rope_parameters` dict), so `ModelConfig.from_hf`
reads both and everything downstream sees one frozen, validated shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radixrt.memory.kv_cache import KVShape

# Architecture name (as in config.json "architectures") -> transformers model_type.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling ("linear" or Llama 3.1's "llama3").

    `low_freq_factor`, `high_freq_factor` and `original_max_position_embeddings`
    are only used (and only required) by "llama3".
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2).

    `attention_bias` is the bias of the q/k/v projections (Qwen2 always has it);
    `o_proj_bias` the output projection's (only Llama's `attention_bias=True`
    sets both). `sliding_window` is None for full attention; our attention is
    always full, so the model refuses sequences longer than the window, where
    the two would differ (see `context_len`).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    attention_bias: bool
    o_proj_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def num_query_groups(self) -> int:
        """Query heads per KV head (the GQA ratio)."""
        return self.num_heads // self.num_kv_heads

    @property
    def context_len(self) -> int:
        """Longest sequence this model serves exactly: the sliding window caps it, if any."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    def kv_shape(self, dtype: torch.dtype) -> KVShape:
        """The per-token KV footprint, to size a `KVCache` for this model."""
        return KVShape(self.num_layers, self.num_kv_heads, self.head_dim, dtype)

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Read a transformers config (4.x or 5.x spelling); ValueError on what we cannot run."""
        architecture = _architecture(hf_config)
        hidden_act = getattr(hf_config, "hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu' (SwiGLU MLP), got {hidden_act!r}")
        if getattr(hf_config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported (no Llama-family checkpoint we serve uses it)")
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        if architecture == "Qwen2ForCausalLM":
            attention_bias, o_proj_bias = True, False
        else:
            attention_bias = o_proj_bias = bool(getattr(hf_config, "attention_bias", False))
        rope_theta, rope_scaling = _rope(hf_config)
        eos = getattr(hf_config, "eos_token_id", None)
        eos_token_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
        bos = getattr(hf_config, "bos_token_id", None)
        return cls(
            architecture=architecture,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            max_position_embeddings=int(hf_config.max_position_embeddings),
            sliding_window=_sliding_window(hf_config),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_token_ids,
        )


def _architecture(hf_config: Any) -> str:
    """The architecture name; GGUF-derived configs carry only `model_type`, so map it back."""
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    names = getattr(hf_config, "architectures", None) or []
    if names:
        if names[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {names[0]!r}; supported: {supported}")
        return names[0]
    model_type = getattr(hf_config, "model_type", None)
    for name, supported_type in SUPPORTED_ARCHITECTURES.items():
        if model_type == supported_type:
            return name
    raise ValueError(f"unsupported model_type {model_type!r}; supported architectures: {supported}")


def _rope(hf_config: Any) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor must be 1.0, got {partial!r}")
    if rope_type == "default":
        return theta, None
    if "factor" not in params:
        raise ValueError(f"rope scaling {rope_type!r} needs a 'factor'")
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    missing = [key for key in _LLAMA3_ROPE_KEYS if key not in params]
    if missing == ["original_max_position_embeddings"]:
        params["original_max_position_embeddings"] = hf_config.max_position_embeddings
    elif missing:
        raise ValueError(f"llama3 rope scaling is missing {', '.join(missing)}")
    return theta, RopeScaling(
        "llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _sliding_window(hf_config: Any) -> int | None:
    """The attention window, if any layer uses one (Qwen2 only when `use_sliding_window`)."""
    if not getattr(hf_config, "use_sliding_window", True):
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    window = getattr(hf_config, "sliding_window", None)
    return int(window) if window else None
