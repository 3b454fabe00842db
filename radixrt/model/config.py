"""What our forward pass needs to know about a checkpoint, read from a transformers config.

transformers has changed how it spells some fields (4.x: `rope_theta` plus a
`rope_scaling` dict; 5.x: one `rope_parameters` dict), so `ModelConfig.from_hf`
reads both and everything downstream sees one frozen, validated shape.
"""

from __future__ import annotations

import math
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
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
}
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# The MLP activation each family's checkpoints are trained with (config field `hidden_act`,
# Gemma's `hidden_activation`): SwiGLU, or Gemma's GeGLU with tanh-approximated GELU.
_ACTIVATIONS = {"gemma": "gelu_pytorch_tanh", "other": "silu"}
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
    """Shape and numerics of a decoder we run (Llama 2/3, SmolLM, Mistral, Qwen2/3, Gemma 2/3, Phi-3).

    `attention_bias` is the bias of the q/k/v projections (Qwen2 always has it);
    `o_proj_bias` the output projection's (`attention_bias=True` in a Llama or
    Qwen3 config sets both). `qk_norm`: an RMSNorm over each q and k head
    before the rotary embedding (Qwen3, Gemma 3). `sliding_window` is None for
    full attention; else the layers in `sliding_layers` (None: all) attend
    only their last `sliding_window` keys (`layer_window`).

    Gemma (`is_gemma`): embeddings scaled by sqrt(hidden_size), RMSNorm by
    (1 + weight), norms after attention and around the MLP, GeGLU, softmax
    scale `query_pre_attn_scalar ** -0.5`, optional tanh soft-capping of
    attention scores and of the final logits; `local_rope_theta` is the rope
    base of Gemma 3's sliding layers (no scaling there). `partial_rotary_factor`:
    the share of each head's dims that rotate (Phi-4-mini: 0.75).
    `rope_freq_factors` (rotary_dim // 2 values, or none): llama.cpp's per-frequency
    divisors (a Llama 3 GGUF's `rope_freqs.weight`), applied before `rope_scaling`.
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
    sliding_layers: tuple[int, ...] | None = None
    hidden_act: str = "silu"
    partial_rotary_factor: float = 1.0
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    local_rope_theta: float | None = None
    rope_freq_factors: tuple[float, ...] = ()

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
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor must be in (0, 1] and leave an even number of rotated dims, "
                             f"got {self.partial_rotary_factor} of head_dim {self.head_dim}")
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                if len(getattr(scaling, name)) != self.rotary_dim // 2:
                    raise ValueError(f"longrope {name} must have rotary_dim // 2 = {self.rotary_dim // 2} entries, "
                                     f"got {len(getattr(scaling, name))}")
        if self.rope_freq_factors:
            _check_freq_factors(self.rope_freq_factors, self.rotary_dim, scaling)
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.sliding_layers is not None and not all(0 <= i < self.num_layers for i in self.sliding_layers):
            raise ValueError(f"sliding_layers {self.sliding_layers} must be layer indices < {self.num_layers}")

    @property
    def is_gemma(self) -> bool:
        return self.architecture in GEMMA_ARCHITECTURES

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head the rotary embedding rotates (transformers' int())."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_sliding_layer(self, layer: int) -> bool:
        """Whether the config names `layer` a sliding-attention layer (it uses Gemma 3's local rope)."""
        return self.sliding_layers is None or layer in self.sliding_layers

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`, None if it attends every earlier key."""
        return self.sliding_window if self.is_sliding_layer(layer) else None

    @property
    def num_query_groups(self) -> int:
        """Query heads per KV head (the GQA ratio)."""
        return self.num_heads // self.num_kv_heads

    @property
    def context_len(self) -> int:
        """Longest sequence this model serves: `max_position_embeddings`.

        With "dynamic" rope scaling `max_position_embeddings` is the trained
        length the NTK scaling extends by `factor` (as SGLang and vLLM read it).
        """
        length = self.max_position_embeddings
        if self.rope_scaling is not None and self.rope_scaling.rope_type == "dynamic":
            length = int(length * self.rope_scaling.factor)
        return length

    def kv_shape(self, dtype: torch.dtype) -> KVShape:
        """The per-token KV footprint, to size a `KVCache` for this model."""
        return KVShape(self.num_layers, self.num_kv_heads, self.head_dim, dtype)

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Read a transformers config (4.x or 5.x spelling); ValueError on what we cannot run."""
        architecture = _architecture(hf_config)
        is_gemma = architecture in GEMMA_ARCHITECTURES
        hidden_act = _activation(hf_config, is_gemma)
        if getattr(hf_config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported (no checkpoint of the supported families uses it)")
        quantization = getattr(hf_config, "quantization_config", None)
        if quantization:
            method = (quantization.get("quant_method") if isinstance(quantization, dict)
                      else getattr(quantization, "quant_method", quantization))  # fmt: skip
            raise ValueError(f"quantized checkpoints (quantization_config {method!r}) are not supported; supported: "
                             "unquantized float32/bfloat16/float16 weights, or a .gguf file")
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True (an embedding model) is not supported: causal only")
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        if architecture == "Qwen2ForCausalLM":
            attention_bias, o_proj_bias = True, False
        else:
            attention_bias = o_proj_bias = bool(getattr(hf_config, "attention_bias", False))
        (rope_theta, rope_scaling, partial_rotary_factor), local_rope_theta = _rope(hf_config, architecture)
        sliding_window, sliding_layers = _sliding_window(hf_config)
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
            sliding_window=sliding_window,
            qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_token_ids,
            sliding_layers=sliding_layers,
            hidden_act=hidden_act,
            partial_rotary_factor=partial_rotary_factor,
            query_pre_attn_scalar=_optional_float(getattr(hf_config, "query_pre_attn_scalar", None)),
            attn_logit_softcapping=_optional_float(getattr(hf_config, "attn_logit_softcapping", None)),
            final_logit_softcapping=_optional_float(getattr(hf_config, "final_logit_softcapping", None)),
            local_rope_theta=local_rope_theta,
            rope_freq_factors=tuple(float(f) for f in getattr(hf_config, "rope_freq_factors", None) or ()),
        )


def _activation(hf_config: Any, is_gemma: bool) -> str:
    """The MLP activation; each family runs only the one its checkpoints use."""
    expected = _ACTIVATIONS["gemma" if is_gemma else "other"]
    name = getattr(hf_config, "hidden_activation", None) if is_gemma else None
    name = name or getattr(hf_config, "hidden_act", None) or expected
    if name != expected:
        field = "hidden_activation" if is_gemma else "hidden_act"
        raise ValueError(f"{field} must be {expected!r} for this architecture, got {name!r}")
    return name


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


def _rope(hf_config: Any, architecture: str) -> tuple[tuple[float, RopeScaling | None, float], float | None]:
    """((theta, scaling, partial rotary factor), theta of the sliding layers or None: the same).

    Read from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4). Gemma 3
    has one set per layer type: the full layers' (any rope type) and the sliding layers'
    (a plain rope with its own base, `rope_local_base_freq` in transformers 4).
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    if not any(isinstance(value, dict) for value in params.values()):
        local_theta = getattr(hf_config, "rope_local_base_freq", None) if architecture == "Gemma3ForCausalLM" else None
        return _rope_of(hf_config, params), _optional_float(local_theta)
    layer_types = {"full_attention", "sliding_attention"}
    if architecture != "Gemma3ForCausalLM" or set(params) != layer_types:
        raise ValueError(f"per-layer rope parameters ({', '.join(params)}) are supported only for Gemma 3's "
                         f"{sorted(layer_types)}; other models have one rope for all layers")
    local = _rope_of(hf_config, dict(params["sliding_attention"]))
    if local[1:] != (None, 1.0):
        raise ValueError("Gemma 3's sliding_attention rope must be a plain ('default') rope")
    return _rope_of(hf_config, dict(params["full_attention"])), local[0]


def _rope_of(hf_config: Any, params: dict[str, Any]) -> tuple[float, RopeScaling | None, float]:
    """(theta, scaling, partial rotary factor) from one set of rope parameters."""
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    unknown = sorted(set(params) - _COMMON_ROPE_KEYS - _ROPE_KEYS[rope_type])
    if unknown:
        accepted = ", ".join(sorted(_ROPE_KEYS[rope_type] | _COMMON_ROPE_KEYS))
        raise ValueError(f"unsupported {rope_type} rope parameters {unknown}; accepted: {accepted}")
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    partial = 1.0 if partial is None else float(partial)
    return (*_scaling(hf_config, params, theta, rope_type), partial)


def _scaling(hf_config: Any, params: dict[str, Any], theta: float, rope_type: str) -> tuple[float, RopeScaling | None]:
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


def _check_freq_factors(factors: tuple[float, ...], rotary_dim: int, scaling: RopeScaling | None) -> None:
    """llama.cpp divides each rotary frequency by its factor, then applies its own scaling types
    (linear, yarn) on top; no file pairs the factors with another type."""
    if len(factors) != rotary_dim // 2:
        raise ValueError(f"rope_freq_factors must have rotary_dim // 2 = {rotary_dim // 2} entries, got {len(factors)}")
    if not all(math.isfinite(f) and f > 0 for f in factors):
        raise ValueError(f"rope_freq_factors must be finite and > 0, got {list(factors)}")
    if scaling is not None and scaling.rope_type not in ("linear", "yarn"):
        raise ValueError(f"rope_freq_factors combine only with no rope scaling, linear or yarn, got "
                         f"{scaling.rope_type!r}")


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _sliding_window(hf_config: Any) -> tuple[int | None, tuple[int, ...] | None]:
    """(window or None, the "sliding_attention" layers: None for all).

    Qwen2 windows only with `use_sliding_window`; `layer_types` (Qwen2, Gemma)
    names each layer "sliding_attention" or "full_attention".
    """
    window = getattr(hf_config, "sliding_window", None)
    window = int(window) if window and getattr(hf_config, "use_sliding_window", True) else None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        return window, None
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"unsupported layer_types {unknown}; supported: sliding_attention, full_attention")
    return window, tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
