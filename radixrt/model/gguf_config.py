"""A GGUF file's metadata as the Hugging Face config llama.cpp's converter read it from.

transformers' own GGUF config reader drops what these families need (Gemma's soft-caps and
layer pattern, Gemma 3's rope per layer type, Qwen3's head_dim, Phi-3's window and longrope,
rope scaling), so the metadata is mapped here, for every family, into the fields
`ModelConfig.from_hf` reads (transformers 5 spelling: `rope_parameters`):

    {arch}.block_count, embedding_length, feed_forward_length, context_length
    {arch}.attention.head_count, head_count_kv, key_length (head_dim), layer_norm_rms_epsilon
    {arch}.rope.freq_base, dimension_count (Phi-3: the rotated dims), scaling.type / factor /
        original_context_length / attn_factor, freq_base_swa (Gemma 3's sliding layers)
    {arch}.attention.sliding_window, sliding_window_pattern, attn_/final_logit_softcapping
    tokenizer.ggml.eos/eot/eom_token_id: the tokens generation ends at
    tensors: output.weight absent = tied embeddings; attn_q.bias = attention biases;
        rope_factors_long/short.weight = Phi-3's longrope factors; rope_freqs.weight = a
        Llama's per-frequency rope divisors (`rope_freq_factors`)

Llama 3.1/3.2's "llama3" rope scaling is not in the metadata: the converter stores it as
`rope_freqs.weight`, one divisor per rotary frequency, and llama.cpp divides each frequency
by it in every layer, before the scaling the metadata names (linear's or YaRN's, applied on
top), so both are kept here. llama.cpp reads the tensor in Llama files only (a file of another
family holding it does not load there, and is refused here).

What the file does not say is what llama.cpp assumes: Gemma 2 windows every other layer,
Gemma 3 five layers in six with a rope base of 10000 there, and Gemma's query scale is
head_dim except for the 27B models (hidden_size / heads). A Llama-architecture file (Mistral
7B among them) attends to every key, as llama.cpp runs it. Metadata floats are stored as
float32; each is read back as the shortest decimal that rounds to it (1e-06, not
9.99999997e-07), the value the converted config held.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from radixrt.model.gguf_families import ARCHITECTURES
from radixrt.model.gguf_file import GGUFFile

_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma2": "gemma2",
                "gemma3": "gemma3_text"}  # fmt: skip
_ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
# llama.cpp's sliding-window layer pattern and the layer count of the 27B model, per Gemma
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA3_LOCAL_ROPE_THETA = 10000.0
_ROPE_FREQS = "rope_freqs.weight"
_END_TOKEN_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


class MetadataConfig(dict):
    """The config as a plain dict, read by attribute as `ModelConfig.from_hf` reads a
    transformers config, and written to a start record as one (`to_json_string`)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def to_json_string(self, use_diff: bool = True) -> str:
        return json.dumps(self)

    def transformers_config(self) -> Any:
        """The transformers `PretrainedConfig` of these fields."""
        from transformers import AutoConfig

        fields = {k: v for k, v in self.items() if k != "model_type"}
        return AutoConfig.for_model(self["model_type"], **fields)


