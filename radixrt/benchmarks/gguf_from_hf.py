"""A transformers model written as a GGUF file the way llama.cpp's converter (`convert_hf_to_gguf.py`)
writes its family: for tests of reading each family from the file (never committed: rebuilt from
a seed).

Names come from gguf's own tensor map (`gguf.get_tensor_name_map`); what the converter changes is
changed here too: a Llama's (and Mistral's, written as "llama") q and k rows reordered for
llama.cpp's rotary layout, Gemma's norms stored plus 1, a tied or Gemma LM head left out, Phi-3's
longrope factors as `rope_factors_long/short.weight` tensors, a Llama's "llama3" rope scaling as
the `rope_freqs.weight` divisors (no scaling metadata). Metadata carries the keys the
converter writes for the family. Norms and biases are F32 (as llama.cpp keeps every 1-D tensor);
each matrix is of the type `types` names (default F32); K-quants (which gguf cannot quantize) are
random valid blocks (`gguf_models`), the others gguf's reference quantizer over the model's values.
The tokenizer is a byte-level BPE (transformers' fast tokenizer), stored as llama.cpp's "gpt2" model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from radixrt.benchmarks.gguf_models import _K_QUANT_SCALES, _random_blocks, llama_cpp_permute, written

# transformers model_type -> llama.cpp's architecture (Mistral 7B is written as a Llama)
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                      "gemma2": "gemma2", "gemma3_text": "gemma3"}  # fmt: skip


def write_hf_gguf(path: Path, hf_model: Any, hf_tokenizer: Any, types: dict[str, str] | None = None,
                  default_type: str = "F32", seed: int = 0, omit: tuple[str, ...] = (),
                  extra: dict[str, np.ndarray] | None = None) -> Path:
    """`hf_model` (a transformers causal LM of a family in GGUF_ARCHITECTURES) and `hf_tokenizer` at
    `path`, as llama.cpp's converter lays them out; matrices of type `types[gguf name]` (default
    `default_type`); `omit` leaves tensors out; `extra` adds (or replaces) tensors, written as given."""
    config = hf_model.config
    if config.model_type not in GGUF_ARCHITECTURES:
        raise ValueError(f"model_type must be one of {', '.join(GGUF_ARCHITECTURES)}, got {config.model_type!r}")
    arch = GGUF_ARCHITECTURES[config.model_type]
    writer = gguf.GGUFWriter(str(path), arch=arch)
    _write_config(writer, arch, config)
    _write_tokenizer(writer, hf_tokenizer, config.vocab_size)
    tensors = _gguf_tensors(arch, config, hf_model.state_dict())
    rng = np.random.default_rng(seed)
    for name, values in tensors.items():
        if name in omit:
            continue
        if name in (extra or {}):
            continue
        kind = "F32" if values.ndim == 1 else (types or {}).get(name, default_type)
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in _K_QUANT_SCALES:
            data = _random_blocks(qtype, values.shape, rng)
        elif kind == "F32":
            data = values
        else:
            data = gguf.quants.quantize(values, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)  # a uint8 array is read as bytes of `qtype`
    for name, values in (extra or {}).items():
        writer.add_tensor(name, values)
    return written(writer, path)


def _write_config(writer: gguf.GGUFWriter, arch: str, config: Any) -> None:
    """The metadata keys llama.cpp's converter writes for the family."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    rope = dict(config.rope_parameters or {})
    if arch == "gemma3":
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        rope = rope["full_attention"]
    if arch == "phi3":
        rope_dims = int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads
        writer.add_rope_dimension_count(rope_dims)
        trained = rope.get("original_max_position_embeddings") or config.original_max_position_embeddings
        writer.add_rope_scaling_orig_ctx_len(trained)
        writer.add_sliding_window(config.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            scale = config.max_position_embeddings / trained
            attention_factor = math.sqrt(1 + math.log(scale) / math.log(trained)) if scale > 1 else 1.0
            writer.add_rope_scaling_attn_factors(attention_factor)
    else:
        if arch == "llama":
            writer.add_rope_dimension_count(head_dim)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
        elif rope.get("rope_type") == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(rope["factor"])
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch != "gemma2":  # llama.cpp's Gemma 2 runs the default base
        writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma3":
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)


def _gguf_tensors(arch: str, config: Any, state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names, changed as its converter changes them."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    gemma = arch.startswith("gemma")
    tied = gemma or config.tie_word_embeddings
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    out: dict[str, np.ndarray] = {}
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and tied:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = names.get_name(base)
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name} in llama.cpp's {arch} tensor map")
        values = tensor.detach().float().numpy().copy()
        projection = base.rsplit(".", 1)[-1]
        if arch == "llama" and projection in heads:
            values = llama_cpp_permute(values, heads[projection])
        if gemma and hf_name.endswith("norm.weight"):
            values = values + np.float32(1)
        out[f"{name}.{suffix}"] = values
    rope = dict(config.rope_parameters or {})
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        out["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        out["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    if arch == "llama" and rope.get("rope_type") == "llama3":
        out["rope_freqs.weight"] = llama3_rope_freqs(config, rope)
    return out


def llama3_rope_freqs(config: Any, rope: dict[str, Any]) -> np.ndarray:
    """The `rope_freqs.weight` llama.cpp's converter writes for "llama3" rope scaling
    (`LlamaModel.generate_extra_tensors`), computed as it computes it: each frequency's divisor,
    1 for the high ones, `factor` for the low ones, the inverse of the blend between. Its
    arithmetic is float32 where the frequency enters (a torch scalar), Python floats elsewhere."""
    base = rope.get("rope_theta", 10000.0)
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor, high_freq_factor = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen, high_freq_wavelen = old_context_len / low_freq_factor, old_context_len / high_freq_factor
    factors: list[Any] = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor([float(f) for f in factors], dtype=torch.float32).numpy()


def _write_tokenizer(writer: gguf.GGUFWriter, hf_tokenizer: Any, vocab_size: int) -> None:
    """A byte-level BPE tokenizer as llama.cpp's "gpt2" model: tokens by id (padded to the
    model's vocabulary with unused ones), merges, special tokens as control tokens."""
    vocab = hf_tokenizer.get_vocab()
    by_id = {index: token for token, index in vocab.items()}
    special = set(hf_tokenizer.all_special_tokens)
    tokens = [by_id.get(i, f"<unused_{i}>") for i in range(vocab_size)]
    token_types = [gguf.TokenType.CONTROL if t in special else
                   gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED for i, t in enumerate(tokens)]
    merges = json.loads(hf_tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in token_types])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    for token, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                       ("pad", writer.add_pad_token_id)):
        index = getattr(hf_tokenizer, f"{token}_token_id")
        if index is not None:
            add(index)
    if hf_tokenizer.chat_template:
        writer.add_chat_template(hf_tokenizer.chat_template)
