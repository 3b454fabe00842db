"""The packed copy of a GGUF's weights (memory/packed_copy.py): written after the first start,
mapped by later ones, and a model over a mapped copy is the model packed from the file, bit for bit."""

from __future__ import annotations

import logging
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixrt.benchmarks.gguf_models import LlamaShape, write_llama_gguf
from radixrt.kernels import cpu
from radixrt.memory import huge_pages, packed_copy
from radixrt.model import quantize as quantizer
from radixrt.model.loader import LoadedModel, load_model
from radixrt.paths import CACHE_ENV_VAR
from tests.test_gguf_native import logits_of
from tests.test_quantize import bf16_dir, f16_gguf  # noqa: F401 (fixtures)

# K-quant rows are whole blocks of 256 inputs; an untied model, so that the embedding and the head
# both take slots of the buffer
SHAPE = LlamaShape(num_layers=2, hidden=256, intermediate=512, num_heads=4, num_kv_heads=2, tied=False)
PROMPT = [5, 17, 3, 99, 42, 7, 1, 250]

pytestmark = pytest.mark.skipif(cpu.quantized_matmul() is None or not sys.platform.startswith("linux"),
                                reason="packed copies are of radixrt's packed kernels' buffers, on Linux")


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cpu.quantized_matmul()  # the kernels built (or found) in the usual cache
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))
    monkeypatch.setattr(packed_copy, "MIN_COPY_BYTES", 0)  # the tiny models' copies are written too
    monkeypatch.delenv(packed_copy.ENVIRONMENT_VARIABLE, raising=False)
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("packed-copy")
    return {
        "Q4_K_M": write_llama_gguf(folder / "q4_k_m.gguf", SHAPE, mix="Q4_K_M", seed=3),
        # Q4_0 projections with a Q5_K embedding and a Q8_0 head: the 4-bit packer and both end slots
        "legacy": write_llama_gguf(folder / "legacy.gguf", SHAPE, seed=9,
                                   types={"token_embd.weight": "Q5_K", "output.weight": "Q8_0"}),
        # a Q4_0 head is placed by the model after the fact (`finish_int4`)
        "Q4_0 head": write_llama_gguf(folder / "q4_0.gguf", SHAPE, projection_type="Q4_0", seed=5,
                                      types={"output.weight": "Q4_0"}),
    }


def copies(cache: Path) -> list[Path]:
    return sorted((cache / "packed").glob(f"*{packed_copy.SUFFIX}"))


def load(path: Path) -> LoadedModel:
    loaded = load_model(path, dtype="bfloat16", weights="native")
    packed_copy.wait_for_writers()
    return loaded


def packed_weights(loaded: LoadedModel) -> list[cpu.PackedWeight]:
    weights = [weight for layer in loaded.model.decoder_layers() for weight in layer.int4_steps.packed_weights()]
    return weights + [loaded.model._invariant_lm_head.packed]


