"""The whole-step kernels' model handle (`kernels.h`: PackedMatrix, StackLayer, StackModel) as ctypes
structures: built once from the packed weights, its pools and RoPE tables set before each call.

    PackedMatrix   num_parts | num_cols | parts[3]: {format (GGUF type number), num_rows, tiles}
    StackLayer     input_norm | post_norm | qkv | o | gate_up | down      (norms [dim] bf16)
                   | qkv_bias | o_bias | q_norm | k_norm | pre_ff_norm | post_ff_norm   (NULL: absent)
                   | rope (table index) | plan (attention plan index) | scale | softcap
    StackModel     embedding -> PackedMatrix | layers -> StackLayer[n] | pools, shapes
                   | ropes[2] | rotary_dim | plans' windows | head | Gemma's arithmetic, caps

A packed weight's parts lie one after another in its `data` (each part's rows whole tiles of 16),
so a fused projection whose q, k and v the file stores in different formats is one matrix.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from radixrt.kernels.cpu.formats import TYPE_NUMBERS

MATRIX_MAX_PARTS = 3  # MATRIX_MAX_PARTS in kernels.h: a fused qkv's q, k and v
STACK_MAX_PLANS = 2  # STACK_MAX_PLANS in kernels.h: attention plans (windows) of a model's layers
STACK_MAX_ROPES = 2  # STACK_MAX_ROPES in kernels.h: rope tables (Gemma 3: global and local)
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
                ("o", PackedMatrix), ("gate_up", PackedMatrix), ("down", PackedMatrix),
                ("qkv_bias", ctypes.c_void_p), ("o_bias", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("pre_ff_norm", ctypes.c_void_p), ("post_ff_norm", ctypes.c_void_p),
                ("rope", ctypes.c_int), ("plan", ctypes.c_int), ("scale", ctypes.c_float),
                ("softcap", ctypes.c_float)]  # fmt: skip


class RopeTable(ctypes.Structure):
    _fields_ = [("cos", ctypes.c_void_p), ("signed_sin", ctypes.c_void_p), ("rows", ctypes.c_int64)]


class StackModel(ctypes.Structure):
    _fields_ = [
        ("embedding", ctypes.POINTER(PackedMatrix)), ("num_layers", ctypes.c_int),
        ("layers", ctypes.POINTER(StackLayer)), ("k_pools", ctypes.c_void_p), ("v_pools", ctypes.c_void_p),
        ("num_slots", ctypes.c_int64), ("eps", ctypes.c_float),
        ("num_q_heads", ctypes.c_int), ("num_kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int),
        ("dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("num_ropes", ctypes.c_int),
        ("ropes", RopeTable * STACK_MAX_ROPES), ("rotary_dim", ctypes.c_int64), ("num_plans", ctypes.c_int),
        ("windows", ctypes.c_int64 * STACK_MAX_PLANS), ("final_norm", ctypes.c_void_p),
        ("head", ctypes.POINTER(PackedMatrix)), ("balance", ctypes.c_void_p), ("gemma", ctypes.c_int),
        ("embedding_scale", ctypes.c_uint16), ("final_softcap", ctypes.c_float),
    ]  # fmt: skip


class SegmentList(ctypes.Structure):
    _fields_ = [("num_segments", ctypes.c_int), ("starts", ctypes.c_void_p), ("lens", ctypes.c_void_p),
                ("row_ptr", ctypes.c_void_p), ("rows", ctypes.c_void_p)]  # fmt: skip


class LayerWeights(NamedTuple):
    """A layer as the whole-step kernel reads it: its two norms ([dim] bf16) and packed projections,
    and what a family adds to a plain Llama layer (None: absent; see `kernels.h`, StackLayer)."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: PackedWeight
    o: PackedWeight
    gate_up: PackedWeight
    down: PackedWeight
    extras: LayerExtras | None = None


class LayerExtras(NamedTuple):
    """A layer's features beyond a plain Llama layer, as the whole-step kernel takes them: biases
    added to the qkv and o products, per-head q/k RMSNorm weights ([head_dim]), Gemma's norms
    around the MLP, the rope table and attention plan it uses (indices), its softmax scale and
    attention score cap (0: none). Tensors bf16 and contiguous."""

    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    pre_feedforward_norm: torch.Tensor | None = None
    post_feedforward_norm: torch.Tensor | None = None
    rope: int = 0
    plan: int = 0
    scale: float | None = None  # None: head_dim ** -0.5
    softcap: float = 0.0

    @property
    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The layer's added biases and norms (the fields before `rope`), None where absent."""
        return self[:6]


