"""Loading checkpoints: HF folders, GGUF files, the bundled SmolLM2; the GGUF conversion cache benchmarks use."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from radixrt.benchmarks.gguf_models import written
from radixrt.model import gguf_cache, gguf_config, gguf_loader
from radixrt.model.loader import (
    BUNDLED_MODEL_NAME,
    bundled_model_path,
    default_cpu_dtype,
    load_model,
    resolve_dtype,
)


def write_gguf(path: Path, architecture: str = "llama", tokenizer: bool = True) -> Path:
    """A minimal GGUF file: metadata and one tensor, optionally tokenizer fields."""
    writer = gguf.GGUFWriter(str(path), arch=architecture)
    writer.add_block_count(1)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(["a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    return written(writer, path)


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*Hugging Face folder.*gguf"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_bad_files_and_folders(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        load_model(tmp_path / "weights.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path / "empty")
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model(tmp_path / "broken.gguf")
    with pytest.raises(TypeError, match="model must be a path"):
        load_model(42)


def test_gguf_without_tokenizer_or_unsupported_architecture(tmp_path, monkeypatch):
    monkeypatch.setenv(gguf_cache.CACHE_ENV_VAR, str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="no tokenizer data"):
        load_model(write_gguf(tmp_path / "notok.gguf", tokenizer=False))
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'; supported: llama, qwen2, qwen3, phi3, "
                                         "gemma2, gemma3"):
        load_model(write_gguf(tmp_path / "gpt2.gguf", architecture="gpt2"))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_folder_without_weights_or_unsupported_architecture(tmp_path, tiny_llama_dir):
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="has no weights"):
        load_model(folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'; supported: LlamaForCausalLM"):
        load_model(folder)


def test_dtypes_and_devices(tiny_llama_dir):
    cpu = torch.device("cpu")
    assert resolve_dtype("fp32", cpu) == torch.float32 and resolve_dtype(torch.bfloat16, cpu) == torch.bfloat16
    assert resolve_dtype(None, cpu) == resolve_dtype("auto", cpu) == default_cpu_dtype()
    with pytest.raises(ValueError, match="float16 is not supported on cpu; supported: float32, bfloat16"):
        resolve_dtype("fp16", cpu)
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, fp32, bfloat16"):
        resolve_dtype("int8", cpu)
    with pytest.raises(TypeError, match="dtype must be a str or torch.dtype"):
        resolve_dtype(32, cpu)
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N'"):
        load_model(tiny_llama_dir, device="mps")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            load_model(tiny_llama_dir, device="cuda")
    loaded = load_model(tiny_llama_dir, dtype="bf16")
    assert loaded.model.dtype == torch.bfloat16


def test_tiny_folder_loads_with_tokenizer(tiny_llama, tiny_llama_dir):
    assert tiny_llama.name == tiny_llama_dir.name and tiny_llama.path == tiny_llama_dir
    assert tiny_llama.config.tie_word_embeddings and tiny_llama.model.lm_head is tiny_llama.model.embed_tokens
    assert tiny_llama.tokenizer.chat_template
    ids = tiny_llama.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert ids["input_ids"][0] == tiny_llama.config.bos_token_id


def test_sharded_safetensors_and_bin_load_the_same_weights(tmp_path, tiny_llama_dir, tiny_llama):
    state = load_file(str(tiny_llama_dir / "model.safetensors"))
    names = sorted(state)
    for kind in ("sharded", "bin"):
        folder = tmp_path / kind
        shutil.copytree(tiny_llama_dir, folder)
        (folder / "model.safetensors").unlink()
        if kind == "bin":
            torch.save(state, folder / "pytorch_model.bin")
        else:
            halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
            for file, keys in halves.items():
                save_file({k: state[k] for k in keys}, str(folder / file))
            weight_map = {k: file for file, keys in halves.items() for k in keys}
            (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        loaded = load_model(folder, dtype="float32")
        for (name, ours), theirs in zip(loaded.model.state_dict().items(), tiny_llama.model.state_dict().values()):
            assert torch.equal(ours, theirs), (kind, name)


def test_conversion_failure_leaves_no_cache(tmp_path, monkeypatch):
    """The conversion benchmarks use to give transformers a folder of a GGUF file: a crash
    mid-conversion leaves neither a cache folder nor a temporary one; a temporary folder orphaned
    by a dead process is cleaned up by the next conversion."""
    monkeypatch.setenv(gguf_cache.CACHE_ENV_VAR, str(tmp_path / "cache"))
    source = write_gguf(tmp_path / "tiny.gguf", architecture="qwen2")
    final = gguf_cache.cached_folder(source)
    final.parent.mkdir(parents=True)
    orphan = final.parent / f".tmp-{final.name}-999999999-deadbeef"
    orphan.mkdir()

    def crash(gguf_path: Path, out: Path) -> None:
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(gguf_cache, "_convert", crash)
    with pytest.raises(RuntimeError, match="killed"):
        gguf_cache.gguf_to_hf_folder(source)
    assert list(final.parent.iterdir()) == []


@pytest.mark.slow
def test_bundled_model_loads_from_its_file_and_reuses_its_record(smollm2, monkeypatch):
    assert smollm2.name == BUNDLED_MODEL_NAME
    assert smollm2.path == bundled_model_path(), "the weights are read from the GGUF file, not a converted copy"
    assert smollm2.config.architecture == "LlamaForCausalLM" and smollm2.config.num_layers == 30
    assert smollm2.tokenizer.chat_template and smollm2.tokenizer.eos_token == "<|im_end|>"

    def no_transformers(*args: object) -> None:
        raise AssertionError("the start record should have been reused")

    monkeypatch.setattr(gguf_config.MetadataConfig, "transformers_config", no_transformers)
    monkeypatch.setattr(gguf_loader, "_transformers_tokenizer", no_transformers)
    again = load_model(dtype="bf16")
    assert again.path == smollm2.path and again.model.dtype == torch.bfloat16
    torch.testing.assert_close(again.model.norm.float(), smollm2.model.norm, atol=1e-2, rtol=1e-2)
