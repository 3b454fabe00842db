"""A GGUF model read straight from its file: no converted copy of the weights, on disk or in memory.

    file ──mmap──► GGUFFile ──► config + tokenizer: the start record, or transformers over the
       │                        metadata once (then recorded: `start_record`)
       │
       ├─ projections the native kernels run (Q4_0/Q4_1)  ──► repacked into the kernel's layout
       ├─ LM head the native kernels run (Q4_0/Q4_1/Q8_0) ──► kept as stored (`Int8Weight`/`Int4Weight`)
       └─ everything else (norms, embedding, other types) ──► dequantized (gguf's reference
          dequantizer, in row chunks) and rounded once to the model's dtype

`weights="dense"` dequantizes every tensor. `weights="native"` runs what it
can quantized; a projection stored in a type without a kernel yet (K-quants,
Q5_0/Q5_1, Q8_0 projections) is dequantized with one WARNING naming the
types and tensors. Everything that can fail on the file or the machine
(layout, architecture, tensor names and shapes, memory for the weights plus
the KV pool) is checked before the model is allocated, so a bad file leaves
nothing half-loaded behind.

llama.cpp's converter reorders the rows of each q and k projection for its
rotary layout; they are put back in Hugging Face order (as transformers does),
so the dense weights equal the ones the earlier transformers conversion wrote,
bit for bit.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixrt.memory import huge_pages
from radixrt.memory.kv_cache import KVShape
from radixrt.model import gguf_int4, linear
from radixrt.model.config import ModelConfig
from radixrt.model.gguf_file import GGUFFile, GGUFTensor
from radixrt.model.gguf_int4 import LM_HEAD_TYPES, PROJECTIONS, SUPPORTED_TYPES, Int4Weight
from radixrt.model.llama import LlamaForCausalLM
from radixrt.model.start_record import read_record, write_record
from radixrt.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

NATIVE_ARCHITECTURES = ("llama",)
# Tensors transformers does not read either (llama.cpp's precomputed rope factors): skipped, as there.
_IGNORED = ("rope_freqs.weight",)
_CHUNK_BYTES = 64 << 20  # float32 bytes dequantized at a time: a big embedding never doubles in memory


@dataclass
class TensorPlan:
    """Which tensor goes where and how, decided before anything is allocated."""

    native: list[dict[str, list[GGUFTensor]]]  # per layer: fused projection -> its parts, kept 4-bit
    dense: list[dict[str, list[GGUFTensor]]]  # per layer: fused projection -> its parts, dequantized
    head: GGUFTensor | None  # the LM head kept as stored; None: dense (or tied to a dense embedding)
    fallback: dict[str, list[str]] = field(default_factory=dict)  # type -> tensors native could not run


def is_native_architecture(file: GGUFFile) -> bool:
    return file.architecture in NATIVE_ARCHITECTURES


def has_native_projections(file: GGUFFile) -> bool:
    """Whether any projection is stored in a type the native kernels run (what `weights="auto"` asks)."""
    suffixes = {f"{name}.weight" for names in PROJECTIONS.values() for name in names}
    return any(t.type_name in SUPPORTED_TYPES for name, t in file.tensors.items()
               if name.startswith("blk.") and name.split(".", 2)[2] in suffixes)  # fmt: skip


def config_and_tokenizer(file: GGUFFile) -> tuple[ModelConfig, Any, Callable[[], Any]]:
    """The model config, the tokenizer and a reader of the transformers config: from the file's
    start record (no transformers import), else through transformers over the metadata, recorded."""
    record = read_record(file)
    if record is not None:
        tokenizer = Tokenizer(record.tokenizer, functools.partial(_transformers_tokenizer, file.path))
        return record.model_config(), tokenizer, functools.cache(functools.partial(_transformers_config, file.path))
    hf_config = _transformers_config(file.path)
    config = ModelConfig.from_hf(hf_config)
    hf_tokenizer = _transformers_tokenizer(file.path)
    written = write_record(file, hf_config, config, hf_tokenizer)
    tokenizer = hf_tokenizer if written is None else Tokenizer(written.tokenizer, lambda: hf_tokenizer)
    return config, tokenizer, lambda: hf_config


def plan_tensors(file: GGUFFile, config: ModelConfig, native: bool) -> TensorPlan:
    """Check every tensor's name and shape against `config`, and choose native or dense for each
    projection and the LM head (ValueError naming a tensor that is missing, extra or mis-shaped)."""
    expected = _expected_shapes(config)
    missing = sorted(set(expected) - set(file.tensors))
    extra = sorted(set(file.tensors) - set(expected) - set(_IGNORED) - {"output.weight"})
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


def build_model(file: GGUFFile, plan: TensorPlan, config: ModelConfig, device: torch.device,
                dtype: torch.dtype) -> LlamaForCausalLM:
    """The model over the file's tensors as `plan` says (see the module docstring)."""
    if plan.fallback:
        logger.warning(
            "%s: no native kernel yet for %s; these tensors (with the Q4_0/Q4_1 ones fused with them) are "
            "dequantized to %s at load and run on the slower dense path (kernels for these types are coming)",
            file.path.name, "; ".join(f"{kind}: {_names(names)}" for kind, names in sorted(plan.fallback.items())),
            str(dtype).removeprefix("torch."),
        )
    model = LlamaForCausalLM(config, device=device, dtype=dtype, dense_projections=False)
    quantized_embedding = plan.head is not None and plan.head.type_name == "Q8_0" and model.embedding_runs_quantized(
        8, (plan.head.shape[0], plan.head.shape[1]))
    with torch.no_grad():
        if not quantized_embedding:  # else its rows are looked up in the head, the table never filled
            dequantize_into(model.embed_tokens, file.tensors["token_embd.weight"])
        dequantize_into(model.norm, file.tensors["output_norm.weight"])
        if not config.tie_word_embeddings:
            dequantize_into(model.lm_head, file.tensors["output.weight"])
        file.release([file.tensors["token_embd.weight"]])
        model.prepack()
        placed = _packed_buffer(plan, dtype)
        for index, layer in enumerate(model._decoder_layers()):
            dequantize_into(layer.input_norm, file.tensors[f"blk.{index}.attn_norm.weight"])
            dequantize_into(layer.post_attention_norm, file.tensors[f"blk.{index}.ffn_norm.weight"])
            for fused, parts in plan.dense[index].items():
                dense = torch.empty(layer.projection_shapes()[fused], dtype=dtype, device=device)
                start = 0
                for part in parts:
                    rows = dense.narrow(0, start, part.shape[0])
                    dequantize_into(rows, part, _row_order(part, config))
                    start += part.shape[0]
                layer.set_dense_projection(fused, dense)
            layer.prepack()
            if plan.native[index]:
                layer.use_int4({fused: _int4(parts, config) for fused, parts in plan.native[index].items()})
                if placed is not None and layer.int4_steps is None:
                    placed = None  # no whole-step kernel here: the layers stay where they were packed
                if placed is not None:
                    layer.place_packed(placed)
            file.release([part for parts in (*plan.native[index].values(), *plan.dense[index].values())
                          for part in parts])
    if any(plan.native) or plan.head is not None:
        model.finish_int4(None if plan.head is None else gguf_int4.quantized_head(plan.head), quantized_embedding,
                          placed)
        file.release([] if plan.head is None else [plan.head])
    huge_pages.release_free_heap()
    return model


