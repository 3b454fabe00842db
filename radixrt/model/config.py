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
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# Keys each rope type reads (transformers' names), besides rope_type/type, rope_theta and
# partial_rotary_factor. Any other key is refused: a key we ignored could change the numerics.
_ROPE_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                       "mscale", "mscale_all_dim", "truncate"}),
    "longrope": frozenset({"short_factor", "long_factor", "original_max_position_embeddings", "attention_factor",
                           "factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
}  # fmt: skip
_COMMON_ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling, with transformers' field names and defaults.

    `original_max_position_embeddings` is the length the model was trained at:
    "llama3", "yarn" and "longrope" read it from the config (default
    `max_position_embeddings`); for "dynamic" it is `max_position_embeddings`,
    past which the NTK base grows. `low_freq_factor`/`high_freq_factor` are
    "llama3"'s; `attention_factor` (None: derived from `factor`) is "yarn"'s
    and "longrope"'s; `beta_*`, `mscale*` and `truncate` are "yarn"'s;
    `short_factor`/`long_factor` (head_dim // 2 each) are "longrope"'s.
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3).

    `attention_bias` is the bias of the q/k/v projections (Qwen2 always has it);
    `o_proj_bias` the output projection's (`attention_bias=True` in a Llama or
    Qwen3 config sets both). `qk_norm`: an RMSNorm over each q and k head
    before the rotary embedding (Qwen3). `sliding_window` is None for full
    attention; our attention is always full, so the model refuses sequences
    longer than the window, where the two would differ (see `context_len`).
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
    qk_norm: bool = False
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
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                if len(getattr(scaling, name)) != self.head_dim // 2:
                    raise ValueError(f"longrope {name} must have head_dim // 2 = {self.head_dim // 2} entries, "
                                     f"got {len(getattr(scaling, name))}")

    @property
    def num_query_groups(self) -> int:
        """Query heads per KV head (the GQA ratio)."""
        return self.num_heads // self.num_kv_heads

    @property
    def context_len(self) -> int:
        """Longest sequence this model serves exactly: the sliding window caps it, if any.

        With "dynamic" rope scaling `max_position_embeddings` is the trained
        length the NTK scaling extends by `factor` (as SGLang and vLLM read it).
        """
        length = self.max_position_embeddings
        if self.rope_scaling is not None and self.rope_scaling.rope_type == "dynamic":
            length = int(length * self.rope_scaling.factor)
        return length if self.sliding_window is None else min(length, self.sliding_window)

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
            qk_norm=architecture == "Qwen3ForCausalLM",
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
    model_types = ", ".join(SUPPORTED_ARCHITECTURES.values())
    raise ValueError(f"unsupported model_type {model_type!r}; supported: {model_types} (architectures {supported})")


def _rope(hf_config: Any) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError(f"per-layer rope parameters ({', '.join(params)}) are not supported: one rope for all layers")
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    unknown = sorted(set(params) - _COMMON_ROPE_KEYS - _ROPE_KEYS[rope_type])
    if unknown:
        accepted = ", ".join(sorted(_ROPE_KEYS[rope_type] | _COMMON_ROPE_KEYS))
        raise ValueError(f"unsupported {rope_type} rope parameters {unknown}; accepted: {accepted}")
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor must be 1.0, got {partial!r}")
    if rope_type == "default":
        return theta, None
    max_positions = int(hf_config.max_position_embeddings)
    if rope_type in ("linear", "dynamic"):
        if params.get("factor") is None:
            raise ValueError(f"{rope_type} rope scaling needs a 'factor'")
        if rope_type == "linear":
            return theta, RopeScaling("linear", float(params["factor"]))
        return theta, RopeScaling("dynamic", float(params["factor"]), original_max_position_embeddings=max_positions)
    # transformers 5 copies Phi-3's top-level original_max_position_embeddings into the
    # rope parameters (what its rope functions read); transformers 4 configs keep it outside.
    trained = int(
        params.get("original_max_position_embeddings")
        or getattr(hf_config, "original_max_position_embeddings", None)
        or max_positions
    )
    factor = params.get("factor")
    common: dict[str, Any] = dict(
        factor=max_positions / trained if factor is None else float(factor),
        original_max_position_embeddings=trained,
        attention_factor=_optional_float(params.get("attention_factor")),
    )
    if rope_type == "llama3":
        missing = [key for key in ("factor", "low_freq_factor", "high_freq_factor") if params.get(key) is None]
        if missing:
            raise ValueError(f"llama3 rope scaling is missing {', '.join(missing)}")
        return theta, RopeScaling(
            "llama3",
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            **common,
        )
    if rope_type == "yarn":
        return theta, RopeScaling(
            "yarn",
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            mscale=_optional_float(params.get("mscale")),
            mscale_all_dim=_optional_float(params.get("mscale_all_dim")),
            truncate=bool(params.get("truncate", True)),
            **common,
        )
    missing = [key for key in ("short_factor", "long_factor") if not params.get(key)]
    if missing:
        raise ValueError(f"longrope rope scaling is missing {', '.join(missing)}")
    return theta, RopeScaling(
        "longrope",
        short_factor=tuple(float(f) for f in params["short_factor"]),
        long_factor=tuple(float(f) for f in params["long_factor"]),
        **common,
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _sliding_window(hf_config: Any) -> int | None:
    """The attention window, if any layer uses one (Qwen2 only when `use_sliding_window`)."""
    if not getattr(hf_config, "use_sliding_window", True):
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    window = getattr(hf_config, "sliding_window", None)
    return int(window) if window else None
