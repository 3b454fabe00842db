"""A GGUF model read straight from its file: no converted or dense copy of the weights, on disk or in memory.

Every family in `gguf_families.ARCHITECTURES` is read so: llama (Llama, SmolLM, Mistral as
llama.cpp writes it), qwen2 (Qwen2, Qwen2.5), qwen3, phi3, gemma2 and gemma3 (the text model).

    file ──mmap──► GGUFFile ──► config: the metadata, mapped per family (`gguf_config`)
       │                   └──► tokenizer: the start record, else built from the metadata
       │                        (`gguf_tokenizer`; transformers where it declines), then recorded
       │
       ├─ projections, LM head and embedding in a     ──► repacked from the file's blocks into the
       │  format with a packed layout (Q4_0, Q4_1,        formats' tile layouts (`cpu.PackedWeight`,
       │  Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)             parts of several formats in one projection),
       │                                                  one buffer kept on disk after the first
       │                                                  start and mapped by later ones (`packed_copy`)
       └─ everything else (norms, other types)       ──► dequantized (gguf's reference dequantizer,
                                                         in row chunks), rounded once to the dtype

`weights="dense"` dequantizes every tensor. `weights="native"` runs what it
can quantized: every projection, the LM head, and the embedding (its rows
dequantized as a step looks them up; a tied one is the head's own tiles);
a tensor stored in a type without a packed layout (Q2_K, Q3_K, IQ*), and
the parts fused with it, are dequantized with one WARNING naming the types
and tensors; a type gguf cannot dequantize either is refused by name.
Without radixrt's packed kernels (no C compiler, or float32) only Q4_0/Q4_1
projections and Q4_0/Q4_1/Q8_0 heads run quantized, on torch's kernel.
Everything that can fail on the file or the machine (layout, architecture,
tensor names and shapes, memory for the weights plus the KV pool) is checked
before the model is allocated, so a bad file leaves nothing half-loaded
behind.

What llama.cpp's converter changed is undone (`gguf_families`): a Llama's q and k rows
reordered for its rotary layout are put back in Hugging Face order (as transformers does),
Gemma's norms stored plus 1 get their 1 back, Phi-3's fused q/k/v and gate/up are our fused
layout already. The dense weights equal the Hugging Face checkpoint the file was converted from,
bit for bit, for an F32 file.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from radixrt.kernels import cpu
from radixrt.memory import huge_pages, packed_copy
from radixrt.model import gguf_config, gguf_int4, linear
from radixrt.model.config import ModelConfig
from radixrt.model.gguf_families import ARCHITECTURES, layer_tensors, output_norm_shift, row_order
from radixrt.model.gguf_file import GGUFFile, GGUFTensor
from radixrt.model.gguf_int4 import PROJECTIONS, Int4Weight, Int8Weight
from radixrt.model.gguf_plan import TensorPlan
from radixrt.model.gguf_tokenizer import tokenizer_record
from radixrt.model.llama import LlamaForCausalLM
from radixrt.model.start_record import read_record, write_record
from radixrt.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

NATIVE_ARCHITECTURES = tuple(ARCHITECTURES)
_CHUNK_BYTES = 64 << 20  # float32 bytes dequantized at a time: a big embedding never doubles in memory


def is_native_architecture(file: GGUFFile) -> bool:
    return file.architecture in NATIVE_ARCHITECTURES


def config_of(file: GGUFFile) -> tuple[ModelConfig, gguf_config.MetadataConfig, Callable[[], Any]]:
    """The model config, the Hugging Face config it was read from (both from the metadata) and a
    reader of the transformers config (which imports transformers on its first call)."""
    hf_config = gguf_config.hf_config(file)
    return ModelConfig.from_hf(hf_config), hf_config, functools.cache(hf_config.transformers_config)


def tokenizer_of(file: GGUFFile, hf_config: gguf_config.MetadataConfig, config: ModelConfig) -> Any:
    """The file's tokenizer.

    It comes from the file's start record; else it is built from the metadata as
    transformers builds it (`gguf_tokenizer`, without importing transformers) and recorded; else
    (a vocabulary that module does not reproduce) it is read through transformers and recorded.
    Attributes a recorded tokenizer lacks are read from transformers' tokenizer, built on first use.
    """
    load_transformers = functools.partial(_transformers_tokenizer, file.path)
    record = read_record(file)
    if record is not None:
        return Tokenizer(record.tokenizer, load_transformers)
    built = tokenizer_record(file)
    if built is not None:
        write_record(file, hf_config, config, built)
        return Tokenizer(built, load_transformers)
    hf_tokenizer = _transformers_tokenizer(file.path)
    written = write_record(file, hf_config, config, hf_tokenizer)
    return hf_tokenizer if written is None else Tokenizer(written.tokenizer, lambda: hf_tokenizer)


def build_model(file: GGUFFile, plan: TensorPlan, config: ModelConfig, device: torch.device,
                dtype: torch.dtype) -> LlamaForCausalLM:
    """The model over the file's tensors as `plan` says (see the module docstring)."""
    if plan.fallback:
        logger.warning(
            "%s: no packed kernel for %s on this machine; these tensors (with the parts fused with them) are "
            "dequantized to %s at load and run on the slower dense path",
            file.path.name, "; ".join(f"{kind}: {_names(names)}" for kind, names in sorted(plan.fallback.items())),
            str(dtype).removeprefix("torch."),
        )
    model = LlamaForCausalLM(config, device=device, dtype=dtype, dense_projections=False)
    head_format = None if plan.head is None else cpu.FORMATS.get(plan.head.type_name)
    tied_lookup = (config.tie_word_embeddings and head_format is not None and plan.head is not None
                   and model.embedding_runs_quantized(head_format, (plan.head.shape[0], plan.head.shape[1])))
    with torch.no_grad():
        if plan.embedding is None and not tied_lookup:  # else its rows are looked up as stored
            dequantize_into(model.embed_tokens, file.tensors["token_embd.weight"])
            file.release([file.tensors["token_embd.weight"]])
        _read_small(model.norm, [file.tensors["output_norm.weight"]], config, output_norm_shift(config))
        if not config.tie_word_embeddings and plan.head is None:  # else the head runs as stored
            dequantize_into(model.lm_head, file.tensors["output.weight"])
        model.prepack()
        slots = _slots(file, plan, dtype)
        placed = None if slots is None else packed_copy.buffer(slots.sizes, slots.path)
        for index, layer in enumerate(model.decoder_layers()):
            for small in layer_tensors(config, index):  # norms, biases, q/k norms
                _read_small(getattr(layer, small.attribute), [file.tensors[name] for name in small.names], config,
                            small.shift)
            for fused, parts in plan.dense[index].items():
                dense = torch.empty(layer.projection_shapes()[fused], dtype=dtype, device=device)
                start = 0
                for part in parts:
                    rows = dense.narrow(0, start, part.shape[0])
                    dequantize_into(rows, part, _row_order(part, config))
                    start += part.shape[0]
                layer.set_dense_projection(fused, dense)
            layer.prepack()
            if plan.native[index]:  # straight from the file's blocks (into the buffer a step reads)
                layer.use_int4({fused: _packed(parts, config, placed) if _packs(parts, dtype) else _int4(parts, config)
                                for fused, parts in plan.native[index].items()})  # fmt: skip
            file.release([part for parts in (*plan.native[index].values(), *plan.dense[index].values())
                          for part in parts])
        # an untied table's rows are looked up as stored, the dense table never filled
        embedding = tied_lookup if plan.embedding is None else _packed([plan.embedding], config, placed)
        head = _head(plan.head, placed, dtype, config)
    if any(plan.native) or plan.head is not None:
        model.finish_int4(head, embedding, placed)
    file.release([t for t in (plan.head, plan.embedding) if t is not None])
    huge_pages.release_free_heap()
    if placed is not None and slots is not None:
        packed_copy.keep(placed, slots.path)
    huge_pages.settle()
    return model


