"""The GGUF tensors of each family radixrt reads from the file, as llama.cpp's converter names and
changes them, and where each goes in our model.

    family  (general.architecture)   what llama.cpp's converter did to the Hugging Face tensors
    llama   (Llama, SmolLM, Mistral) q and k rows (weights and biases) reordered for its rotary layout
    qwen2, qwen3                     nothing (NEOX rotary); q/k/v biases, Qwen3's attn_q/k_norm
    phi3                             nothing; q/k/v stored fused as attn_qkv, gate and up fused as
                                     ffn_up ([gate | up] rows, our order)
    gemma2, gemma3                   every `*norm.weight` stored plus 1 (Gemma's RMSNorm multiplies by
                                     1 + w); pre_feedforward as ffn_norm, post_feedforward as post_ffw_norm

Everything is put back as Hugging Face stores it, so a dense load equals the Hugging Face
checkpoint the file was converted from. The norms' 1 is taken off in float32: for a stored
factor s >= 0.5, s - 1 is exact (s and 1 are within a factor of two, or s - 1 is a multiple of
s's unit in the last place), so the (1 + w) the model multiplies by is s again, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixrt.model.config import ModelConfig
from radixrt.model.gguf_int4 import PROJECTIONS, unpermute_rows

# general.architecture -> our architecture name (config.py's SUPPORTED_ARCHITECTURES). A Mistral
# file is a "llama" file: llama.cpp's converter writes Mistral 7B as one, and runs it as one.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}  # fmt: skip
_PERMUTED = ("LlamaForCausalLM", "MistralForCausalLM")
_PHI3_PROJECTIONS: dict[str, tuple[str, ...]] = {"qkv": ("attn_qkv",), "o": ("attn_output",), "gate_up": ("ffn_up",),
                                                  "down": ("ffn_down",)}
# Tensors read into the config, not the model (`gguf_config`): Phi-3's longrope factors and a
# Llama's per-frequency rope divisors (llama.cpp's Llama 3 rope scaling)
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight")


@dataclass(frozen=True)
class LayerTensor:
    """A layer parameter (not a projection) and the GGUF tensors it is made of, stacked in rows;
    `shift` is what the converter added (the loader subtracts it)."""

    attribute: str
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    shift: float = 0.0


def projection_parts(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Our fused projections ("qkv", "o", "gate_up", "down") and their GGUF tensors, in row order."""
    return _PHI3_PROJECTIONS if config.architecture == "Phi3ForCausalLM" else PROJECTIONS


def layer_tensors(config: ModelConfig, index: int) -> list[LayerTensor]:
    """Layer `index`'s norms, biases and q/k norms: our parameter, the GGUF tensors, their shapes."""
    block, hidden, head_dim = f"blk.{index}.", config.hidden_size, config.head_dim
    shift = 1.0 if config.is_gemma else 0.0
    tensors = [LayerTensor("input_norm", (block + "attn_norm.weight",), ((hidden,),), shift)]
    if config.is_gemma:
        tensors += [LayerTensor("post_attention_norm", (block + "post_attention_norm.weight",), ((hidden,),), shift),
                    LayerTensor("pre_feedforward_norm", (block + "ffn_norm.weight",), ((hidden,),), shift),
                    LayerTensor("post_feedforward_norm", (block + "post_ffw_norm.weight",), ((hidden,),), shift)]
    else:
        tensors.append(LayerTensor("post_attention_norm", (block + "ffn_norm.weight",), ((hidden,),)))
    if config.qk_norm:
        tensors += [LayerTensor("q_norm", (block + "attn_q_norm.weight",), ((head_dim,),), shift),
                    LayerTensor("k_norm", (block + "attn_k_norm.weight",), ((head_dim,),), shift)]
    if config.attention_bias:
        q_rows, kv_rows = config.num_heads * head_dim, config.num_kv_heads * head_dim
        if config.architecture == "Phi3ForCausalLM":
            tensors.append(LayerTensor("qkv_bias", (block + "attn_qkv.bias",), ((q_rows + 2 * kv_rows,),)))
        else:
            tensors.append(LayerTensor("qkv_bias", tuple(block + f"attn_{n}.bias" for n in "qkv"),
                                       ((q_rows,), (kv_rows,), (kv_rows,))))
    if config.o_proj_bias:
        tensors.append(LayerTensor("o_bias", (block + "attn_output.bias",), ((hidden,),)))
    return tensors


def output_norm_shift(config: ModelConfig) -> float:
    """What the converter added to `output_norm.weight` (Gemma: 1)."""
    return 1.0 if config.is_gemma else 0.0


def row_order(name: str, config: ModelConfig) -> torch.Tensor | None:
    """The rows that undo llama.cpp's rotary reordering of a Llama q or k projection (or bias):
    row r of ours is the file's row `order[r]`; None for every other tensor and family."""
    pieces = name.split(".")
    kind = pieces[2] if len(pieces) > 2 and pieces[0] == "blk" else None
    if kind not in ("attn_q", "attn_k") or config.architecture not in _PERMUTED:
        return None
    heads = config.num_heads if kind == "attn_q" else config.num_kv_heads
    return unpermute_rows(heads * config.head_dim, heads)
