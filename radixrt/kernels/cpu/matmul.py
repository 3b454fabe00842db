"""Products by weights: quantized ones in radixrt's packed layouts (quantized_matmul*.c, the
formats' products and packers) and the batch-invariant dense matmul (rowwise_matmul*.c)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch

from radixrt.kernels.cpu.library import call_threads, load_library
from radixrt.kernels.cpu.stack_model import FORMAT_Q4_1, FORMAT_Q8_0, PackedMatrix, PackedPart, TileBytes, fill_matrix


class PackedWeight(NamedTuple):
    """A weight in a packed layout: `QuantizedMatmul`'s own 4- or 8-bit one (`bits`), or the
    formats' layouts (`format_matmul.h`), its rows in `parts` of one format each, lying one after
    another in `data` (`stack_model`)."""

    data: torch.Tensor  # uint8
    bits: int  # 4 or 8: one part in quantized_matmul.c's own layout; 0: `parts` say
    num_rows: int
    parts: tuple[PackedPart, ...] = ()
    num_cols: int = 0  # with `parts` (the own layouts: [tiles, groups, bytes] data says)

    def layout(self) -> tuple[PackedPart, ...]:
        """The parts' formats (GGUF type numbers) and rows; the own 4-bit layout reads Q4_0 and
        Q4_1 alike (an offset per group), so it is Q4_1's."""
        return self.parts or (PackedPart(FORMAT_Q8_0 if self.bits == 8 else FORMAT_Q4_1, self.num_rows),)

    def columns(self) -> int:
        return self.num_cols if self.parts else int(self.data.shape[1]) * QuantizedMatmul.GROUP