def native_runs(dtype: torch.dtype) -> Callable[[GGUFTensor], bool]:
    """What `weights="native"` runs as stored at `dtype`: a format radixrt's packed kernels run at
    that shape, and Q4_0/Q4_1 anywhere (torch's 4-bit kernel where radixrt's does not run)."""
    return lambda tensor: tensor.type_name in gguf_int4.SUPPORTED_TYPES or _packs([tensor], dtype)


def lookup_runs(dtype: torch.dtype) -> Callable[[GGUFTensor], bool]:
    """Whether an (untied) embedding table is looked up as stored: its format packs at `dtype`."""
    return lambda tensor: _packs([tensor], dtype)


class _Buffer(NamedTuple):
    sizes: list[int]  # the buffer's slots
    path: Path | None  # its packed copy (`packed_copy`); None where copies are off


def _slots(file: GGUFFile, plan: TensorPlan, dtype: torch.dtype) -> _Buffer | None:
    """The slots of the buffer every layer's packed weights go into as they are built, in the
    order a step reads them, then a packed embedding's and a packed head's (which `finish_int4`
    may place last), and where a copy of that buffer is kept (`packed_copy`), where every
    layer runs all four projections in radixrt's kernels; else None (`finish_int4` then places
    what it can after the fact)."""
    if not plan.native or not all(len(layer) == len(PROJECTIONS) for layer in plan.native):
        return None
    projections = [parts for layer in plan.native for parts in layer.values()]
    if not all(_packs(parts, dtype) for parts in projections):
        return None
    slots = [*projections]
    if plan.embedding is not None:
        slots.append([plan.embedding])
    if plan.head is not None and _packs([plan.head], dtype):
        slots.append([plan.head])
    sizes = [_packed_bytes(parts) for parts in slots]
    packed = (str(dtype), [[(part.name, part.type_name) for part in parts] for parts in slots], sizes)
    return _Buffer(sizes, packed_copy.copy_path(file.path.stem, [file.path], packed, cpu.library_name()))


