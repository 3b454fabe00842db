"""A dense model's projections quantized at load (`quantize="q8_0" | "q4_0"`) into the layouts
radixrt's quantized CPU kernels run.

    dense weights (a Hugging Face folder's mapped tensors, or a GGUF file's F32/F16/BF16 ones)
        │ one fused projection at a time, rows as float32, a slice of rows at a time
        ▼
    Q8_0 / Q4_0 blocks of 32 inputs: llama.cpp's reference quantizers (`quantize_row_q8_0_ref`,
        │ `quantize_row_q4_0_ref`), the same float32 operations as `gguf.quants.quantize`
        ▼
    `QuantizedMatmul.pack_int8` / `pack_int4` ─► its slot of one buffer on huge pages, in the
                                                  order a step reads them (`huge_pages.SideBySide`)

Blocks, per row and group of 32 inputs x (w ≈ d q):
    Q8_0  d = max|x| / 127,   q = round_half_away(x / d)          in -127..127
    Q4_0  d = m / -8 (m: the x of largest |x|, sign kept),  q = min(15, trunc(x / d + 8.5))  w = d (q - 8)
d is stored as float16 (the codes are computed with d before that rounding, as llama.cpp does).

The projections then run where a native GGUF's run: 4-bit ones in the layer's C steps and the
whole-step kernel; 8-bit ones one projection at a time through the quantized matmul (the layer's
C steps take 4-bit weights). The LM head is quantized to Q8_0 in both modes, as llama.cpp keeps
the output above Q4_0: a tied 8-bit head is then the embedding too, and the dense table goes.
A projection whose shape the kernel's tiles do not take (rows a multiple of 16, inputs of 32)
stays dense, with one WARNING.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from radixrt.config import QUANTIZE_TYPES
from radixrt.kernels import cpu
from radixrt.memory import huge_pages, packed_copy
from radixrt.model.config import ModelConfig
from radixrt.model.gguf_families import projection_parts, row_order
from radixrt.model.gguf_file import GGUFFile, GGUFTensor
from radixrt.model.gguf_int4 import GROUP_SIZE, Int4Weight, Int8Weight
from radixrt.model.llama import LlamaForCausalLM, checkpoint_projections

logger = logging.getLogger(__name__)

# float32 bytes of rows quantized at a time: the temporaries of a big projection stay small
_CHUNK_BYTES = 4 << 20
# Dense GGUF tensor types a model may be quantized from.
DENSE_TYPES = ("F32", "F16", "BF16")

DenseProjection = Callable[[int, str], torch.Tensor]  # (layer, "qkv" | "o" | "gate_up" | "down") -> [N, K]


def check_quantize(quantize: str | None, weights: str, device: str | torch.device) -> None:
    """ValueError, before anything loads, for a quantize value, or a weights or device it cannot run with."""
    if quantize is None:
        return
    if quantize not in QUANTIZE_TYPES:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_TYPES)} (or None), got {quantize!r}")
    if weights not in ("auto", "dense"):
        raise ValueError(f"quantize={quantize!r} quantizes a dense model; weights={weights!r} runs a quantized "
                         "GGUF as stored: ask for one or the other (weights='auto' with quantize)")
    try:
        device_type = torch.device(device).type
    except (RuntimeError, TypeError):
        device_type = None  # the device check names it
    if device_type not in ("cpu", None):
        raise ValueError(f"quantize={quantize!r} runs on radixrt's quantized CPU kernels; device is {device!r} "
                         "(use device='cpu', or no quantize)")


def check_kernels(quantize: str | None, dtype: torch.dtype) -> None:
    """ValueError unless radixrt's quantized kernels run here in `dtype` (bfloat16, a C compiler)."""
    if quantize is None:
        return
    matmul = cpu.quantized_matmul()
    if dtype != torch.bfloat16 or matmul is None:
        raise ValueError(f"quantize={quantize!r} needs radixrt's quantized kernels: dtype bfloat16 on a CPU with "
                         f"a C compiler; here dtype is {str(dtype).removeprefix('torch.')}"
                         f"{'' if matmul is not None else ' and the kernels are unavailable'}")


