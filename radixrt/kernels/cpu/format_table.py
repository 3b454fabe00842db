"""GGUF weight formats as data: the table the loader asks which formats exist and how big their
blocks are, and the plain-C reference dequantizer (`formats.c`) every kernel of a format is
tested against (bit for bit equal to gguf's Python dequantizer).

    FORMATS["Q4_K"]  ->  WeightFormat(name="Q4_K", type_number=12, block_elements=256, block_bytes=144)

Each row mirrors a row of the C table (`FORMATS[]` in formats.c, block structs in formats.h);
`check_table()` says where the two disagree.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from radixrt.kernels.cpu import _load


class WeightFormat(NamedTuple):
    name: str
    type_number: int  # GGUF's tensor type (ggml_type)
    block_elements: int
    block_bytes: int

    def row_bytes(self, cols: int) -> int:
        """Bytes of a row of `cols` elements (ValueError unless whole blocks)."""
        if cols <= 0 or cols % self.block_elements:
            raise ValueError(f"a {self.name} row holds whole blocks of {self.block_elements} elements, not {cols}")
        return cols // self.block_elements * self.block_bytes


FORMATS: dict[str, WeightFormat] = {
    fmt.name: fmt
    for fmt in (
        WeightFormat("F32", 0, 1, 4),
        WeightFormat("F16", 1, 1, 2),
        WeightFormat("BF16", 30, 1, 2),
        WeightFormat("Q4_0", 2, 32, 18),
        WeightFormat("Q4_1", 3, 32, 20),
        WeightFormat("Q5_0", 6, 32, 22),
        WeightFormat("Q5_1", 7, 32, 24),
        WeightFormat("Q8_0", 8, 32, 34),
        WeightFormat("Q4_K", 12, 256, 144),
        WeightFormat("Q5_K", 13, 256, 176),
        WeightFormat("Q6_K", 14, 256, 210),
    )
}


def weight_format(name: str) -> WeightFormat:
    """The table's row for a GGUF type name (ValueError naming the accepted ones)."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"weight format {name!r} has no row in the format table; formats: "
                         f"{', '.join(FORMATS)}") from None


def check_table() -> list[str]:
    """Rows where the Python table and the compiled C table disagree (empty: none, or no compiler)."""
    library = _load()
    if library is None:
        return []
    problems = []
    for fmt in FORMATS.values():
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


def gather_rows_bf16(fmt: WeightFormat, table: torch.Tensor, ids: torch.Tensor, cols: int) -> torch.Tensor:
    """Rows `ids` of `table` ([vocab, row_bytes] uint8 of `fmt`) as bf16 [len(ids), cols], each element
    rounded once from the reference dequantizer's float32 (a token embedding from its quantized table)."""
    vocab = _checked(fmt, table, cols)
    ids = ids.to(torch.int64).contiguous()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise IndexError(f"a token id is outside the table's {vocab} rows")
    out = torch.empty(ids.numel(), cols, dtype=torch.bfloat16)
    scratch = torch.empty(cols, dtype=torch.float32)
    _library().radixrt_dequantize_gather_bf16(fmt.type_number, ctypes.c_void_p(table.data_ptr()),
                                             ctypes.c_int64(table.stride(0)), ctypes.c_void_p(ids.data_ptr()),
                                             ctypes.c_int64(ids.numel()), ctypes.c_int64(cols),
                                             ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(scratch.data_ptr()))
    return out


def _checked(fmt: WeightFormat, data: torch.Tensor, cols: int) -> int:
    if data.dtype != torch.uint8 or data.dim() != 2 or data.stride(1) != 1:
        raise ValueError(f"{fmt.name} rows come as a [rows, bytes] uint8 tensor with contiguous rows")
    if data.shape[1] < fmt.row_bytes(cols):
        raise ValueError(f"{fmt.name}: rows of {data.shape[1]} bytes hold fewer than {cols} elements "
                         f"({fmt.row_bytes(cols)} bytes)")
    return int(data.shape[0])


def _library() -> ctypes.CDLL:
    library = _load()
    if library is None:
        raise RuntimeError("the CPU kernels could not be built (no C compiler?): no reference dequantizer")
    return library
