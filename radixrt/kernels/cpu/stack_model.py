"""The whole-step kernels' model handle (`kernels.h`: PackedMatrix, StackLayer, StackModel) as ctypes
structures: built once from the packed weights, its pools and RoPE tables set before each call.

    PackedMatrix   num_parts | num_cols | parts[3]: {format (GGUF type number), num_rows, tiles}
    StackLayer     input_norm | post_norm | qkv | o | gate_up | down      (norms [dim] bf16)
    StackModel     embedding -> PackedMatrix | layers -> StackLayer[n] | pools, shapes, tables | head

A packed weight's parts lie one after another in its `data` (each part's rows whole tiles of 16),
so a fused projection whose q, k and v the file stores in different formats is one matrix.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple, Protocol

import torch

from radixrt.kernels.cpu.formats import TYPE_NUMBERS

MATRIX_MAX_PARTS = 3  # MATRIX_MAX_PARTS in kernels.h: a fused qkv's q, k and v
# GGUF type numbers (formats.h)
FORMAT_BF16 = 30
FORMAT_Q4_1 = 3
FORMAT_Q8_0 = 8
FORMATS = TYPE_NUMBERS  # every format in the table, by name


class PackedPart(NamedTuple):
    """A run of a packed weight's rows stored in one format (a multiple of 16 rows)."""

    format: int  # GGUF type number
    num_rows: int


class PackedWeight(Protocol):
    """What a packed weight offers here (`cpu.PackedWeight`): its bytes, parts and width."""

    @property
    def data(self) -> torch.Tensor: ...

    @property
    def num_rows(self) -> int: ...

    def layout(self) -> tuple[PackedPart, ...]: ...

    def columns(self) -> int: ...


class MatrixPart(ctypes.Structure):
    _fields_ = [("format", ctypes.c_int), ("num_rows", ctypes.c_int64), ("tiles", ctypes.c_void_p)]


class PackedMatrix(ctypes.Structure):
    _fields_ = [("num_parts", ctypes.c_int), ("num_cols", ctypes.c_int64), ("parts", MatrixPart * MATRIX_MAX_PARTS)]


class StackLayer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", PackedMatrix),
                ("o", PackedMatrix), ("gate_up", PackedMatrix), ("down", PackedMatrix)]  # fmt: skip


class StackModel(ctypes.Structure):
    _fields_ = [
        ("embedding", ctypes.POINTER(PackedMatrix)), ("num_layers", ctypes.c_int),
        ("layers", ctypes.POINTER(StackLayer)), ("k_pools", ctypes.c_void_p), ("v_pools", ctypes.c_void_p),
        ("num_slots", ctypes.c_int64), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("num_q_heads", ctypes.c_int), ("num_kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int),
        ("dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("cos", ctypes.c_void_p),
        ("signed_sin", ctypes.c_void_p), ("table_rows", ctypes.c_int64), ("final_norm", ctypes.c_void_p),
        ("head", ctypes.POINTER(PackedMatrix)), ("balance", ctypes.c_void_p),
    ]  # fmt: skip


class LayerWeights(NamedTuple):
    """A layer as the whole-step kernel reads it: its two norms ([dim] bf16) and packed projections."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: PackedWeight
    o: PackedWeight
    gate_up: PackedWeight
    down: PackedWeight


def fill_matrix(matrix: PackedMatrix, weight: PackedWeight | torch.Tensor, tile_bytes: TileBytes) -> None:
    """`matrix` describing `weight`: a packed weight's parts, or a dense [rows, cols] bf16 table."""
    if isinstance(weight, torch.Tensor):
        matrix.num_parts, matrix.num_cols = 1, weight.shape[1]
        matrix.parts[0] = MatrixPart(FORMAT_BF16, weight.shape[0], weight.data_ptr())
        return
    num_cols = weight.columns()
    parts = weight.layout()
    if len(parts) > MATRIX_MAX_PARTS:
        raise ValueError(f"a packed weight has {len(parts)} parts, the kernels take at most {MATRIX_MAX_PARTS}")
    matrix.num_parts, matrix.num_cols = len(parts), num_cols
    at = weight.data.data_ptr()
    for index, part in enumerate(parts):
        matrix.parts[index] = MatrixPart(part.format, part.num_rows, at)
        at += part.num_rows // 16 * tile_bytes(part.format, num_cols)


class TileBytes:
    """`radixrt_format_tile_bytes`: the bytes of one tile of 16 rows of a format (0: no packed layout)."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = library.radixrt_format_tile_bytes
        self._fn.argtypes = [ctypes.c_int, ctypes.c_int64]
        self._fn.restype = ctypes.c_int64

    def __call__(self, format: int, num_cols: int) -> int:
        return int(self._fn(format, num_cols))


class StackWeights:
    """A model's `StackModel`, over weights this object keeps alive; `model` sets a call's pools,
    tables and scale and returns it."""

    def __init__(self, tile_bytes: TileBytes, embedding: PackedWeight | torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor | None, head: PackedWeight | None, eps: float, heads: tuple[int, int, int],
                 intermediate: int):
        self._keep = (embedding, layers, final_norm)
        self.head = head
        self._embedding = PackedMatrix()
        fill_matrix(self._embedding, embedding, tile_bytes)
        self._layers = (StackLayer * len(layers))()
        for index, layer in enumerate(layers):
            entry = self._layers[index]
            entry.input_norm, entry.post_norm = layer.input_norm.data_ptr(), layer.post_attention_norm.data_ptr()
            for name in ("qkv", "o", "gate_up", "down"):
                fill_matrix(getattr(entry, name), getattr(layer, name), tile_bytes)
        self._head = None if head is None else PackedMatrix()
        if head is not None and self._head is not None:
            fill_matrix(self._head, head, tile_bytes)
        num_q_heads, num_kv_heads, head_dim = heads
        self.struct = StackModel(
            ctypes.pointer(self._embedding), len(layers), self._layers, None, None, 0, eps, 0.0, num_q_heads,
            num_kv_heads, head_dim, self._embedding.num_cols, intermediate, None, None, 0,
            None if final_norm is None else final_norm.data_ptr(),
            None if self._head is None else ctypes.pointer(self._head), None,
        )  # fmt: skip
        self.vocab_rows = sum(self._embedding.parts[p].num_rows for p in range(self._embedding.num_parts))

    def layer_addresses(self, index: int) -> list[int]:
        """Layer `index`'s norm and first-part tile addresses (input norm, qkv, o, post norm, gate_up, down)."""
        layer = self._layers[index]
        return [layer.input_norm, layer.qkv.parts[0].tiles, layer.o.parts[0].tiles, layer.post_norm,
                layer.gate_up.parts[0].tiles, layer.down.parts[0].tiles]  # fmt: skip

    def model(self, k_pools: torch.Tensor, v_pools: torch.Tensor, num_slots: int, scale: float,
              rope_tables: tuple[torch.Tensor, torch.Tensor], balance: int) -> StackModel:
        cos, signed_sin = rope_tables
        model = self.struct
        model.balance = balance
        model.k_pools, model.v_pools = k_pools.data_ptr(), v_pools.data_ptr()
        model.num_slots, model.scale = num_slots, scale
        model.cos, model.signed_sin, model.table_rows = cos.data_ptr(), signed_sin.data_ptr(), cos.shape[0]
        return model
