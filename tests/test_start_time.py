"""What a fast start relies on: GGUF metadata read lazily gives the values gguf's own reader
gives (and refuses a bad file as before), and packing split over threads writes the same bytes as
one thread, for every packed format."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from radixrt.benchmarks.gguf_models import written
from radixrt.kernels import cpu
from radixrt.kernels.cpu.format_matmul import FORMATS, format_matmul
from radixrt.model.gguf_file import GGUFFile
from tests.test_format_matmul import random_blocks


def small_gguf(path: Path, tokens: list[str]) -> Path:
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_uint32("test.u32", 7)
    writer.add_int64("test.i64", -3)
    writer.add_float32("test.f32", 0.25)
    writer.add_bool("test.bool", True)
    writer.add_string("test.string", "héllo")
    writer.add_array("test.floats", [0.5, 1.5, -2.0])
    writer.add_array("test.ints", [1, 2, 3])
    writer.add_array("test.nested", [["a", "bc"], ["d"]])
    writer.add_token_list(tokens)
    writer.add_token_scores([float(i) for i in range(len(tokens))])
    writer.add_tensor("blk.0.attn_norm.weight", np.arange(32, dtype=np.float32))
    writer.add_tensor("token_embd.weight", np.ones((4, 32), dtype=np.float16))
    return written(writer, path)


def test_lazy_metadata_reads_what_ggufs_reader_reads(tmp_path):
    path = small_gguf(tmp_path / "small.gguf", ["<s>", "a", "bé", "", "ĠThe"] * 50)
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    fields = {name: field for name, field in theirs.fields.items() if not name.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    assert ours.metadata["test.nested"] == [["a", "bc"], ["d"]]  # gguf's reader flattens nested arrays
    for name, field in fields.items():
        if name == "test.nested":
            continue
        expected = field.contents()
        value = ours.metadata[name]
        if isinstance(expected, float) or (isinstance(expected, list) and expected and isinstance(expected[0], float)):
            assert np.array_equal(np.float32(value), np.float32(expected)), name
        else:
            assert value == expected, name
    assert "tokenizer.ggml.tokens" in ours.metadata and "missing" not in ours.metadata
    assert ours.metadata.get("missing", 5) == 5
    assert {t.name: (t.type_name, t.shape) for t in ours.tensors.values()} == {
        "blk.0.attn_norm.weight": ("F32", (32,)), "token_embd.weight": ("F16", (4, 32))}
    assert np.array_equal(ours.tensors["blk.0.attn_norm.weight"].data.view(np.float32)[0], np.arange(32))


def test_a_bad_vocabulary_string_is_refused_when_read_and_a_cut_one_at_open(tmp_path):
    path = small_gguf(tmp_path / "bad.gguf", ["<s>", "zzzz", "b"])
    data = bytearray(path.read_bytes())
    at = data.index(b"zzzz")
    data[at : at + 4] = b"\xff\xfe\xff\xfe"  # not UTF-8, same length
    path.write_bytes(bytes(data))
    file = GGUFFile(path)  # the walk reads lengths only
    assert file.metadata["test.u32"] == 7
    with pytest.raises(ValueError, match="tokenizer.ggml.tokens.*not UTF-8"):
        file.metadata["tokenizer.ggml.tokens"]
    length_at = at - 8  # the string's length: past the end of the file
    data[length_at : length_at + 8] = (1 << 40).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="header ends early.*truncated or corrupt"):
        GGUFFile(path)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_packing_over_threads_writes_the_bytes_one_thread_writes(name):
    kernels = format_matmul()
    if kernels is None:
        pytest.skip("no C compiler: the CPU kernels cannot be built")
    number = FORMATS[name]
    num_rows, num_cols = 16 * 7, 512  # 7 tiles: thread shares of unequal size
    blocks = random_blocks(name, num_rows, num_cols, np.random.default_rng(number))
    order = np.random.default_rng(1).permutation(num_rows)  # rows by address, reordered as q/k rows are
    rows = torch.from_numpy(blocks.ctypes.data + order * blocks.strides[0])
    packed = {}
    for threads in (1, 2, 3, 8):
        with cpu.kernel_threads(threads):
            packed[threads] = kernels.pack(number, rows, num_cols).data.clone()
    for threads, data in packed.items():
        assert torch.equal(data, packed[1]), f"{name}: {threads} threads"
    # each tile's bytes are its rows' alone: packing the first 3 tiles gives the whole's first 3
    with cpu.kernel_threads(2):
        part = kernels.pack(number, rows[: 16 * 3], num_cols).data
    assert torch.equal(part.flatten(), packed[1].flatten()[: part.numel()])