def mapped_file(address: int) -> str:
    """The file mapped at `address` in this process ("" for anonymous memory)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(bound, 16) for bound in fields[0].split("-"))
        if start <= address < end:
            return fields[5] if len(fields) == 6 else ""
    raise AssertionError(f"{address:#x} is not mapped")


@pytest.mark.parametrize("kind", ["Q4_K_M", "legacy", "Q4_0 head"])
def test_a_later_start_maps_the_copy_and_runs_the_same_bits(files, fresh_cache, kind):
    first = load(files[kind])
    (copy,) = copies(fresh_cache)
    weights = packed_weights(first)
    assert all(mapped_file(weight.data.data_ptr()) == "" for weight in weights), "packed into fresh memory"
    assert copy.stat().st_size <= 1.1 * files[kind].stat().st_size, "at most the file's bytes and a tenth"

    later = load(files[kind])
    assert copies(fresh_cache) == [copy], "read, not written again"
    again = packed_weights(later)
    assert all(mapped_file(weight.data.data_ptr()) == str(copy) for weight in again)
    for packed, mapped in zip(weights, again):
        assert packed.layout() == mapped.layout() and packed.bits == mapped.bits
        assert torch.equal(packed.data, mapped.data)
    assert torch.equal(logits_of(first, PROMPT), logits_of(later, PROMPT))


def test_a_copy_of_the_wrong_size_is_packed_again_and_replaced(files, fresh_cache, caplog):
    expected = logits_of(load(files["Q4_K_M"]), PROMPT)
    (copy,) = copies(fresh_cache)
    whole = copy.read_bytes()
    copy.write_bytes(whole[: len(whole) // 2])
    with caplog.at_level(logging.WARNING, logger="radixrt.memory.packed_copy"):
        repacked = load(files["Q4_K_M"])
    assert any("wrong size" in record.getMessage() for record in caplog.records)
    assert all(mapped_file(weight.data.data_ptr()) == "" for weight in packed_weights(repacked))
    assert torch.equal(logits_of(repacked, PROMPT), expected)
    assert copy.read_bytes() == whole, "written whole again"


@pytest.mark.parametrize("source, kind", [("bf16_dir", "q4_0"), ("f16_gguf", "q8_0")])
def test_a_model_quantized_at_load_is_mapped_from_its_copy_and_reads_no_projection(request, fresh_cache, source,
                                                                                   kind, monkeypatch):
    path = request.getfixturevalue(source)
    first = load_model(path, dtype="bfloat16", quantize=kind)
    packed_copy.wait_for_writers()
    (copy,) = copies(fresh_cache)
    read = []
    for name in ("gguf_projection", "pack_quantized"):  # nothing is read or quantized again
        inner = getattr(quantizer, name)
        monkeypatch.setattr(quantizer, name, lambda *args, _inner=inner, _name=name: read.append(_name) or _inner(*args))
    later = load_model(path, dtype="bfloat16", quantize=kind)
    assert read == ["gguf_projection"] * (source == "f16_gguf"), "the projection reader made, never called"
    assert all(mapped_file(weight.data.data_ptr()) == str(copy) for weight in packed_weights(later))
    assert torch.equal(logits_of(first, PROMPT), logits_of(later, PROMPT))


def test_a_changed_source_gets_a_new_copy_and_its_old_one_goes(files, fresh_cache, tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(files["legacy"].read_bytes())
    load(source)
    (old,) = copies(fresh_cache)
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    load(source)
    (new,) = copies(fresh_cache)
    assert new != old and not old.exists()


def test_copies_off_writes_and_reads_none_and_a_bad_setting_is_refused(files, fresh_cache, monkeypatch):
    monkeypatch.setenv(packed_copy.ENVIRONMENT_VARIABLE, "0")
    load(files["Q4_K_M"])
    assert copies(fresh_cache) == []
    monkeypatch.setenv(packed_copy.ENVIRONMENT_VARIABLE, "yes")
    with pytest.raises(ValueError, match="RADIXRT_PACKED_COPIES='yes': expected 1 .* or 0"):
        load_model(files["Q4_K_M"], dtype="bfloat16", weights="native")


def test_a_small_model_gets_no_copy(files, fresh_cache, monkeypatch):
    monkeypatch.setattr(packed_copy, "MIN_COPY_BYTES", files["Q4_K_M"].stat().st_size * 2)
    load(files["Q4_K_M"])
    assert copies(fresh_cache) == []


def test_the_folder_keeps_the_most_recently_used_copies(files, fresh_cache, tmp_path, monkeypatch):
    monkeypatch.setattr(packed_copy, "MAX_COPIES", 2)
    sources = []
    for i in range(3):
        source = tmp_path / f"model-{i}.gguf"
        source.write_bytes(files["legacy"].read_bytes())
        sources.append(source)
        load(source)
    assert [path.name.split("-")[1] for path in copies(fresh_cache)] == ["1", "2"]


def test_a_dead_writers_temporary_file_is_removed_and_a_live_ones_kept(files, fresh_cache):
    folder = fresh_cache / "packed"
    folder.mkdir(parents=True)
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True)
    dead = folder / f".gone{packed_copy.SUFFIX}.{int(finished.stdout)}.tmp"
    live = folder / f".busy{packed_copy.SUFFIX}.{os.getppid()}.tmp"
    dead.write_bytes(b"partial")
    live.write_bytes(b"partial")
    load(files["Q4_K_M"])
    assert not dead.exists() and live.exists()


def test_a_stored_buffer_hands_out_its_slots_without_writing_them():
    sizes = [100, 64, 3]  # slots at 0, 128 and 192 of 256 bytes
    stored = bytes(range(256))
    mapping = mmap.mmap(-1, huge_pages.SideBySide.span(sizes))
    mapping[:] = stored
    placed = huge_pages.SideBySide(sizes, stored=mapping)
    assert placed.written
    first = placed.take(100)
    assert first.tolist() == list(stored[:100])
    second = placed.place(torch.zeros(64, dtype=torch.uint8))
    assert second.tolist() == list(stored[128:192]), "a written slot keeps its bytes"
    with pytest.raises(ValueError, match="slot 2 of 3: 4 bytes do not fit"):
        placed.take(4)
    with pytest.raises(ValueError, match="a stored buffer of 10 bytes for slots spanning 256"):
        huge_pages.SideBySide(sizes, stored=mmap.mmap(-1, 10))