def _packed_buffer(plan: TensorPlan, dtype: torch.dtype) -> huge_pages.SideBySide | None:
    """The buffer every layer's packed weights (and a packed head) go into as they are built, in
    the order a step reads them, where every layer runs all four projections in radixrt's
    kernel; else None (`finish_int4` then places what it can after the fact)."""
    if not plan.native or not all(len(layer) == len(PROJECTIONS) for layer in plan.native):
        return None
    shapes = [(sum(part.shape[0] for part in parts), parts[0].shape[1])
              for layer in plan.native for parts in layer.values()]  # fmt: skip
    if not all(linear.runs_own_kernel(shape, dtype) for shape in shapes):
        return None
    sizes = [rows * cols * 5 // 8 for rows, cols in shapes]  # 320 bytes a tile of 16 rows by 32 inputs
    head = plan.head
    if head is not None and linear.runs_own_kernel((head.shape[0], head.shape[1]), dtype):
        head_bytes = 17 if head.type_name == "Q8_0" else 10  # 544 (8-bit) or 320 (4-bit) bytes a tile, per 512
        sizes.append(head.shape[0] * head.shape[1] * head_bytes // 16)
    return huge_pages.SideBySide(sizes)


def dequantize_into(destination: torch.Tensor, tensor: GGUFTensor, row_order: torch.Tensor | None = None) -> None:
    """`destination` = the tensor's values as gguf's reference dequantizer computes them (float32),
    rounded once to its dtype; rows reordered so that row r is stored row `row_order[r]`."""
    import gguf

    data = tensor.data
    rows = destination.view(-1, tensor.shape[-1]) if destination.dim() > 1 else destination.view(1, -1)
    if row_order is not None:
        inverse = torch.empty_like(row_order)
        inverse[row_order] = torch.arange(row_order.numel())
    chunk = max(1, _CHUNK_BYTES // (4 * tensor.shape[-1]))
    for start in range(0, data.shape[0], chunk):
        values = gguf.quants.dequantize(data[start : start + chunk], tensor.qtype)
        block = torch.from_numpy(np.array(values, dtype=np.float32, copy=not values.flags.writeable))
        block = block.view(-1, tensor.shape[-1])
        if row_order is None:
            rows[start : start + block.shape[0]].copy_(block)
        else:
            rows.index_copy_(0, inverse[start : start + block.shape[0]].to(rows.device), block.to(rows.dtype))


def _int4(parts: list[GGUFTensor], config: ModelConfig) -> Int4Weight:
    weights = []
    for part in parts:
        weight = gguf_int4.int4_weight(part)
        order = _row_order(part, config)
        weights.append(weight if order is None else weight.rows(order))
    return Int4Weight.stack_rows(weights)


def _row_order(tensor: GGUFTensor, config: ModelConfig) -> torch.Tensor | None:
    """The rows that undo llama.cpp's rotary reordering, for a q or k projection."""
    kind = tensor.name.split(".")[2]
    if kind not in ("attn_q", "attn_k"):
        return None
    return gguf_int4.unpermute_rows(tensor.shape[0], config.num_heads if kind == "attn_q" else config.num_kv_heads)


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
        elif name not in _IGNORED:
            total += count * element
    return total


def _names(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:3])} and {len(names) - 3} more"


def _transformers_config(path: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)


def _transformers_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"{path}: the tokenizer did not load from the GGUF metadata ({error})") from error