def quantize_q8_0(rows: torch.Tensor) -> Int8Weight:
    """[N, K] float rows (K a multiple of 32) as Q8_0 codes and float16-exact scales, equal to
    `gguf.quants.quantize(rows, Q8_0)`'s blocks."""
    blocks = _blocks(rows)
    scales = blocks.abs().amax(-1, keepdim=True) / 127
    scaled = blocks * _inverse(scales)
    magnitude = scaled.abs()
    whole = magnitude.floor()
    # round half away from zero, as gguf's np_roundf: floor(a) + floor(2 (a - floor(a))), signed
    rounded = magnitude.sub_(whole).mul_(2).floor_().add_(whole).mul_(torch.sign(scaled))
    codes = rounded.to(torch.int8).view(rows.shape[0], -1)
    return Int8Weight(codes, _as_stored(scales, rows.shape[0]))


def quantize_q4_0(rows: torch.Tensor) -> Int4Weight:
    """[N, K] float rows (K a multiple of 32) as Q4_0 codes (0..15, w = d (q - 8)) with their
    float16-exact scales d and offsets -8 d, equal to `gguf.quants.quantize(rows, Q4_0)`'s blocks."""
    blocks = _blocks(rows)
    extreme = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))  # the first of largest |x|, sign kept
    scales = extreme / -8
    codes = (blocks * _inverse(scales)).add_(8.5).trunc_().clamp_(0, 15).to(torch.uint8).view(rows.shape[0], -1)
    stored = _as_stored(scales, rows.shape[0])
    return Int4Weight(codes, stored, -8 * stored)


def packed_bytes(bits: int, shape: tuple[int, int]) -> int:
    """Bytes of a [N, K] weight in the kernel's layout: 320 (4-bit) or 544 (8-bit) a tile of 16 x 32."""
    return shape[0] * shape[1] * (5 if bits == 4 else 17) // (8 if bits == 4 else 16)


