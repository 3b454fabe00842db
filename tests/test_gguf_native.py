"""GGUF files read directly: tiny random Llamas written with gguf's writer, read back by our reader.

Every file here shares one shape and so one metadata block: transformers reads
config and tokenizer once (a few seconds), later loads come from the start
record in this module's cache folder.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from radixrt.benchmarks.gguf_models import LlamaShape, llama_cpp_permute, write_llama_gguf
from radixrt.kernels import cpu
from radixrt.memory import packed_copy
from radixrt.model import gguf_int4, gguf_loader, gguf_plan
from radixrt.model.gguf_file import GGUFFile, GGUFTensor
from radixrt.model.gguf_int4 import PROJECTIONS, Int4Weight, int4_weight, projection
from radixrt.model.llama import LlamaForCausalLM
from radixrt.model.loader import load_model
from radixrt.paths import CACHE_ENV_VAR

SHAPE = LlamaShape()
# layer 0 all Q4_0 (native); layer 1 the other formats with a packed layout, fused with Q4_0/Q4_1
# parts, and a Q3_K ffn_down, a type without one
MIXED = {"blk.1.attn_v.weight": "Q5_1", "blk.1.attn_output.weight": "Q8_0", "blk.1.ffn_gate.weight": "Q4_1",
         "blk.1.ffn_up.weight": "Q5_0", "blk.1.ffn_down.weight": "Q3_K", "blk.0.attn_k.weight": "Q4_1"}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    cpu.quantized_matmul()  # the kernels built (or found) in the usual cache, once per process
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("radixrt-cache")
        patch.setenv(CACHE_ENV_VAR, str(path))
        yield path


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "q4.gguf")


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "mixed.gguf", types=MIXED, seed=1)


def reference(path: Path) -> dict[str, np.ndarray]:
    """Every tensor as gguf's own reader and reference dequantizer give it, float32, file row order."""
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
            for t in gguf.GGUFReader(str(path)).tensors}  # fmt: skip


def file_order(weight: torch.Tensor, name: str, shape: LlamaShape = SHAPE) -> np.ndarray:
    """Our (Hugging Face) rows of a projection part in the file's row order."""
    values = weight.float().numpy()
    if name.endswith("attn_q.weight"):
        return llama_cpp_permute(values, shape.num_heads)
    return llama_cpp_permute(values, shape.num_kv_heads) if name.endswith("attn_k.weight") else values


def split_parts(model: torch.nn.Module, layer: int, fused: str) -> dict[str, torch.Tensor]:
    """The GGUF parts of a dense fused projection, by tensor name."""
    weight = getattr(model.layers[layer], {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj",
                                           "down": "down_proj"}[fused])  # fmt: skip
    sizes = {"attn_q": SHAPE.num_heads * SHAPE.head_dim, "attn_k": SHAPE.num_kv_heads * SHAPE.head_dim,
             "attn_v": SHAPE.num_kv_heads * SHAPE.head_dim, "ffn_gate": SHAPE.intermediate,
             "ffn_up": SHAPE.intermediate}  # fmt: skip
    names = PROJECTIONS[fused]
    chunks = weight.split([sizes.get(n, weight.shape[0]) for n in names]) if len(names) > 1 else [weight]
    return {f"blk.{layer}.{name}.weight": chunk for name, chunk in zip(names, chunks)}


def test_dense_weights_equal_ggufs_reference_dequantizer_bit_for_bit(mixed_file):
    loaded = load_model(mixed_file, dtype="float32", weights="dense")
    expected = reference(mixed_file)
    model = loaded.model
    assert np.array_equal(model.embed_tokens.numpy(), expected["token_embd.weight"])
    assert np.array_equal(model.norm.numpy(), expected["output_norm.weight"])
    for layer in range(SHAPE.num_layers):
        assert np.array_equal(model.layers[layer].input_norm.numpy(), expected[f"blk.{layer}.attn_norm.weight"])
        for fused in PROJECTIONS:
            for name, weight in split_parts(model, layer, fused).items():
                assert np.array_equal(file_order(weight, name), expected[name]), name


