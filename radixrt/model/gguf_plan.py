"""Which GGUF tensor goes where, and whether the model fits, decided before anything is allocated.

`plan_tensors` checks every tensor's name and shape against the config and
chooses, per fused projection and for the LM head, native (kept as stored)
or dense (dequantized); `check_memory` compares the bytes that plan holds
once loaded, plus the KV pool the caller will allocate, with the memory
available. Both raise ValueError naming the file (and tensor) and the numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from radixrt.memory.kv_cache import KVShape
from radixrt.model.config import ModelConfig
from radixrt.model.gguf_file import GGUFFile, GGUFTensor
from radixrt.model.gguf_int4 import LM_HEAD_TYPES, PROJECTIONS, SUPPORTED_TYPES

# Tensors transformers does not read either (llama.cpp's precomputed rope factors): skipped, as there.
IGNORED = ("rope_freqs.weight",)


@dataclass
class TensorPlan:
    """Which tensor goes where and how, decided before anything is allocated."""

    native: list[dict[str, list[GGUFTensor]]]  # per layer: fused projection -> its parts, kept 4-bit
    dense: list[dict[str, list[GGUFTensor]]]  # per layer: fused projection -> its parts, dequantized
    head: GGUFTensor | None  # the LM head kept as stored; None: dense (or tied to a dense embedding)
    fallback: dict[str, list[str]] = field(default_factory=dict)  # type -> tensors native could not run


def plan_tensors(file: GGUFFile, config: ModelConfig, native: bool) -> TensorPlan:
    """Check every tensor's name and shape against `config`, and choose native or dense for each
    projection and the LM head (ValueError naming a tensor that is missing, extra or mis-shaped)."""
    expected = _expected_shapes(config)
    missing = sorted(set(expected) - set(file.tensors))
    extra = sorted(set(file.tensors) - set(expected) - set(IGNORED) - {"output.weight"})
    if missing or extra:
        raise ValueError(f"{file.path}: tensors do not match a {config.architecture} of this config: missing "
                         f"{missing[:6]} ({len(missing)} in all), unexpected {extra[:6]} ({len(extra)} in all)")
    for name, shape in expected.items():
        if file.tensors[name].shape != shape:
            raise ValueError(f"{file.path}: tensor {name} has shape {file.tensors[name].shape}, the config "
                             f"says {shape}")
    plan = TensorPlan([], [], None)
    for index in range(config.num_layers):
        native_layer: dict[str, list[GGUFTensor]] = {}
        dense_layer: dict[str, list[GGUFTensor]] = {}
        for fused, names in PROJECTIONS.items():
            parts = [file.tensors[f"blk.{index}.{name}.weight"] for name in names]
            runs = all(part.type_name in SUPPORTED_TYPES for part in parts)
            (native_layer if native and runs else dense_layer)[fused] = parts
            if native and not runs:
                for part in parts:
                    if part.type_name not in (*SUPPORTED_TYPES, "F32", "F16", "BF16"):
                        plan.fallback.setdefault(part.type_name, []).append(part.name)
        plan.native.append(native_layer)
        plan.dense.append(dense_layer)
    head = file.tensors["token_embd.weight" if config.tie_word_embeddings else "output.weight"]
    if native and head.type_name in LM_HEAD_TYPES:
        plan.head = head
    elif native and head.type_name not in ("F32", "F16", "BF16"):
        plan.fallback.setdefault(head.type_name, []).append(f"{head.name} (as the LM head)")
    return plan


def check_memory(file: GGUFFile, plan: TensorPlan, config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 kv_pool_bytes: Callable[[KVShape], int] | None) -> None:
    """ValueError, with the numbers, unless the weights as loaded plus the KV pool fit in the memory
    available now (checked before allocating either)."""
    if device.type != "cpu":
        return  # the GPU's KV pool is sized from what the weights leave free
    weight_bytes = _loaded_bytes(file, plan, config, dtype)
    kv_bytes = 0 if kv_pool_bytes is None else kv_pool_bytes(config.kv_shape(dtype))
    available = available_memory_bytes()
    if available is not None and weight_bytes + kv_bytes > available:
        gib = 2**30
        raise ValueError(
            f"{file.path}: not enough memory: the weights need {weight_bytes / gib:.2f} GiB as loaded "
            f"({str(dtype).removeprefix('torch.')}) and the KV pool {kv_bytes / gib:.2f} GiB, but "
            f"{available / gib:.2f} GiB is available; lower max_total_tokens or kv_memory_bytes, or use a "
            "smaller (or more quantized) model"
        )


def available_memory_bytes() -> int | None:
    """MemAvailable (Linux), or None where the system does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    hidden, head_dim, inner = config.hidden_size, config.head_dim, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (config.vocab_size, hidden), "output_norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["output.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_layers):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.attn_q.weight": (config.num_heads * head_dim, hidden),
            f"blk.{i}.attn_k.weight": (config.num_kv_heads * head_dim, hidden),
            f"blk.{i}.attn_v.weight": (config.num_kv_heads * head_dim, hidden),
            f"blk.{i}.attn_output.weight": (hidden, config.num_heads * head_dim),
            f"blk.{i}.ffn_gate.weight": (inner, hidden), f"blk.{i}.ffn_up.weight": (inner, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, inner),
        })  # fmt: skip
    return shapes


def _loaded_bytes(file: GGUFFile, plan: TensorPlan, config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes the model holds once loaded: dense tensors in `dtype`, quantized ones in the kernel's
    layout (4-bit: half a byte a weight and fp16 scale and offset per 32; 8-bit: a byte and a scale)."""
    element = torch.empty((), dtype=dtype).element_size()
    native = {t.name for layer in plan.native for parts in layer.values() for t in parts}
    total = 0
    for name, tensor in file.tensors.items():
        count = int(np.prod(tensor.shape))
        if name in native:
            total += count // 2 + count // 32 * 4
        elif plan.head is not None and tensor is plan.head:
            total += count + count // 32 * 2
            if config.tie_word_embeddings and not (plan.head.type_name == "Q8_0" and dtype == torch.bfloat16):
                total += count * element  # the embedding's dense table (a tied Q8_0 head is looked up instead)
        elif name not in IGNORED:
            total += count * element
    return total