def hf_config(file: GGUFFile) -> MetadataConfig:
    """The Hugging Face config of `file` (a family in `gguf_families.ARCHITECTURES`); ValueError
    naming a metadata key that is missing or out of range."""
    arch = file.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(f"{file.path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    meta = file.metadata

    def key(name: str, default: Any = ...) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is ...:
            raise ValueError(f"{file.path}: metadata {arch}.{name} is missing")
        return _decimal(value) if isinstance(value, float) else value

    def count(name: str, default: Any = ...) -> int:
        value = key(name, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{file.path}: metadata {arch}.{name} must be one integer >= 1, got {value!r}")
        return value

    hidden, heads, layers = count("embedding_length"), count("attention.head_count"), count("block_count")
    head_dim = count("attention.key_length", None) if f"{arch}.attention.key_length" in meta else None
    if head_dim is None:
        rope_dims = meta.get(f"{arch}.rope.dimension_count") if arch == "llama" else None
        head_dim = rope_dims or hidden // heads
    embedding = file.tensors.get("token_embd.weight")
    if embedding is None:
        raise ValueError(f"{file.path}: tensor token_embd.weight is missing")
    config = MetadataConfig(
        architectures=[ARCHITECTURES[arch]], model_type=_MODEL_TYPES[arch], vocab_size=embedding.shape[0],
        hidden_size=hidden, intermediate_size=count("feed_forward_length"), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=count("attention.head_count_kv", heads), head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=count("context_length"),
        tie_word_embeddings="output.weight" not in file.tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=_end_tokens(meta),
    )  # fmt: skip
    if arch in ("llama", "qwen3"):
        config["attention_bias"] = "blk.0.attn_q.bias" in file.tensors
    if arch in ("qwen2", "qwen3"):  # as their transformers configs say it
        config["layer_types"] = ["full_attention"] * layers
    rope = _rope(file, key, config)
    window = key("attention.sliding_window", 0)
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"{file.path}: metadata {arch}.attention.sliding_window must be an integer >= 0, "
                         f"got {window!r}")
    if arch == "phi3":
        config["sliding_window"] = window or None
    if arch in _GEMMA_PATTERN:
        config["hidden_activation"] = "gelu_pytorch_tanh"
        config["sliding_window"] = window or None
        config["layer_types"] = _gemma_layer_types(file, arch, layers, window, key)
        scaled = layers == _GEMMA_27B_LAYERS[arch]
        config["query_pre_attn_scalar"] = hidden // heads if scaled else head_dim
        config["attn_logit_softcapping"] = key("attn_logit_softcapping", None)
        config["final_logit_softcapping"] = key("final_logit_softcapping", None)
    if arch == "gemma3":
        local = {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_THETA))}
        config["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
    else:
        config["rope_parameters"] = rope
    if _ROPE_FREQS in file.tensors:
        config["rope_freq_factors"] = _rope_freq_factors(file, rope, config["head_dim"])
    return config


def _rope(file: GGUFFile, key: Any, config: MetadataConfig) -> dict[str, Any]:
    """The rope parameters of the (full-attention) layers."""
    arch = file.architecture
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))}
    rope_dims = key("rope.dimension_count", None)
    if rope_dims and rope_dims != config["head_dim"]:
        rope["partial_rotary_factor"] = rope_dims / config["head_dim"]
    scaling = key("rope.scaling.type", "none")
    if scaling not in _ROPE_SCALING_TYPES:
        raise ValueError(f"{file.path}: metadata {arch}.rope.scaling.type is {scaling!r}; supported: "
                         f"{', '.join(_ROPE_SCALING_TYPES)}")
    trained = key("rope.scaling.original_context_length", None)
    if "rope_factors_long.weight" in file.tensors or scaling == "longrope":  # Phi-3's factors are tensors
        rope.update(rope_type="longrope", long_factor=_factors(file, "rope_factors_long.weight"),
                    short_factor=_factors(file, "rope_factors_short.weight"))
        if trained is None:
            raise ValueError(f"{file.path}: metadata {arch}.rope.scaling.original_context_length is missing "
                             "(longrope needs it)")
        rope["original_max_position_embeddings"] = config["original_max_position_embeddings"] = trained
        stored = key("rope.scaling.attn_factor", None)
        scale = config["max_position_embeddings"] / trained
        derived = math.sqrt(1 + math.log(scale) / math.log(trained)) if scale > 1 else 1.0
        if stored is not None and not np.isclose(stored, derived, rtol=1e-6, atol=0):  # else derived, as transformers
            rope["attention_factor"] = float(stored)
    elif scaling == "linear":
        rope.update(rope_type="linear", factor=float(key("rope.scaling.factor")))
    elif scaling == "yarn":
        rope.update(rope_type="yarn", factor=float(key("rope.scaling.factor")))
        if trained is not None:
            rope["original_max_position_embeddings"] = trained
        for gguf_name, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                                ("yarn_attn_factor", "attention_factor")):
            value = key(f"rope.scaling.{gguf_name}", None)
            if value is not None:
                rope[name] = float(value)
    return rope