def test_dense_weights_equal_transformers_reading_the_same_file(mixed_file):
    ours = load_model(mixed_file, dtype="float32", weights="dense").model
    theirs = transformers.AutoModelForCausalLM.from_pretrained(mixed_file.parent, gguf_file=mixed_file.name,
                                                               dtype=torch.float32).state_dict()  # fmt: skip
    assert torch.equal(ours.embed_tokens, theirs["model.embed_tokens.weight"])
    for i, layer in enumerate(ours.layers):
        prefix = f"model.layers.{i}."
        qkv = torch.cat([theirs[prefix + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(layer.qkv_proj, qkv), f"layer {i} qkv"
        assert torch.equal(layer.o_proj, theirs[prefix + "self_attn.o_proj.weight"])
        gate_up = torch.cat([theirs[prefix + "mlp.gate_proj.weight"], theirs[prefix + "mlp.up_proj.weight"]])
        assert torch.equal(layer.gate_up_proj, gate_up) and torch.equal(layer.down_proj, theirs[prefix + "mlp.down_proj.weight"])


def test_native_codes_equal_the_reference_dequantizer(mixed_file):
    file, config = GGUFFile(mixed_file), load_model(mixed_file, dtype="float32").config
    expected = reference(mixed_file)
    for fused in PROJECTIONS:  # layer 0 is all 4-bit (Q4_0, and a Q4_1 attn_k)
        weight = projection(file, 0, fused, config).dequantize()
        start = 0
        for name in PROJECTIONS[fused]:
            rows = expected[f"blk.0.{name}.weight"].shape[0]
            part = file_order(weight[start : start + rows], f"blk.0.{name}.weight")
            assert np.array_equal(part, expected[f"blk.0.{name}.weight"]), name
            start += rows


def gguf_rows_packed(matmul, parts, config) -> torch.Tensor:
    """`pack_gguf_q4` over these tensors' rows, q/k reordered as the loader does."""
    from radixrt.model.gguf_loader import _row_order

    addresses, kinds = [], []
    for part in parts:
        order = _row_order(part, config)
        rows = torch.arange(part.shape[0]) if order is None else order
        addresses.append(part.data.ctypes.data + rows * part.data.shape[1])
        kinds.append(torch.full((part.shape[0],), int(part.type_name == "Q4_1"), dtype=torch.uint8))
    return matmul.pack_gguf_q4(torch.cat(addresses), torch.cat(kinds), parts[0].shape[1]).data


def test_file_blocks_repack_in_c_exactly_as_from_codes(mixed_file):
    matmul = cpu.quantized_matmul()
    if matmul is None:
        pytest.skip("no AVX512-BF16: the 4-bit layout is not used")
    file, config = GGUFFile(mixed_file), load_model(mixed_file, dtype="float32").config
    for fused, names in PROJECTIONS.items():  # layer 0: Q4_0 parts and a Q4_1 attn_k, q/k rows reordered
        parts = [file.tensors[f"blk.0.{name}.weight"] for name in names]
        codes = projection(file, 0, fused, config)
        expected = matmul.pack_int4(codes.codes, codes.scales, codes.offsets).data
        assert torch.equal(gguf_rows_packed(matmul, parts, config), expected), fused
    # Q4_0 scales at fp16's edges: -8 d is exact for subnormals, zeros and normals, refused past 8192
    scales = [0x0001, 0x03FF, 0x0080, 0x8001, 0x0000, 0x8000, 0x3C00, 0xBC00, 0x6FFF, 0x0400, 0x07FF, 0x2E66,
              0x5800, 0xD7FF, 0x0200, 0x8200]  # fmt: skip
    rng = np.random.default_rng(0)
    blocks = np.zeros((16, 18), dtype=np.uint8)
    blocks[:, :2] = np.array(scales, dtype=np.uint16).view(np.uint8).reshape(16, 2)
    blocks[:, 2:] = rng.integers(0, 256, (16, 16), dtype=np.uint8)
    edge = GGUFTensor("edge", "Q4_0", (16, 32), blocks)
    weight = int4_weight(edge)
    expected = matmul.pack_int4(weight.codes, weight.scales, weight.offsets).data
    assert torch.equal(gguf_rows_packed(matmul, [edge], config), expected)
    head = file.tensors["token_embd.weight"]  # Q8_0, the tied head
    rows = head.data.ctypes.data + torch.arange(head.shape[0]) * head.data.shape[1]
    codes = gguf_int4.int8_weight(head)
    assert torch.equal(matmul.pack_gguf_q8(rows, head.shape[1]).data, matmul.pack_int8(codes.codes, codes.scales).data)
    blocks[0, :2] = np.array([0x7400], dtype=np.uint16).view(np.uint8)  # 16384: -8 d overflows fp16
    with pytest.raises(ValueError, match="does not fit in float16"):
        gguf_rows_packed(matmul, [GGUFTensor("edge", "Q4_0", (16, 32), blocks)], config)


def test_native_load_keeps_no_dense_projection(q4_file):
    native = load_model(q4_file, dtype="bfloat16", weights="native")
    dense = load_model(q4_file, dtype="bfloat16", weights="dense")
    assert native.weights == "native" and native.path == q4_file
    projections = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert all(getattr(layer, name).numel() == 0 for layer in native.model.layers for name in projections)
    live = sum(p.numel() * p.element_size() for p in native.model.parameters())
    assert live == (1 + 2 * SHAPE.num_layers) * SHAPE.hidden * 2, "norms only: the rest is the file's, packed"
    ids = native.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)  # > the C step sizes
    logits = [logits_of(loaded, ids) for loaded in (dense, native)]
    assert torch.corrcoef(torch.stack(logits))[0, 1] > 0.99


def test_a_tied_q8_0_embedding_is_looked_up_in_the_packed_head(q4_file, monkeypatch):
    if cpu.decode_stack() is None:
        pytest.skip("no AVX512-BF16: the head is not in radixrt's kernel layout, the embedding stays dense")
    native = load_model(q4_file, dtype="bfloat16", weights="native")
    assert native.model._packed_embedding is not None and native.model.embed_tokens.numel() == 0
    monkeypatch.setattr(LlamaForCausalLM, "embedding_runs_quantized", lambda *args: False)
    with_table = load_model(q4_file, dtype="bfloat16", weights="native")
    assert with_table.model.embed_tokens.shape == (SHAPE.vocab, SHAPE.hidden)
    ids = torch.tensor([0, 1, 15, 16, 17, 4095, SHAPE.vocab - 1])
    assert torch.equal(native.model._embed(ids), with_table.model.embed_tokens[ids]), "rows equal the dense load's"
    prompt = native.tokenizer.encode("The quick brown fox")  # a step the whole-step kernel runs, lookups in C
    assert torch.equal(logits_of(native, prompt), logits_of(with_table, prompt))


def logits_of(loaded, ids: list[int]) -> torch.Tensor:
    from radixrt.kernels.forward_batch import ForwardBatch
    from radixrt.kernels.registry import create_backend
    from radixrt.memory import KVCache
    from radixrt.model.runner import ModelRunner

    config = loaded.config
    cache = KVCache(config.kv_shape(loaded.model.dtype), 256)
    backend = create_backend("torch", cache, config.num_heads, config.num_kv_heads, config.head_dim)
    runner = ModelRunner(loaded.model, cache, backend, deterministic=False)
    return runner.forward(ForwardBatch.build([ids], [0], [torch.arange(len(ids))]))[-1].float()


def test_types_without_a_kernel_are_dequantized_with_one_warning(mixed_file, caplog):
    """With radixrt's packed kernels every format but Q3_K runs as stored, fused with Q4_0/Q4_1
    parts; without them (torch's 4-bit kernel) only Q4_0/Q4_1 do."""
    with caplog.at_level(logging.WARNING, logger="radixrt.model.gguf_loader"):
        loaded = load_model(mixed_file, dtype="bfloat16", weights="native")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    packed = cpu.quantized_matmul() is not None
    others = (("Q5_1", "blk.1.attn_v"), ("Q8_0", "blk.1.attn_output"), ("Q5_0", "blk.1.ffn_up"))
    for kind, name in (("Q3_K", "blk.1.ffn_down"), *(() if packed else others)):
        assert f"{kind}: {name}.weight" in warnings[0]
    assert all(f"{kind}: {name}.weight" not in warnings[0] for kind, name in (others if packed else ()))
    assert "slower dense path" in warnings[0]
    first, second = loaded.model.layers
    assert first.qkv_proj.numel() == 0 and first.int4_steps is not None, "layer 0 runs 4-bit"
    assert second.down_proj.shape == (SHAPE.hidden, SHAPE.intermediate) and second.int4_steps is None
    assert (second.qkv_proj.numel() == 0) == packed, "Q4_0, Q4_0, Q5_1 parts in one packed qkv"


def test_first_start_writes_a_record_and_at_most_one_packed_copy(q4_file, tmp_path, monkeypatch):
    """No converted weights: the config and tokenizer record, and the packed weights' copy for
    later starts (memory/packed_copy.py, here even for a tiny model) at most the file's bytes and a tenth."""
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "fresh"))
    monkeypatch.setattr(packed_copy, "MIN_COPY_BYTES", 0)
    load_model(q4_file, dtype="bfloat16", weights="native")
    packed_copy.wait_for_writers()
    written = sorted((p for p in (tmp_path / "fresh").rglob("*") if p.is_file()), key=lambda p: p.parent.name)
    assert [p.parent.name for p in written] == ["packed", "start"], written
    copy, record = written
    assert copy.suffix == packed_copy.SUFFIX and copy.stat().st_size <= 1.1 * q4_file.stat().st_size
    assert record.stat().st_size < q4_file.stat().st_size / 2, "config and tokenizer, no weights"


