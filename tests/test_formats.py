"""The format table and its plain-C reference dequantizers against gguf's Python dequantizer."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.kernels.cpu import format_matmul, formats
from radixrt.kernels.cpu.formats import FORMATS

pytestmark = pytest.mark.skipif(format_matmul.load_library() is None, reason="no C compiler")

# Offsets of each block's fp16 scales (the rest of a block is codes and sub-block scales).
_FP16_AT = {"F16": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
            "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # fmt: skip


def random_blocks(name: str, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Valid random blocks: any codes, finite fp16 scales of either sign (subnormals included)."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, blocks_per_row, fmt.block_bytes), dtype=np.uint8)
    if name in ("F32", "BF16"):
        values = (rng.standard_normal((rows, blocks_per_row)) * 4).astype(np.float32)
        if name == "BF16":
            values = (values.view(np.uint32) >> 16).astype(np.uint16)
        data = values.view(np.uint8).reshape(rows, blocks_per_row, fmt.block_bytes)
    for offset in _FP16_AT.get(name, ()):
        scale = rng.standard_normal((rows, blocks_per_row)) * rng.choice([1e-6, 1e-3, 0.1, 30.0], (rows, blocks_per_row))
        data[..., offset:offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(rows, blocks_per_row, 2)
    return data.reshape(rows, blocks_per_row * fmt.block_bytes)


def test_python_table_matches_c_and_gguf():
    assert format_matmul.check_table() == []
    assert set(formats.PACKED) <= set(FORMATS)
    assert all(format_matmul.format_matmul().tile_bytes(FORMATS[name].type_number, 256) > 0 for name in formats.PACKED)
    for fmt in FORMATS.values():
        qtype = gguf.GGMLQuantizationType[fmt.name]
        assert int(qtype) == fmt.type_number
        assert gguf.GGML_QUANT_SIZES[qtype] == (fmt.block_elements, fmt.block_bytes)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(FORMATS)), rows=st.integers(1, 5), blocks=st.integers(1, 3),
       seed=st.integers(0, 2**31 - 1))
def test_reference_dequantizer_equals_gguf_bit_for_bit(name, rows, blocks, seed):
    fmt = FORMATS[name]
    data = random_blocks(name, rows, blocks, seed)
    cols = blocks * fmt.block_elements
    expected = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[name]).astype(np.float32)
    ours = format_matmul.dequantize_rows(fmt, torch.from_numpy(data), cols).numpy()
    assert ours.shape == expected.shape == (rows, cols)
    np.testing.assert_array_equal(ours.view(np.uint32), expected.view(np.uint32))



def test_bad_input_is_named():
    with pytest.raises(ValueError, match="'Q3_K' has no row in the format table"):
        formats.weight_format("Q3_K")
    q4k = FORMATS["Q4_K"]
    with pytest.raises(ValueError, match="whole blocks of 256 elements, not 300"):
        q4k.row_bytes(300)
    with pytest.raises(ValueError, match="fewer than 512 elements"):
        format_matmul.dequantize_rows(q4k, torch.zeros(2, 144, dtype=torch.uint8), 512)
    with pytest.raises(ValueError, match="uint8"):
        format_matmul.dequantize_rows(q4k, torch.zeros(2, 144, dtype=torch.int16), 256)