def _rope_freq_factors(file: GGUFFile, rope: dict[str, Any], head_dim: int) -> list[float]:
    """`rope_freqs.weight`'s divisors, each the float32 stored (as a Python float, exactly)."""
    where = f"{file.path}: tensor {_ROPE_FREQS}"
    if file.architecture != "llama":
        raise ValueError(f"{where} is llama.cpp's rope factors of Llama files; a {file.architecture} file "
                         "cannot carry it")
    if rope["rope_type"] == "longrope":
        raise ValueError(f"{where} cannot go with longrope scaling (llama.cpp would run only {_ROPE_FREQS})")
    half = int(head_dim * rope.get("partial_rotary_factor", 1.0)) // 2
    tensor = file.tensors[_ROPE_FREQS]
    if tensor.type_name != "F32" or tuple(tensor.shape) != (half,):
        raise ValueError(f"{where} must be F32 of shape ({half},) (rotary dims / 2), got {tensor.type_name} "
                         f"{tuple(tensor.shape)}")
    values = tensor.data.view(np.float32).reshape(-1)
    bad = [i for i, v in enumerate(values) if not (math.isfinite(v) and v > 0)]
    if bad:
        raise ValueError(f"{where} must hold finite values > 0; entries {bad[:8]} are "
                         f"{[float(values[i]) for i in bad[:8]]}")
    return [float(v) for v in values]


def _factors(file: GGUFFile, name: str) -> list[float]:
    tensor = file.tensors.get(name)
    if tensor is None or tensor.type_name != "F32" or len(tensor.shape) != 1:
        raise ValueError(f"{file.path}: longrope needs tensor {name}, one F32 row "
                         f"({'missing' if tensor is None else f'{tensor.type_name} {tensor.shape}'})")
    return [_decimal(float(v)) for v in tensor.data.view(np.float32).reshape(-1)]


def _gemma_layer_types(file: GGUFFile, arch: str, layers: int, window: int, key: Any) -> list[str]:
    """Which layers attend within the window: `sliding_window_pattern` (a bool per layer, or every
    n-th layer full) where the file has it, else llama.cpp's pattern for the family."""
    if not window:
        return ["full_attention"] * layers
    pattern = key("attention.sliding_window_pattern", _GEMMA_PATTERN[arch])
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"{file.path}: metadata {arch}.attention.sliding_window_pattern has {len(pattern)} "
                             f"entries, the model {layers} layers")
        sliding = [bool(p) for p in pattern]
    elif isinstance(pattern, int) and pattern >= 0:  # llama.cpp's: 0 is every layer
        sliding = [pattern == 0 or layer % pattern < pattern - 1 for layer in range(layers)]
    else:
        raise ValueError(f"{file.path}: metadata {arch}.attention.sliding_window_pattern must be an integer >= 0 "
                         f"or a bool per layer, got {pattern!r}")
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _end_tokens(meta: Mapping[str, Any]) -> int | list[int] | None:
    """The end-of-sequence token, and the end-of-turn/-message ones llama.cpp also stops at (a chat
    model's generation config lists them beside it: Gemma's <end_of_turn>, Llama 3's <|eot_id|>)."""
    ids = [meta[key] for key in _END_TOKEN_KEYS if isinstance(meta.get(key), int)]
    ids = list(dict.fromkeys(ids))
    return None if not ids else ids[0] if len(ids) == 1 else ids


def _decimal(value: float) -> float:
    """The shortest decimal that rounds to `value`'s float32."""
    return float(str(np.float32(value)))