def truncated_copy(source: Path, target: Path, keep: int) -> Path:
    target.write_bytes(source.read_bytes()[:keep])
    return target


def test_truncated_or_corrupt_files_are_refused_by_name(q4_file, tmp_path, cache_dir):
    before = sorted(cache_dir.rglob("*"))
    size = q4_file.stat().st_size
    with pytest.raises(ValueError, match=r"tensor blk\.1\.ffn_down\.weight .*truncated or corrupt"):
        load_model(truncated_copy(q4_file, tmp_path / "cut.gguf", size - 100))
    with pytest.raises(ValueError, match="header ends early.*truncated"):
        load_model(truncated_copy(q4_file, tmp_path / "head.gguf", 5000))
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + struct.pack("<I", 1) + bytes(40))
    with pytest.raises(ValueError, match="GGUF version 1 is not supported"):
        load_model(tmp_path / "junk.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model(tmp_path / "empty.gguf")
    assert sorted(cache_dir.rglob("*")) == before, "a refused file leaves nothing behind"


def with_dims(source: Path, target: Path, tensor: str, dims: tuple[int, ...]) -> Path:
    """A copy of `source` whose tensor `tensor` claims the shape `dims` (innermost first)."""
    data = bytearray(source.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    assert struct.unpack_from("<I", data, at)[0] == len(dims)
    struct.pack_into(f"<{len(dims)}Q", data, at + 4, *dims)
    target.write_bytes(bytes(data))
    return target


def test_a_shape_that_does_not_match_its_blocks_is_refused(q4_file, tmp_path):
    rows, cols = SHAPE.intermediate, SHAPE.hidden
    with pytest.raises(ValueError, match=r"tensor blk\.0\.ffn_gate\.weight \(Q4_0\) .* whole blocks of 32"):
        load_model(with_dims(q4_file, tmp_path / "a.gguf", "blk.0.ffn_gate.weight", (cols + 16, rows)))
    with pytest.raises(ValueError, match=r"tensor blk\.0\.ffn_gate\.weight runs into tensor .*corrupt"):
        load_model(with_dims(q4_file, tmp_path / "b.gguf", "blk.0.ffn_gate.weight", (cols, rows + 16)))


def test_missing_tensors_and_unknown_architectures_are_refused(tmp_path):
    partial = write_llama_gguf(tmp_path / "partial.gguf", omit=("blk.1.ffn_down.weight",))
    with pytest.raises(ValueError, match=r"missing \['blk\.1\.ffn_down\.weight'\]"):
        load_model(partial)
    other = tmp_path / "other.gguf"
    other.write_bytes(partial.read_bytes().replace(b"llama", b"gpt99", 1))
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt99'"):
        load_model(other)


def test_not_enough_memory_is_refused_before_allocating(q4_file, monkeypatch):
    allocated = []
    monkeypatch.setattr(gguf_loader.LlamaForCausalLM, "__init__", lambda *a, **k: allocated.append(a))
    monkeypatch.setattr(gguf_plan, "available_memory_bytes", lambda: 2**20)
    with pytest.raises(ValueError, match=r"q4\.gguf: not enough memory: the weights need 0\.0\d GiB .* and the "
                                         r"KV pool 0\.00 GiB, but 0\.00 GiB is available"):  # fmt: skip
        load_model(q4_file, dtype="bfloat16", weights="native")
    monkeypatch.setattr(gguf_plan, "available_memory_bytes", lambda: 2**30)
    with pytest.raises(ValueError, match=r"the KV pool 2\.00 GiB, but 1\.00 GiB is available"):
        load_model(q4_file, dtype="bfloat16", kv_pool_bytes=lambda shape: 2 * 2**30)
    assert not allocated


def test_a_runtime_asking_for_a_kv_pool_beyond_memory_is_refused_with_the_numbers(q4_file):
    from radixrt import Runtime

    with pytest.raises(ValueError, match=r"not enough memory: .* and the KV pool \d+\.\d\d GiB"):
        Runtime(q4_file, max_total_tokens=10**10)


def test_quantized_4bit_weight_shapes_are_checked(q4_file):
    loaded = load_model(q4_file, dtype="float32")
    layer = loaded.model.layers[0]
    bad = Int4Weight(torch.zeros(16, 32, dtype=torch.uint8), torch.zeros(16, 1), torch.zeros(16, 1))
    with pytest.raises(ValueError, match="layer 0 qkv: 4-bit shape"):
        layer.use_int4({"qkv": bad})
