"""Which GGUF tensor goes where, and whether the model fits, decided before anything is allocated.

`plan_tensors` checks every tensor's name and shape against the config and
chooses, per fused projection and for the LM head, native (kept as stored:
every part of a format the kernels run, `runs`) or dense (dequantized, one
WARNING naming the types and tensors; a type gguf cannot dequantize either is
a ValueError naming them); `check_memory` compares the bytes that plan holds
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
from radixrt.model.gguf_families import CONFIG_TENSORS, layer_tensors, projection_parts
from radixrt.model.gguf_file import GGUFFile, GGUFTensor
from radixrt.model.gguf_int4 import LM_HEAD_TYPES, SUPPORTED_TYPES

# Whether the native path runs a tensor as stored (its type and shape); the default, without
# radixrt's packed kernels: the types torch's 4-bit kernel takes.
Runs = Callable[[GGUFTensor], bool]
DENSE_TYPES = ("F32", "F16", "BF16")


@dataclass
class TensorPlan:
    """Which tensor goes where and how, decided before anything is allocated."""

    native: list[dict[str, list[GGUFTensor]]]  # per layer: fused projection -> its parts, kept 4-bit
    dense: list[dict[str, list[GGUFTensor]]]  # per layer: fused projection -> its parts, dequantized
    head: GGUFTensor | None  # the LM head kept as stored; None: dense (or tied to a dense embedding)
    fallback: dict[str, list[str]] = field(default_factory=dict)  # type -> tensors native could not run
    embedding: GGUFTensor | None = None  # an untied embedding looked up as stored; None: dense (or the tied head)


def plan_tensors(file: GGUFFile, config: ModelConfig, native: bool, runs: Runs | None = None,
                 embedding_runs: Runs | None = None) -> TensorPlan:
    """Check every tensor's name and shape against `config`, and choose native or dense for each
    projection, the LM head and (untied) the embedding: native where `runs` says every part runs
    as stored (`embedding_runs` for the embedding's lookups). ValueError naming a tensor that is
    missing, extra or mis-shaped, or whose type gguf cannot dequantize."""
    if runs is None:
        runs = _runs_torch_int4
    expected = _expected_shapes(config)
    missing = sorted(set(expected) - set(file.tensors))
    extra = sorted(set(file.tensors) - set(expected) - set(CONFIG_TENSORS) - {"output.weight"})
    if missing or extra:
        raise ValueError(f"{file.path}: tensors do not match a {config.architecture} of this config: missing "
                         f"{missing[:6]} ({len(missing)} in all), unexpected {extra[:6]} ({len(extra)} in all)")
    for name, shape in expected.items():
        if file.tensors[name].shape != shape:
            raise ValueError(f"{file.path}: tensor {name} has shape {file.tensors[name].shape}, the config "
                             f"says {shape}")
    _check_dequantizable(file)
    plan = TensorPlan([], [], None)
    for index in range(config.num_layers):
        native_layer: dict[str, list[GGUFTensor]] = {}
        dense_layer: dict[str, list[GGUFTensor]] = {}
        for fused, names in projection_parts(config).items():
            parts = [file.tensors[f"blk.{index}.{name}.weight"] for name in names]
            every = all(runs(part) for part in parts)
            (native_layer if native and every else dense_layer)[fused] = parts
            if native and not every:
                for part in parts:
                    if part.type_name not in DENSE_TYPES and not runs(part):
                        plan.fallback.setdefault(part.type_name, []).append(part.name)
        plan.native.append(native_layer)
        plan.dense.append(dense_layer)
    head = file.tensors["token_embd.weight" if config.tie_word_embeddings else "output.weight"]
    if native and (runs(head) or head.type_name in LM_HEAD_TYPES):  # the latter: torch's kernels take them
        plan.head = head
    elif native and head.type_name not in DENSE_TYPES:
        plan.fallback.setdefault(head.type_name, []).append(f"{head.name} (as the LM head)")
    embedding = file.tensors["token_embd.weight"]
    if native and not config.tie_word_embeddings and embedding_runs is not None and embedding_runs(embedding):
        plan.embedding = embedding
    return plan


def _runs_torch_int4(tensor: GGUFTensor) -> bool:
    return tensor.type_name in SUPPORTED_TYPES


def _check_dequantizable(file: GGUFFile) -> None:
    """ValueError naming the tensors of a type gguf has no dequantizer for (the dense path's reader)."""
    import gguf.quants

    known = {*DENSE_TYPES, *(qtype.name for qtype in gguf.quants._type_traits)}
    unknown: dict[str, list[str]] = {}
    for tensor in file.tensors.values():
        if tensor.type_name not in known:
            unknown.setdefault(tensor.type_name, []).append(tensor.name)
    if unknown:
        raise ValueError(f"{file.path}: no dequantizer for "
                         + "; ".join(f"{kind}: {', '.join(names[:4])}" + (f" and {len(names) - 4} more"
                                     if len(names) > 4 else "") for kind, names in sorted(unknown.items()))
                         + f" (types radixrt reads: {', '.join(sorted(known))})")


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
    """Every tensor a file of this config's family holds (`gguf_families`), and its shape."""
    hidden, head_dim, inner = config.hidden_size, config.head_dim, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (config.vocab_size, hidden), "output_norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["output.weight"] = (config.vocab_size, hidden)
    q_rows, kv_rows = config.num_heads * head_dim, config.num_kv_heads * head_dim
    rows = {"attn_q": q_rows, "attn_k": kv_rows, "attn_v": kv_rows, "attn_qkv": q_rows + 2 * kv_rows,
            "attn_output": hidden, "ffn_gate": inner, "ffn_up": inner, "ffn_down": hidden}
    inputs = {"attn_output": q_rows, "ffn_down": inner}
    parts = projection_parts(config)
    for i in range(config.num_layers):
        for fused, names in parts.items():
            for name in names:
                fused_rows = 2 * inner if fused == "gate_up" and len(names) == 1 else rows[name]  # Phi-3's gate and up
                shapes[f"blk.{i}.{name}.weight"] = (fused_rows, inputs.get(name, hidden))
        for tensor in layer_tensors(config, i):
            shapes.update(zip(tensor.names, tensor.shapes))
    return shapes


def _loaded_bytes(file: GGUFFile, plan: TensorPlan, config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes the model holds once loaded: dense tensors in `dtype`, quantized ones in the kernels'
    packed layouts (`_native_bytes`)."""
    element = torch.empty((), dtype=dtype).element_size()
    native = {t.name for layer in plan.native for parts in layer.values() for t in parts}
    if plan.head is not None:
        native.add(plan.head.name)
    if plan.embedding is not None:
        native.add(plan.embedding.name)
    looked_up = plan.embedding is not None or (plan.head is not None and config.tie_word_embeddings
                                               and dtype == torch.bfloat16
                                               and _native_bytes(plan.head, exact=True) is not None)
    total = 0
    for name, tensor in file.tensors.items():
        if name in native:
            total += _native_bytes(tensor) or 0
            if name == "token_embd.weight" and not looked_up:
                total += int(np.prod(tensor.shape)) * element  # the embedding's dense table beside the tied head
        elif name not in CONFIG_TENSORS:
            total += int(np.prod(tensor.shape)) * element
    return total


def _native_bytes(tensor: GGUFTensor, exact: bool = False) -> int | None:
    """A native tensor's bytes packed: in radixrt's layout for its format where that kernel runs,
    else as torch's 4-bit kernel holds it (half a byte a weight, fp16 scale and offset per 32;
    with `exact`, None there)."""
    from radixrt.kernels import cpu

    shape = (tensor.shape[0], int(np.prod(tensor.shape[1:])))
    matmul = cpu.quantized_matmul()
    format = cpu.FORMATS.get(tensor.type_name)
    if matmul is not None and format is not None and matmul.format_runs(format, shape):
        return matmul.packed_bytes(format, shape)
    count = shape[0] * shape[1]
    return None if exact else count // 2 + count // 32 * 4
