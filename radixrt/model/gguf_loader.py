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
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixrt.kernels import cpu
from radixrt.memory import huge_pages
from radixrt.model import gguf_int4, linear
from radixrt.model.config import ModelConfig
from radixrt.model.gguf_file import GGUFFile, GGUFTensor
from radixrt.model.gguf_int4 import PROJECTIONS, Int4Weight, Int8Weight
from radixrt.model.gguf_plan import TensorPlan
from radixrt.model.llama import LlamaForCausalLM
from radixrt.model.start_record import read_record, write_record
from radixrt.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

NATIVE_ARCHITECTURES = ("llama",)
_CHUNK_BYTES = 64 << 20  # float32 bytes dequantized at a time: a big embedding never doubles in memory


def is_native_architecture(file: GGUFFile) -> bool:
    return file.architecture in NATIVE_ARCHITECTURES


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
            if placed is not None:  # straight from the file's blocks into the buffer a step reads
                layer.use_int4({fused: _packed(parts, config, placed) for fused, parts in plan.native[index].items()})
            elif plan.native[index]:
                layer.use_int4({fused: _int4(parts, config) for fused, parts in plan.native[index].items()})
            file.release([part for parts in (*plan.native[index].values(), *plan.dense[index].values())
                          for part in parts])
    if any(plan.native) or plan.head is not None:
        model.finish_int4(_head(plan.head, placed), quantized_embedding, placed)
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
            rows.index_copy_(0, inverse[start : start + block.shape[0]].to(rows.device),
                             block.to(device=rows.device, dtype=rows.dtype))


def _packed(parts: list[GGUFTensor], config: ModelConfig, placed: huge_pages.SideBySide) -> cpu.PackedWeight:
    """A fused projection's Q4_0/Q4_1 parts in the kernel's layout, written into the next slot of
    `placed` by `pack_gguf.c` from the rows' addresses in the mapped file (q/k rows reordered)."""
    matmul = cpu.quantized_matmul()
    assert matmul is not None  # `_packed_buffer` asked
    addresses, kinds = [], []
    for part in parts:
        order = _row_order(part, config)
        rows = torch.arange(part.shape[0]) if order is None else order
        addresses.append(part.data.ctypes.data + rows * part.data.shape[1])
        kinds.append(torch.full((part.shape[0],), 1 if part.type_name == "Q4_1" else 0, dtype=torch.uint8))
    num_rows, num_cols = sum(part.shape[0] for part in parts), parts[0].shape[1]
    return matmul.pack_gguf_q4(torch.cat(addresses), torch.cat(kinds), num_cols, placed.take(num_rows * num_cols * 5 // 8))


def _head(head: GGUFTensor | None,
          placed: huge_pages.SideBySide | None) -> Int4Weight | Int8Weight | cpu.PackedWeight | None:
    """The file's LM head: a Q8_0 one written by `pack_gguf.c` into the last slot of `placed`
    (where there is one), else as codes for `finish_int4` to pack."""
    if head is None:
        return None
    matmul = cpu.quantized_matmul()
    num_rows, num_cols = head.shape[0], head.shape[1]
    if placed is None or head.type_name != "Q8_0" or matmul is None or not matmul.supports((num_rows, num_cols)):
        return gguf_int4.quantized_head(head)
    rows = head.data.ctypes.data + torch.arange(num_rows) * head.data.shape[1]
    return matmul.pack_gguf_q8(rows, num_cols, placed.take(num_rows * num_cols * 17 // 16))


def _int4(parts: list[GGUFTensor], config: ModelConfig) -> Int4Weight:
    weights = []
    for part in parts:
        weight = gguf_int4.int4_weight(part)
        order = _row_order(part, config)
        weights.append(weight if order is None else weight.rows(order))
    return Int4Weight.stack_rows(weights)


def _row_order(tensor: GGUFTensor, config: ModelConfig) -> torch.Tensor | None:
    """The rows that undo llama.cpp's rotary reordering, for a q or k projection."""
    pieces = tensor.name.split(".")
    kind = pieces[2] if len(pieces) > 2 and pieces[0] == "blk" else None
    if kind not in ("attn_q", "attn_k"):
        return None
    return gguf_int4.unpermute_rows(tensor.shape[0], config.num_heads if kind == "attn_q" else config.num_kv_heads)


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