class ModelExtras(NamedTuple):
    """A model's features beyond a plain Llama, as the whole-step kernel takes them: the leading
    dims of each head that rotate (None: all), each attention plan's window (0: full; one plan
    per distinct window of the layers), Gemma's arithmetic (norms by (1 + w), GELU-tanh), the
    embedding scale (a bf16 scalar tensor or None) and the final logit cap (0: none)."""

    rotary_dim: int | None = None
    windows: tuple[int, ...] = (0,)
    gemma: bool = False
    embedding_scale: torch.Tensor | None = None
    final_softcap: float = 0.0


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


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
    """A model's `StackModel`, over weights this object keeps alive; `model` sets a call's pools
    and tables and returns it."""

    def __init__(self, tile_bytes: TileBytes, embedding: PackedWeight | torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor | None, head: PackedWeight | None, eps: float, heads: tuple[int, int, int],
                 intermediate: int, extras: ModelExtras | None = None):
        extras = ModelExtras() if extras is None else extras
        self._keep = (embedding, layers, final_norm)
        self.head = head
        self._embedding = PackedMatrix()
        fill_matrix(self._embedding, embedding, tile_bytes)
        num_q_heads, num_kv_heads, head_dim = heads
        self._layers = (StackLayer * len(layers))()
        for index, layer in enumerate(layers):
            entry = self._layers[index]
            entry.input_norm, entry.post_norm = layer.input_norm.data_ptr(), layer.post_attention_norm.data_ptr()
            for name in ("qkv", "o", "gate_up", "down"):
                fill_matrix(getattr(entry, name), getattr(layer, name), tile_bytes)
            more = LayerExtras() if layer.extras is None else layer.extras
            entry.qkv_bias, entry.o_bias = _address(more.qkv_bias), _address(more.o_bias)
            entry.q_norm, entry.k_norm = _address(more.q_norm), _address(more.k_norm)
            entry.pre_ff_norm = _address(more.pre_feedforward_norm)
            entry.post_ff_norm = _address(more.post_feedforward_norm)
            entry.rope, entry.plan, entry.softcap = more.rope, more.plan, more.softcap
            entry.scale = head_dim**-0.5 if more.scale is None else more.scale
        self.num_ropes = 1 + max((0 if layer.extras is None else layer.extras.rope for layer in layers), default=0)
        self._head = None if head is None else PackedMatrix()
        if head is not None and self._head is not None:
            fill_matrix(self._head, head, tile_bytes)
        windows = (ctypes.c_int64 * STACK_MAX_PLANS)(*extras.windows)
        scale = extras.embedding_scale
        scale_bits = 0 if scale is None else int(scale.to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF
        self.struct = StackModel(
            embedding=ctypes.pointer(self._embedding), num_layers=len(layers), layers=self._layers, eps=eps,
            num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dim=self._embedding.num_cols,
            intermediate=intermediate, num_ropes=self.num_ropes,
            rotary_dim=head_dim if extras.rotary_dim is None else extras.rotary_dim,
            num_plans=len(extras.windows), windows=windows, final_norm=_address(final_norm),
            head=None if self._head is None else ctypes.pointer(self._head), gemma=int(extras.gemma),
            embedding_scale=scale_bits, final_softcap=extras.final_softcap,
        )  # fmt: skip
        self.vocab_rows = sum(self._embedding.parts[p].num_rows for p in range(self._embedding.num_parts))

    def layer_addresses(self, index: int) -> list[int]:
        """Layer `index`'s norm and first-part tile addresses (input norm, qkv, o, post norm, gate_up, down)."""
        layer = self._layers[index]
        return [layer.input_norm, layer.qkv.parts[0].tiles, layer.o.parts[0].tiles, layer.post_norm,
                layer.gate_up.parts[0].tiles, layer.down.parts[0].tiles]  # fmt: skip

    def model(self, k_pools: torch.Tensor, v_pools: torch.Tensor, num_slots: int,
              rope_tables: Sequence[tuple[torch.Tensor, torch.Tensor]], balance: int) -> StackModel:
        """The handle with these pools and rope tables (one (cos, signed_sin) [P, rotary_dim] pair
        for each table the layers name, in order) and the product balance."""
        if len(rope_tables) != self.num_ropes:
            raise ValueError(f"the layers rotate with {self.num_ropes} rope tables, got {len(rope_tables)}")
        model = self.struct
        model.balance = balance
        model.k_pools, model.v_pools = k_pools.data_ptr(), v_pools.data_ptr()
        model.num_slots = num_slots
        for index, (cos, signed_sin) in enumerate(rope_tables):
            model.ropes[index] = RopeTable(cos.data_ptr(), signed_sin.data_ptr(), cos.shape[0])
        return model
