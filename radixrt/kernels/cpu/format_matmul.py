"""Every GGUF weight format the CPU kernels run natively, behind one product API (format_matmul.h),
and the reference dequantizer of every format in the table (formats.c).

`FormatMatmul.pack` repacks a weight's file rows into tiles of 16 rows at load; calling it
multiplies bf16 rows by the packed weight; `dequantize` gives rows of it back as bf16 (for steps
with enough rows to multiply densely). Q4_0/Q4_1/Q8_0 use `QuantizedMatmul`'s layouts, the
K-quants and Q5_0/Q5_1 format_layout.h's.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from radixrt.kernels.cpu.library import call_threads, load_library
from radixrt.kernels.cpu.formats import FORMATS as TABLE
from radixrt.kernels.cpu.formats import BLOCKS, PACKED, TYPE_NUMBERS, WeightFormat

# GGUF's type numbers of the packed formats, and their blocks: (elements, bytes)
FORMATS: dict[str, int] = {name: TYPE_NUMBERS[name] for name in PACKED}
TILE_ROWS = 16


class FormatWeight(NamedTuple):
    """A weight packed for `FormatMatmul`: `data` uint8 [num_rows / 16, tile bytes]."""

    data: torch.Tensor
    format: int  # GGUF's type number
    num_rows: int
    num_cols: int


class FormatMatmul:
    """`radixrt_format_matmul_*`: bf16 rows times a weight of any native GGUF format."""

    def __init__(self, library: ctypes.CDLL):
        pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._tile_bytes = library.radixrt_format_tile_bytes
        self._tile_bytes.argtypes, self._tile_bytes.restype = [i32, i64], i64
        self._pack = library.radixrt_pack_format_rows
        self._pack.argtypes, self._pack.restype = [i32, pointer, i64, i64, pointer, i32], i32  # rows, N, K, out
        self._matmul = library.radixrt_format_matmul_bf16
        self._matmul.argtypes = [
            i32, i32, pointer, i64, i64,  # format, portable, x, x_row_stride, rows
            pointer, i64, i64, pointer, pointer, i32,  # tiles, N, K, out fp32, out bf16, num_threads
        ]
        self._matmul.restype = i32
        self._dequantize = {}
        for portable, name in ((False, ""), (True, "_portable")):
            function = getattr(library, f"radixrt_format_dequantize_tiles_bf16{name}")
            function.argtypes = [i32, pointer, i64, i64, i64, pointer]  # format, tiles, K, first, last, out
            function.restype = None
            self._dequantize[portable] = function

    def tile_bytes(self, format: int, num_cols: int) -> int:
        """Bytes of one packed tile of 16 rows; 0 for an unknown format or K not whole blocks."""
        return int(self._tile_bytes(format, num_cols))

    def pack(self, format: int, rows: torch.Tensor, num_cols: int, out: torch.Tensor | None = None) -> FormatWeight:
        """The file rows at the addresses `rows` ([N] int64; the caller keeps them alive) packed:
        N a multiple of 16, `num_cols` of the format's block. `out`: the packed bytes to write into."""
        num_rows = rows.numel()
        if format not in BLOCKS:
            raise ValueError(f"format must be one of GGUF's types {sorted(BLOCKS)}, got {format}")
        if num_rows % TILE_ROWS or num_cols <= 0 or num_cols % BLOCKS[format][0]:
            raise ValueError(f"weight shape ({num_rows}, {num_cols}): rows must be a multiple of {TILE_ROWS}, "
                             f"columns of {BLOCKS[format][0]}")
        tile_bytes = self.tile_bytes(format, num_cols)
        size = num_rows // TILE_ROWS * tile_bytes
        data = torch.empty(size, dtype=torch.uint8) if out is None else out
        if data.numel() != size or not data.is_contiguous() or data.dtype != torch.uint8:
            raise ValueError(f"out must be {size} contiguous bytes")
        rows = rows.to(torch.int64).contiguous()
        status = self._pack(format, rows.data_ptr(), num_rows, num_cols, data.data_ptr(), call_threads())
        if status == -1:
            raise ValueError("a Q4_0 block's offset (-8 times its scale) does not fit in float16")
        if status == -3:
            raise MemoryError("packing could not allocate")
        if status:
            raise ValueError(f"format {format} with shape ({num_rows}, {num_cols}) has no packed layout")
        return FormatWeight(data.view(num_rows // TILE_ROWS, tile_bytes), format, num_rows, num_cols)

    def pack_blocks(self, format: int, blocks: torch.Tensor) -> FormatWeight:
        """A weight's file bytes [N, row bytes] (uint8, rows contiguous) packed."""
        elements, block_bytes = BLOCKS[format]
        num_cols = blocks.shape[1] // block_bytes * elements
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % block_bytes or blocks.stride(1) != 1:
            raise ValueError(f"blocks must be uint8 [N, a multiple of {block_bytes}] with contiguous rows")
        addresses = blocks.data_ptr() + torch.arange(blocks.shape[0], dtype=torch.int64) * blocks.stride(0)
        return self.pack(format, addresses, num_cols)

    def __call__(self, x: torch.Tensor, weight: FormatWeight, out: torch.Tensor | None = None,
                 portable: bool = False) -> torch.Tensor:
        """`x @ w.T` for bf16 rows `x` [M, K] (unit stride along K): bf16 [M, N], or written to the
        fp32 tensor `out` [M, N], contiguous, and returned. `portable`: the plain-C kernel."""
        rows, num_cols = x.shape
        if x.dtype != torch.bfloat16 or x.stride(1) != 1 or num_cols != weight.num_cols:
            raise ValueError(f"x must be bf16 [M, {weight.num_cols}] with unit stride along K")
        if out is None:
            result = torch.empty(rows, weight.num_rows, dtype=torch.bfloat16)
            out_f32, out_bf16 = 0, result.data_ptr()
        else:
            if out.dtype != torch.float32 or out.shape != (rows, weight.num_rows) or not out.is_contiguous():
                raise ValueError(f"out must be a contiguous float32 [{rows}, {weight.num_rows}]")
            result, out_f32, out_bf16 = out, out.data_ptr(), 0
        status = self._matmul(weight.format, int(portable), x.data_ptr(), x.stride(0), rows, weight.data.data_ptr(),
                              weight.num_rows, num_cols, out_f32, out_bf16, call_threads())
        if status == -1:
            raise MemoryError("format matmul kernel could not allocate its scratch")
        if status:
            raise ValueError(f"format {weight.format} with shape ({weight.num_rows}, {num_cols}) has no kernel")
        return result

    def dequantize(self, weight: FormatWeight, first_row: int = 0, last_row: int | None = None,
                   portable: bool = False) -> torch.Tensor:
        """Rows [first_row, last_row) of the packed weight as bf16 [rows, K] (gguf's float32
        weights rounded to nearest even). `portable`: the plain-C version (the same bits)."""
        last = weight.num_rows if last_row is None else last_row
        if not 0 <= first_row < last <= weight.num_rows:
            raise ValueError(f"rows [{first_row}, {last}) must lie in [0, {weight.num_rows}] and not be empty")
        result = torch.empty(last - first_row, weight.num_cols, dtype=torch.bfloat16)
        self._dequantize[portable](weight.format, weight.data.data_ptr(), weight.num_cols, first_row, last, result.data_ptr())
        return result


def format_matmul() -> FormatMatmul | None:
    """The compiled format kernels; None where the kernels cannot be built."""
    library = load_library()
    return None if library is None else FormatMatmul(library)


def check_table() -> list[str]:
    """Rows where the Python table and the compiled C table disagree (empty: none, or no compiler)."""
    library = load_library()
    if library is None:
        return []
    problems = []
    for fmt in TABLE.values():
        elements, size = ctypes.c_int(), ctypes.c_int()
        if library.radixrt_format_block(fmt.type_number, ctypes.byref(elements), ctypes.byref(size)):
            problems.append(f"{fmt.name}: no row in formats.c")
        elif (elements.value, size.value) != (fmt.block_elements, fmt.block_bytes):
            problems.append(f"{fmt.name}: C says {elements.value} elements in {size.value} bytes")
    return problems


def dequantize_rows(fmt: WeightFormat, data: torch.Tensor, cols: int) -> torch.Tensor:
    """`data` ([rows, row_bytes] uint8, contiguous rows of `fmt`) as float32 [rows, cols], by the
    reference dequantizer. RuntimeError without the compiled kernels."""
    rows = _checked(fmt, data, cols)
    out = torch.empty(rows, cols, dtype=torch.float32)
    status = _library().radixrt_dequantize_rows(fmt.type_number, ctypes.c_void_p(data.data_ptr()),
                                               ctypes.c_int64(data.stride(0)), ctypes.c_int64(rows),
                                               ctypes.c_int64(cols), ctypes.c_void_p(out.data_ptr()))
    if status:
        raise ValueError(f"{fmt.name}: rows of {data.shape[1]} bytes do not hold {cols} elements")
    return out


def _checked(fmt: WeightFormat, data: torch.Tensor, cols: int) -> int:
    if data.dtype != torch.uint8 or data.dim() != 2 or data.stride(1) != 1:
        raise ValueError(f"{fmt.name} rows come as a [rows, bytes] uint8 tensor with contiguous rows")
    if data.shape[1] < fmt.row_bytes(cols):
        raise ValueError(f"{fmt.name}: rows of {data.shape[1]} bytes hold fewer than {cols} elements "
                         f"({fmt.row_bytes(cols)} bytes)")
    return int(data.shape[0])


def _library() -> ctypes.CDLL:
    library = load_library()
    if library is None:
        raise RuntimeError("the CPU kernels could not be built (no C compiler?): no reference dequantizer")
    return library
