"""Warm starts without transformers: a folder's start record reproduces transformers' config and tokenizer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from radixrt.engine.detokenizer import StreamDetokenizer, make_detokenizer
from radixrt.model.config import ModelConfig
from radixrt.model import start_record
from radixrt.model.gguf_file import GGUFFile
from radixrt.model.loader import bundled_model_path
from radixrt.model.start_record import read_record, record_path, write_record
from radixrt.model.tokenizer import Tokenizer, TokenizerRecord
from radixrt.paths import CACHE_ENV_VAR

TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "naïve café, 東京, 🙂👍🏽",
    "tabs\tand\nnew lines\n\n\n",
    "x = [1, 2, 3]  # 1234567890 + 0.5",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3 + 3?", "name": None},
    ],
]


@pytest.fixture(params=["tiny", "smollm2"])
def model_folder(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Hugging Face folder (tiny) or a GGUF file (smollm2), with the records going to an empty cache."""
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))
    return request.getfixturevalue("tiny_llama_dir") if request.param == "tiny" else bundled_model_path()


def _record(source: Path) -> tuple[Tokenizer, ModelConfig, transformers.PreTrainedTokenizerBase, ModelConfig]:
    """The recorded tokenizer and config, read back from disk, and what transformers makes of the
    folder (or GGUF file's metadata)."""
    if source.suffix == ".gguf":
        folder, options, key = source.parent, {"gguf_file": source.name}, GGUFFile(source)
    else:
        folder, options, key = source, {}, source
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder, **options)
    hf_config = transformers.AutoConfig.from_pretrained(folder, **options)
    config = ModelConfig.from_hf(hf_config)
    assert read_record(key) is None
    assert write_record(key, hf_config, config, hf_tokenizer) is not None
    record = read_record(key)
    assert record is not None

    def no_transformers() -> None:
        pytest.fail("the recorded tokenizer fell back to transformers")

    return Tokenizer(record.tokenizer, no_transformers), record.model_config(), hf_tokenizer, config


def test_recorded_tokenizer_and_config_equal_transformers(model_folder):
    tokenizer, config, hf_tokenizer, hf_config = _record(model_folder)
    assert config == hf_config
    for text in TEXTS:
        for add_special_tokens in (True, False):
            expected = hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
            assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected, text
    ids = hf_tokenizer.encode(" ".join(TEXTS), add_special_tokens=False) + hf_tokenizer.all_special_ids
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)
        assert tokenizer.decode(ids[:3], skip_special_tokens=skip, clean_up_tokenization_spaces=False) == (
            hf_tokenizer.decode(ids[:3], skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        )
    assert tokenizer.decode(ids[5]) == hf_tokenizer.decode(ids[5])
    assert tokenizer.decode([ids[:4], ids[4:9]]) == hf_tokenizer.decode([ids[:4], ids[4:9]])
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected = hf_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            ) == expected
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "eos_token", "bos_token",
                 "all_special_ids", "special_tokens_map", "chat_template"):
        assert getattr(tokenizer, name) == getattr(hf_tokenizer, name), name
    assert len(tokenizer) == len(hf_tokenizer)


def test_recorded_tokenizer_streams_through_the_rust_detokenizer(model_folder):
    tokenizer, _, hf_tokenizer, _ = _record(model_folder)
    ids = hf_tokenizer.encode("naïve café, 東京 🙂 and more", add_special_tokens=False)
    detokenizer = make_detokenizer(tokenizer, ids[:2])
    assert isinstance(detokenizer, StreamDetokenizer)
    text = "".join(detokenizer.append(i) for i in ids[2:]) + detokenizer.flush()
    assert text == hf_tokenizer.decode(ids[2:], skip_special_tokens=True)


def test_other_uses_reach_the_transformers_tokenizer(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    record = TokenizerRecord.of(hf_tokenizer)
    assert record is not None
    tokenizer = Tokenizer(record, lambda: hf_tokenizer)
    assert tokenizer.get_vocab() == hf_tokenizer.get_vocab()
    assert tokenizer("hi there")["input_ids"] == hf_tokenizer("hi there")["input_ids"]
    messages = CONVERSATIONS[0]
    assert tokenizer.apply_chat_template(messages, return_dict=False) == hf_tokenizer.apply_chat_template(
        messages, return_dict=False
    )


def test_record_follows_the_folder_files(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    _record(folder)
    assert read_record(folder) is not None
    (folder / "model.safetensors").touch()  # weights are not part of the key
    assert read_record(folder) is not None
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["eos_token"] = "<|endoftext|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    assert read_record(folder) is None
    record_path(folder).parent.mkdir(parents=True, exist_ok=True)
    record_path(folder).write_text("{not json")
    assert read_record(folder) is None


def test_only_the_most_recently_used_records_are_kept(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))
    monkeypatch.setattr(start_record, "MAX_RECORDS", 3)
    folders = []
    for i in range(5):
        folders.append(tmp_path / f"model-{i}")
        shutil.copytree(tiny_llama_dir, folders[-1])
        _record(folders[-1])
        os.utime(record_path(folders[-1]), (1000.0 + i, 1000.0 + i))  # written in order, a second apart
        if i == 2:
            assert read_record(folders[0]) is not None  # a read makes model-0 the most recently used
    kept = {path.name for path in record_path(folders[0]).parent.glob("*.json")}
    assert kept == {record_path(folders[i]).name for i in (0, 3, 4)}


def test_tokenizer_whose_class_changes_decoding_is_not_recorded(tiny_llama_dir):
    class Shouting(TokenizersBackend):
        def decode(self, *args: object, **kwargs: object) -> str:
            return str(super().decode(*args, **kwargs)).upper()

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert TokenizerRecord.of(hf_tokenizer) is not None
    assert TokenizerRecord.of(Shouting(tokenizer_object=hf_tokenizer.backend_tokenizer)) is None


_WARM_LOAD = """
import sys
from radixrt.model.loader import load_model
loaded = load_model(sys.argv[1], dtype="float32")
ids = loaded.tokenizer.encode("hello there")
assert loaded.tokenizer.decode(ids) == "hello there"
print("transformers" in sys.modules)
assert loaded.hf_config.num_hidden_layers == loaded.config.num_layers
"""


def test_warm_load_does_not_import_transformers(tiny_llama_dir, tmp_path):
    env = {**os.environ, CACHE_ENV_VAR: str(tmp_path)}
    runs = [
        subprocess.run([sys.executable, "-c", _WARM_LOAD, str(tiny_llama_dir)], env=env, capture_output=True,
                       text=True, check=True).stdout.strip()
        for _ in range(2)
    ]
    assert runs == ["True", "False"]  # the first load reads the folder through transformers and records it


def test_config_that_does_not_round_trip_is_not_recorded(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    hf_config = transformers.AutoConfig.from_pretrained(tiny_llama_dir)
    config = ModelConfig.from_hf(hf_config)
    full = hf_config.to_json_string(use_diff=False)
    monkeypatch.setattr(hf_config, "to_json_string", lambda use_diff: full.replace('"rms_norm_eps"', '"other"'))
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert write_record(tiny_llama_dir, hf_config, config, hf_tokenizer) is None
    assert read_record(tiny_llama_dir) is None