def _packs(parts: list[GGUFTensor], dtype: torch.dtype) -> bool:
    """Whether every part runs in radixrt's packed kernels (its format, whole tiles of rows)."""
    return all(part.type_name in cpu.FORMATS and linear.runs_format(cpu.FORMATS[part.type_name],
                                                                     (part.shape[0], part.shape[1]), dtype)
               for part in parts)  # fmt: skip


def _packed_bytes(parts: list[GGUFTensor]) -> int:
    matmul = cpu.quantized_matmul()
    assert matmul is not None  # `_packs` asked
    return sum(matmul.packed_bytes(cpu.FORMATS[part.type_name], (part.shape[0], part.shape[1])) for part in parts)


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


def _packed(parts: list[GGUFTensor], config: ModelConfig,
            placed: huge_pages.SideBySide | None) -> cpu.PackedWeight:
    """A fused projection's parts (or a single tensor) in the kernels' packed layouts, written into
    the next slot of `placed` (or a buffer of its own) straight from the rows' addresses in the
    mapped file, q/k rows reordered: Q4_0/Q4_1 alone by `pack_gguf.c` in one 4-bit part, else one
    part per run of tensors of one format (`format_matmul.h`)."""
    matmul = cpu.quantized_matmul()
    assert matmul is not None  # `_packs` asked
    num_rows, num_cols = sum(part.shape[0] for part in parts), parts[0].shape[1]
    out = None if placed is None else placed.take(_packed_bytes(parts))
    written = placed is not None and placed.written  # a stored copy: described, not packed again
    addresses = []
    for part in parts:
        order = _row_order(part, config)
        rows = torch.arange(part.shape[0]) if order is None else order
        addresses.append(part.data.ctypes.data + rows * part.data.shape[1])
    if all(part.type_name in gguf_int4.SUPPORTED_TYPES for part in parts):
        kinds = [torch.full((part.shape[0],), int(part.type_name == "Q4_1"), dtype=torch.uint8) for part in parts]
        return matmul.pack_gguf_q4(torch.cat(addresses), torch.cat(kinds), num_cols, out, written)
    runs: list[tuple[int, list[torch.Tensor]]] = []
    for part, rows in zip(parts, addresses):
        format = cpu.FORMATS[part.type_name]
        if runs and runs[-1][0] == format:
            runs[-1][1].append(rows)
        else:
            runs.append((format, [rows]))
    return matmul.pack_format([(format, torch.cat(rows)) for format, rows in runs], num_cols, out, written)


def _head(head: GGUFTensor | None, placed: huge_pages.SideBySide | None, dtype: torch.dtype,
          config: ModelConfig) -> Int4Weight | Int8Weight | cpu.PackedWeight | None:
    """The file's LM head: in a packed layout written by the kernels (into the last slot of
    `placed` where there is one), except Q4_0/Q4_1, kept as codes for `finish_int4` to pack; as
    codes too where the packed kernels do not run it."""
    if head is None:
        return None
    if head.type_name in gguf_int4.SUPPORTED_TYPES or not _packs([head], dtype):
        return gguf_int4.quantized_head(head)
    if head.type_name == "Q8_0":
        matmul = cpu.quantized_matmul()
        assert matmul is not None  # `_packs` asked
        rows = head.data.ctypes.data + torch.arange(head.shape[0]) * head.data.shape[1]
        out = None if placed is None else placed.take(head.shape[0] * head.shape[1] * 17 // 16)
        return matmul.pack_gguf_q8(rows, head.shape[1], out, placed is not None and placed.written)
    return _packed([head], config, placed)


def _int4(parts: list[GGUFTensor], config: ModelConfig) -> Int4Weight:
    weights = []
    for part in parts:
        weight = gguf_int4.int4_weight(part)
        order = _row_order(part, config)
        weights.append(weight if order is None else weight.rows(order))
    return Int4Weight.stack_rows(weights)


def _row_order(tensor: GGUFTensor, config: ModelConfig) -> torch.Tensor | None:
    """The rows that undo llama.cpp's rotary reordering, for a Llama q or k projection."""
    return row_order(tensor.name, config)


def _read_small(destination: torch.Tensor, parts: list[GGUFTensor], config: ModelConfig, shift: float) -> None:
    """`destination` = the parts' values (a norm, a bias: one row each) stacked, q/k biases put back
    in Hugging Face order and the converter's `shift` taken off in float32 (`gguf_families`),
    rounded once to its dtype."""
    import gguf

    values = []
    for part in parts:
        row = torch.from_numpy(np.array(gguf.quants.dequantize(part.data, part.qtype), dtype=np.float32)).view(-1)
        order = row_order(part.name, config)
        values.append(row if order is None else row[order])
    whole = torch.cat(values)
    destination.copy_(whole - shift if shift else whole)


def _names(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:3])} and {len(names) - 3} more"


def _transformers_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"{path}: the tokenizer did not load from the GGUF metadata ({error})") from error