class QuantizedMatmul:
    """`radixrt_quantized_matmul_bf16`: bf16 rows times a 4- or 8-bit GGUF weight (`pack_int4`, `pack_int8`)."""

    TILE_ROWS = 16
    GROUP = 32

    def __init__(self, library: ctypes.CDLL):
        self._fn = library.radixrt_quantized_matmul_bf16
        pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._fn.argtypes = [
            pointer, i64, i64,  # x, x_row_stride, rows
            pointer, i32, i64, i64,  # packed weight, bits, N, K
            pointer, pointer, i32,  # out fp32, out bf16, num_threads
        ]
        self._fn.restype = i32
        self._pack_gguf = library.radixrt_pack_gguf_q4_rows
        self._pack_gguf.argtypes = [pointer, pointer, i64, i64, pointer, i32]  # rows, kinds, N, K, out, threads
        self._pack_gguf.restype = i32
        self._pack_gguf_q8 = library.radixrt_pack_gguf_q8_rows
        self._pack_gguf_q8.argtypes = [pointer, i64, i64, pointer, i32]  # rows, N, K, out, threads
        self._pack_gguf_q8.restype = i32
        self._pack_format = library.radixrt_pack_format_rows
        self._pack_format.argtypes = [i32, pointer, i64, i64, pointer, i32]  # format, rows, N, K, out, threads
        self._pack_format.restype = i32
        self._matrix_fn = library.radixrt_matrix_matmul_bf16
        # x, stride, M, matrix, out, out bf16, threads
        self._matrix_fn.argtypes = [pointer, i64, i64, pointer, pointer, pointer, i32]
        self._matrix_fn.restype = i32
        self._gather_fn = library.radixrt_matrix_gather_bf16
        self._gather_fn.argtypes = [pointer, pointer, i64, pointer]  # w, ids, n, out
        self._gather_fn.restype = i32
        self._dequantize_fn = library.radixrt_matrix_dequantize_bf16
        self._dequantize_fn.argtypes = [pointer, pointer, i32]  # w, out, threads
        self._dequantize_fn.restype = i32
        self.tile_bytes = TileBytes(library)
        self._matrices: dict[tuple[int, tuple[PackedPart, ...], int], PackedMatrix] = {}

    def format_runs(self, format: int, shape: tuple[int, int]) -> bool:
        """Whether a [N, K] weight of `format` (a GGUF type number) has a packed layout here: whole
        tiles of 16 rows of a format with a kernel."""
        return shape[0] % self.TILE_ROWS == 0 and self.tile_bytes(format, shape[1]) > 0

    def packed_bytes(self, format: int, shape: tuple[int, int]) -> int:
        """The bytes a [N, K] weight of `format` takes packed (`format_runs` first)."""
        return shape[0] // self.TILE_ROWS * self.tile_bytes(format, shape[1])

    def pack_format(self, parts: Sequence[tuple[int, torch.Tensor]], num_cols: int,
                    out: torch.Tensor | None = None, written: bool = False) -> PackedWeight:
        """Rows of GGUF blocks in the formats' packed layouts, straight from the blocks: `parts`, each
        (format, [n] int64 addresses of its rows' blocks, kept alive by the caller), lie one after
        another in `out` (or a new buffer) as one weight. `written`: `out` holds them packed
        already (a stored copy, `packed_copy`): it is described, not written."""
        sizes = [self.packed_bytes(format, (rows.numel(), num_cols)) for format, rows in parts]
        for (format, rows), size in zip(parts, sizes):
            if size <= 0:
                raise ValueError(f"format {format} has no packed layout for ({rows.numel()}, {num_cols}) rows: "
                                 f"rows must be whole tiles of {self.TILE_ROWS}")
        data = torch.empty(sum(sizes), dtype=torch.uint8) if out is None else out
        if data.numel() != sum(sizes) or not data.is_contiguous() or data.dtype != torch.uint8:
            raise ValueError(f"out must be {sum(sizes)} contiguous bytes")
        at = 0
        for (format, rows), size in zip(parts, sizes):
            if not written:
                self._pack_rows(format, rows, num_cols, data[at:])
            at += size
        layout = tuple(PackedPart(format, rows.numel()) for format, rows in parts)
        return PackedWeight(data, 0, sum(part.num_rows for part in layout), layout, num_cols)

    def _pack_rows(self, format: int, rows: torch.Tensor, num_cols: int, out: torch.Tensor) -> None:
        rows = rows.to(torch.int64).contiguous()
        status = self._pack_format(format, rows.data_ptr(), rows.numel(), num_cols, out.data_ptr(), call_threads())
        if status:
            raise ValueError(f"pack_format_rows refused format {format} rows ({rows.numel()}, {num_cols}) "
                             f"(status {status})")

    def matrix(self, weight: PackedWeight) -> PackedMatrix:
        """The kernels' description of `weight` (`stack_model.PackedMatrix`; the caller keeps the
        weight alive). A description depends on the address, layout and width alone, so one made
        for an equal key is reused: a layer's step asks for its four at every call."""
        key = (weight.data.data_ptr(), weight.layout(), weight.columns())
        matrix = self._matrices.get(key)
        if matrix is None:
            if len(self._matrices) >= 4096:
                self._matrices.clear()
            matrix = self._matrices[key] = PackedMatrix()
            fill_matrix(matrix, weight, self.tile_bytes)
        return matrix

    def rows(self, weight: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` ([n] int64) of a packed weight as bf16 [n, K], each weight rounded once from its
        exact value: what the whole-step kernels look an embedding row up as."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), weight.columns(), dtype=torch.bfloat16)
        if self._gather_fn(ctypes.byref(self.matrix(weight)), ids.data_ptr(), ids.numel(), out.data_ptr()):
            raise IndexError(f"a token id outside the embedding's rows 0 .. {weight.num_rows - 1}")
        return out

    def dequantize(self, weight: PackedWeight, out: torch.Tensor) -> torch.Tensor:
        """The whole weight as bf16 into `out` (at least N * K contiguous bf16 elements), each value
        rounded once from its exact one; returned as [N, K]."""
        num_cols = weight.columns()
        size = weight.num_rows * num_cols
        if out.dtype != torch.bfloat16 or not out.is_contiguous() or out.numel() < size:
            raise ValueError(f"out must hold {size} contiguous bf16 elements")
        if self._dequantize_fn(ctypes.byref(self.matrix(weight)), out.data_ptr(), call_threads()):
            raise ValueError(f"the dequantizer refused a weight of parts {weight.layout()}")
        return out.view(-1)[:size].view(weight.num_rows, num_cols)

    def supports(self, shape: tuple[int, int]) -> bool:
        """Whether a [N, K] weight fits the layout: N a multiple of 16 rows, K of 32 inputs."""
        return shape[0] % self.TILE_ROWS == 0 and shape[1] % self.GROUP == 0

    def pack_int4(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> PackedWeight:
        """w = codes * scales + offsets (codes [N, K] uint8 in 0..15; scales, offsets [N, K // 32],
        exact in fp16 as GGUF stores them) in the kernel's layout: see quantized_matmul.c."""
        tiles, groups = self._tiles(codes)
        # k = 32 g + 4 c + 2 h + e; chunk c holds (row, e) pairs, nibble h
        nibbles = codes.reshape(tiles, self.TILE_ROWS, groups, 8, 2, 2).permute(0, 2, 3, 1, 5, 4)
        chunks = (nibbles[..., 0] | (nibbles[..., 1] << 4)).reshape(tiles, groups, -1)
        blocks = torch.cat([chunks, self._fp16_rows(scales, tiles, groups), self._fp16_rows(offsets, tiles, groups)], -1)
        return PackedWeight(blocks.contiguous(), 4, codes.shape[0])

    def pack_gguf_q4(self, rows: torch.Tensor, kinds: torch.Tensor, num_cols: int,
                     out: torch.Tensor | None = None, written: bool = False) -> PackedWeight:
        """GGUF Q4_0/Q4_1 rows in the 4-bit layout, straight from their blocks (`pack_gguf.c`): what
        `pack_int4` makes of the same codes, scales and offsets, in one pass. `rows` [N] int64: the
        address of each row's blocks (the caller keeps them alive); `kinds` [N] uint8: 0 for Q4_0,
        1 for Q4_1; `out`: N * K * 5 / 8 bytes to write into (a slot of the weights' buffer), or
        holding them packed already where `written` (as `pack_format`)."""
        num_rows = rows.numel()
        tiles, groups = self._tiles_of(num_rows, num_cols)
        data = torch.empty(tiles * groups * 320, dtype=torch.uint8) if out is None else out
        if data.numel() != tiles * groups * 320 or not data.is_contiguous() or data.dtype != torch.uint8:
            raise ValueError(f"out must be {tiles * groups * 320} contiguous bytes")
        if written:
            return PackedWeight(data.view(tiles, groups, 320), 4, num_rows)
        rows, kinds = rows.to(torch.int64).contiguous(), kinds.to(torch.uint8).contiguous()
        status = self._pack_gguf(rows.data_ptr(), kinds.data_ptr(), num_rows, num_cols, data.data_ptr(), call_threads())
        if status == -1:
            raise ValueError("a Q4_0 block's offset (-8 times its scale) does not fit in float16")
        if status:
            raise ValueError(f"pack_gguf_q4: rows must be Q4_0 or Q4_1 and the shape whole tiles, got ({num_rows}, "
                             f"{num_cols})")
        return PackedWeight(data.view(tiles, groups, 320), 4, num_rows)

    def pack_gguf_q8(self, rows: torch.Tensor, num_cols: int, out: torch.Tensor | None = None,
                     written: bool = False) -> PackedWeight:
        """GGUF Q8_0 rows in the 8-bit layout straight from their blocks (`pack_gguf.c`): what
        `pack_int8` makes of the same codes and scales. `rows` [N] int64 addresses (kept alive by
        the caller); `out`: N * K * 17 / 16 bytes to write into, or holding them packed already
        where `written` (as `pack_format`)."""
        num_rows = rows.numel()
        tiles, groups = self._tiles_of(num_rows, num_cols)
        data = torch.empty(tiles * groups * 544, dtype=torch.uint8) if out is None else out
        if data.numel() != tiles * groups * 544 or not data.is_contiguous() or data.dtype != torch.uint8:
            raise ValueError(f"out must be {tiles * groups * 544} contiguous bytes")
        rows = rows.to(torch.int64).contiguous()
        if not written and self._pack_gguf_q8(rows.data_ptr(), num_rows, num_cols, data.data_ptr(), call_threads()):
            raise ValueError(f"pack_gguf_q8: the shape must be whole tiles, got ({num_rows}, {num_cols})")
        return PackedWeight(data.view(tiles, groups, 544), 8, num_rows)

    def pack_int8(self, codes: torch.Tensor, scales: torch.Tensor) -> PackedWeight:
        """w = codes * scales (codes [N, K] int8; scales [N, K // 32], exact in fp16) in the kernel's layout."""
        tiles, groups = self._tiles(codes)
        # k = 32 g + 4 c + j: vector c holds (row, j) bytes, stored unsigned as q + 128
        unsigned = (codes.view(torch.uint8) ^ 0x80).reshape(tiles, self.TILE_ROWS, groups, 8, 4).permute(0, 2, 3, 1, 4)
        blocks = torch.cat([unsigned.reshape(tiles, groups, -1), self._fp16_rows(scales, tiles, groups)], -1)
        return PackedWeight(blocks.contiguous(), 8, codes.shape[0])

    def _tiles(self, codes: torch.Tensor) -> tuple[int, int]:
        return self._tiles_of(*codes.shape)

    def _tiles_of(self, num_rows: int, num_cols: int) -> tuple[int, int]:
        if not self.supports((num_rows, num_cols)):
            raise ValueError(f"weight shape {(num_rows, num_cols)}: rows must be a multiple of 16, columns of 32")
        return num_rows // self.TILE_ROWS, num_cols // self.GROUP

    def _fp16_rows(self, values: torch.Tensor, tiles: int, groups: int) -> torch.Tensor:
        half = values.to(torch.float16)
        if not torch.equal(half.float(), values.float()):
            raise ValueError("quantized scales and offsets must be exact in float16 (GGUF stores them so)")
        return half.reshape(tiles, self.TILE_ROWS, groups).permute(0, 2, 1).contiguous().view(torch.uint8)

    def __call__(self, x: torch.Tensor, weight: PackedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ w.T` for bf16 rows `x` [M, K] (unit stride along K): bf16 [M, N], or written to
        the fp32 tensor `out` [M, N], contiguous, and returned."""
        rows, num_cols = x.shape
        if out is None:
            result = torch.empty(rows, weight.num_rows, dtype=torch.bfloat16)
            out_f32, out_bf16 = 0, result.data_ptr()
        else:
            result, out_f32, out_bf16 = out, out.data_ptr(), 0
        if weight.parts:
            status = self._matrix_fn(x.data_ptr(), x.stride(0), rows, ctypes.byref(self.matrix(weight)), out_f32,
                                     out_bf16, call_threads())
            if status == -2:
                raise ValueError(f"the quantized matmul refused a weight of parts {weight.parts}")
            if status:
                raise MemoryError("quantized matmul kernel could not allocate its scratch")
            return result
        status = self._fn(x.data_ptr(), x.stride(0), rows, weight.data.data_ptr(), weight.bits, weight.num_rows,
                          num_cols, out_f32, out_bf16, call_threads())
        if status:
            raise MemoryError("quantized matmul kernel could not allocate its row sums")
        return result


class RowwiseMatmul:
    """`rowwise_matmul.c`: `x @ w.T (+ bias)` for a dense bf16 or float32 weight, each output
    rounded the same whatever else is in the batch."""

    def __init__(self, library: ctypes.CDLL):
        pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._bf16 = library.radixrt_rowwise_matmul_bf16
        self._bf16.argtypes = [pointer, i64, i64, i64, pointer, i64, pointer, pointer, i32, i32]
        self._bf16.restype = None
        self._f32 = library.radixrt_rowwise_matmul_f32
        self._f32.argtypes = [pointer, i64, i64, i64, pointer, i64, pointer, pointer, i32]
        self._f32.restype = None

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in (torch.bfloat16, torch.float32)

    def check_weight(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """ValueError unless `weight` [N, K] and `bias` [N] are contiguous, bf16 or float32, of one dtype."""
        if weight.dim() != 2 or not self.supports(weight.dtype) or (bias is not None and bias.dtype != weight.dtype):
            raise ValueError(f"rowwise matmul: weight {tuple(weight.shape)} {weight.dtype}: need [N, K] of one "
                             "dtype with its bias, bfloat16 or float32")
        if not weight.is_contiguous() or (bias is not None and not bias.is_contiguous()):
            raise ValueError("rowwise matmul: weight and bias must be contiguous")

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, float_out: bool = False
    ) -> torch.Tensor:
        """[M, N]: rows `x` [M, K] (unit stride along K) times `weight` [N, K] (contiguous) and
        `bias` [N], all of one dtype; in that dtype, or float32 with `float_out`."""
        if x.dim() != 2 or x.shape[1] != weight.shape[1] or x.dtype != weight.dtype:
            raise ValueError(f"rowwise matmul: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
                             f"{weight.dtype}: need [M, K] and [N, K] of one dtype, bfloat16 or float32")
        if x.stride(1) != 1:
            raise ValueError("rowwise matmul: x needs unit stride along K, weight and bias contiguous")
        self.check_weight(weight, bias)
        return self.multiply(x, weight, bias, float_out)

    def multiply(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, float_out: bool = False
    ) -> torch.Tensor:
        """`__call__` without its checks, for a caller that made them (`linear.rowwise`: the weight
        once, the rows by construction): the kernel trusts its arguments."""
        rows, num_cols = x.shape
        num_out = weight.shape[0]
        bias_ptr = 0 if bias is None else bias.data_ptr()
        if weight.dtype == torch.float32:
            out = torch.empty(rows, num_out, dtype=torch.float32)
            self._f32(x.data_ptr(), x.stride(0), rows, num_cols, weight.data_ptr(), num_out, bias_ptr,
                      out.data_ptr(), call_threads())
            return out
        out = torch.empty(rows, num_out, dtype=torch.float32 if float_out else torch.bfloat16)
        self._bf16(x.data_ptr(), x.stride(0), rows, num_cols, weight.data_ptr(), num_out, bias_ptr, out.data_ptr(),
                   int(float_out), call_threads())
        return out


def quantized_matmul() -> QuantizedMatmul | None:
    """The compiled 4/8-bit matmul (at the level in use: `isa()`); None where it cannot be built."""
    library = load_library()
    return None if library is None or not library.radixrt_quantized_matmul_available() else QuantizedMatmul(library)


def rowwise_matmul() -> RowwiseMatmul | None:
    """The compiled batch-invariant dense matmul (at the level in use: `isa()`); None where the
    kernels cannot be built."""
    library = load_library()
    return None if library is None or not library.radixrt_rowwise_matmul_available() else RowwiseMatmul(library)