def pack_quantized(matmul: cpu.QuantizedMatmul, dense: torch.Tensor, bits: int,
                   out: torch.Tensor | None = None) -> cpu.PackedWeight:
    """`dense` [N, K] quantized (Q4_0 or Q8_0) and packed into `out` (its `packed_bytes`; fresh
    memory if None), a slice of whole tiles of rows at a time."""
    num_rows, num_cols = dense.shape
    data = torch.empty(packed_bytes(bits, (num_rows, num_cols)), dtype=torch.uint8) if out is None else out
    data = stored_weight(matmul, data, bits, (num_rows, num_cols)).data
    step = max(1, _CHUNK_BYTES // (4 * num_cols * matmul.TILE_ROWS)) * matmul.TILE_ROWS
    for start in range(0, num_rows, step):
        rows = dense[start : start + step].float()
        if bits == 8:
            codes8 = quantize_q8_0(rows)
            packed = matmul.pack_int8(codes8.codes, codes8.scales)
        else:
            codes4 = quantize_q4_0(rows)
            packed = matmul.pack_int4(codes4.codes, codes4.scales, codes4.offsets)
        data[start // matmul.TILE_ROWS : (start + rows.shape[0]) // matmul.TILE_ROWS].copy_(packed.data)
    return cpu.PackedWeight(data, bits, num_rows)


def stored_weight(matmul: cpu.QuantizedMatmul, data: torch.Tensor, bits: int,
                  shape: tuple[int, int]) -> cpu.PackedWeight:
    """The [N, K] weight whose packed bytes `data` holds (its `packed_bytes`, in the kernel's layout)."""
    tiles, groups = shape[0] // matmul.TILE_ROWS, shape[1] // matmul.GROUP
    return cpu.PackedWeight(data.view(tiles, groups, packed_bytes(bits, (matmul.TILE_ROWS, matmul.GROUP))), bits,
                            shape[0])


def quantize_model(model: LlamaForCausalLM, quantize: str, dense: DenseProjection, head: Callable[[], torch.Tensor],
                   done: Callable[[int, str], None] = lambda layer, name: None,
                   sources: Sequence[Path] = ()) -> None:
    """Give `model` (built with `dense_projections=False`, every other weight loaded, `prepack`ed)
    its projections quantized from `dense`, one at a time (`done(layer, name)` after each: the
    caller may release its source), and a Q8_0 LM head quantized from `head()` [vocab, hidden].
    `sources`: the files the weights are read from; where given, the packed weights are kept on
    disk after the first load and mapped by later ones (`packed_copy`), which then read no
    projection (`dense` and `head` unread)."""
    matmul = cpu.quantized_matmul()
    if matmul is None:
        raise ValueError("quantize needs radixrt's quantized matmul (a C compiler)")
    bits = 8 if quantize == "q8_0" else 4
    layers = model.decoder_layers()
    shapes = [layer.projection_shapes() for layer in layers]
    head_shape = (model.config.vocab_size, model.config.hidden_size)
    runs_head = matmul.supports(head_shape)
    sizes = [packed_bytes(bits, shape) for layer in shapes for shape in layer.values() if matmul.supports(shape)]
    sizes += [packed_bytes(8, head_shape)] if runs_head else []
    copy = _copy_path(sources, quantize, model.dtype, sizes)
    placed = packed_copy.buffer(sizes, copy)
    dense_left: list[str] = []
    with torch.no_grad():
        for index, layer in enumerate(layers):
            packed: dict[str, cpu.PackedWeight] = {}
            for name, shape in shapes[index].items():
                if matmul.supports(shape) and placed.written:
                    packed[name] = stored_weight(matmul, placed.take(packed_bytes(bits, shape)), bits, shape)
                    done(index, name)
                    continue
                weight = _checked(dense(index, name), shape, f"layer {index} {name}")
                if matmul.supports(shape):
                    packed[name] = pack_quantized(matmul, weight, bits, placed.take(packed_bytes(bits, shape)))
                else:
                    layer.set_dense_projection(name, weight.to(model.dtype))
                    dense_left.append(f"layer {index} {name} {shape}")
                del weight
                done(index, name)
            if len(packed) < len(shapes[index]):
                layer.prepack()
            layer.use_int4(packed)
        quantized_head = None
        if runs_head:
            slot = placed.take(packed_bytes(8, head_shape))
            quantized_head = (stored_weight(matmul, slot, 8, head_shape) if placed.written
                              else pack_quantized(matmul, _checked(head(), head_shape, "the LM head"), 8, slot))
        model.finish_int4(quantized_head, quantized_embedding=True, placed=placed)
    packed_copy.keep(placed, copy)
    if dense_left or not runs_head:
        logger.warning("quantize=%s: shapes the quantized kernel's tiles do not take (rows a multiple of 16, inputs "
                       "of 32) stay dense: %s", quantize,
                       ", ".join(dense_left + ([] if runs_head else [f"the LM head {head_shape}"])))
    huge_pages.release_free_heap()
    huge_pages.settle()


def _checked(weight: torch.Tensor, shape: tuple[int, int], name: str) -> torch.Tensor:
    if tuple(weight.shape) != shape:
        raise ValueError(f"{name}: shape {tuple(weight.shape)}, model expects {shape}")
    return weight


def _copy_path(sources: Sequence[Path], quantize: str, dtype: torch.dtype, sizes: list[int]) -> Path | None:
    """Where the packed copy of these sources' weights quantized so lives (`packed_copy`), named
    after the GGUF file or the folder of the weight files."""
    if not sources:
        return None
    name = sources[0].stem if sources[0].suffix == ".gguf" else sources[0].parent.name
    return packed_copy.copy_path(name, sources, (quantize, str(dtype), sizes), cpu.library_name())


def quantize_checkpoint(model: LlamaForCausalLM, weights: Mapping[str, torch.Tensor], config: ModelConfig,
                        quantize: str, sources: Sequence[Path] = ()) -> None:
    """`quantize_model` from a Hugging Face checkpoint's tensors (its projections read as stored:
    one view of the file where a fused projection's parts lie back to back, else concatenated),
    each one's pages of the mapped file dropped once it is quantized (they stay in the page cache)."""
    release = getattr(weights, "release", lambda names: None)
    stacked = getattr(weights, "stacked", None)

    def names(index: int, name: str) -> list[str]:
        return [tensor for tensor, _ in checkpoint_projections(config, index)[name]]

    def projection(index: int, name: str) -> torch.Tensor:
        parts = names(index, name)
        missing = [tensor for tensor in parts if tensor not in weights]
        if missing:
            raise ValueError(f"checkpoint does not match the model: missing {missing}")
        whole = None if stacked is None or len(parts) == 1 else stacked(parts)
        if whole is not None:
            return whole
        return weights[parts[0]] if len(parts) == 1 else torch.cat([weights[tensor] for tensor in parts])

    own_head = "lm_head.weight" in weights and not config.tie_word_embeddings
    head = "lm_head.weight" if own_head else "model.embed_tokens.weight"
    quantize_model(model, quantize, projection, lambda: weights[head], lambda index, name: release(names(index, name)),
                   sources)
    if own_head or model.embed_tokens.numel() == 0:  # the dense head (or embedding) is gone: its rows too
        release([head])


def quantize_gguf(model: LlamaForCausalLM, file: GGUFFile, config: ModelConfig, quantize: str) -> None:
    """`quantize_model` from a dense GGUF file's tensors (`gguf_projection`), each one's pages
    dropped once it is quantized (`GGUFFile.release`)."""

    def parts(index: int, name: str) -> list[GGUFTensor]:
        return [file.tensors[f"blk.{index}.{part}.weight"] for part in projection_parts(config)[name]]

    head = file.tensors["token_embd.weight" if config.tie_word_embeddings else "output.weight"]
    quantize_model(model, quantize, gguf_projection(file, config), lambda: gguf_rows(head),
                   lambda index, name: file.release(parts(index, name)), [file.path])
    file.release([head])


def check_dense_gguf(file: GGUFFile, quantize: str) -> None:
    """ValueError naming `quantize` and the file's types unless its weights are F32, F16 or BF16."""
    quantized = sorted({t.type_name for t in file.tensors.values() if t.type_name not in DENSE_TYPES})
    if quantized:
        example = next(t.name for t in file.tensors.values() if t.type_name == quantized[0])
        raise ValueError(f"quantize={quantize!r} quantizes a dense model ({', '.join(DENSE_TYPES)} tensors); "
                         f"{file.path.name} is already quantized: {', '.join(quantized)} (e.g. {example}); load it "
                         "without quantize (weights='native' runs it as stored)")


def gguf_projection(file: GGUFFile, config: ModelConfig) -> DenseProjection:
    """A dense GGUF file's fused projection, its parts in their stored dtype and a Llama's q/k rows
    put back in Hugging Face order (llama.cpp's converter reorders them for its rotary layout)."""

    def projection(index: int, name: str) -> torch.Tensor:
        parts = []
        for part in projection_parts(config)[name]:
            tensor = gguf_rows(file.tensors[f"blk.{index}.{part}.weight"])
            order = row_order(f"blk.{index}.{part}.weight", config)
            parts.append(tensor if order is None else tensor[order])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    return projection


def gguf_rows(tensor: GGUFTensor) -> torch.Tensor:
    """An F32, F16 or BF16 tensor's values [rows, cols] in that dtype (a copy: the map is read-only)."""
    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[tensor.type_name]
    return torch.from_numpy(np.array(tensor.data)).view(dtype).view(-1, tensor.shape[-1])


def _blocks(rows: torch.Tensor) -> torch.Tensor:
    if rows.shape[-1] % GROUP_SIZE:
        raise ValueError(f"rows of {rows.shape[-1]} inputs do not split into blocks of {GROUP_SIZE}")
    return rows.float().reshape(rows.shape[0], -1, GROUP_SIZE)


def _inverse(scales: torch.Tensor) -> torch.Tensor:
    """1 / d, and 0 where d is 0 (an all-zero block: every code the zero point)."""
    return torch.where(scales == 0, torch.zeros_like(scales), 1.0 / scales)


def _as_stored(scales: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[N, K / 32] float32 scales rounded to float16 as a block stores them."""
    return scales.to(torch.float16).float().view(num_rows, -1)
