"""GGUF weight formats as data: which formats exist, their type numbers and block sizes.

    FORMATS["Q4_K"]  ->  WeightFormat(name="Q4_K", type_number=12, block_elements=256, block_bytes=144)

Each row mirrors a row of the C table (`FORMATS[]` in formats.c, block structs in formats.h, the
plain-C reference dequantizers bit for bit equal to gguf's); `format_matmul.check_table()` says
where the two disagree. The formats the kernels multiply as stored are `PACKED`; their layouts
and kernels are format_matmul.h's. Plain data: this module imports nothing of the package.
"""

from __future__ import annotations

from typing import NamedTuple


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

# GGUF's type number of every format in the table, by name
TYPE_NUMBERS: dict[str, int] = {fmt.name: fmt.type_number for fmt in FORMATS.values()}
# The formats the kernels multiply as the file stores them (format_matmul.h), and their blocks by type number
PACKED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
BLOCKS: dict[int, tuple[int, int]] = {FORMATS[name].type_number: (FORMATS[name].block_elements,
                                                                   FORMATS[name].block_bytes) for name in PACKED}
