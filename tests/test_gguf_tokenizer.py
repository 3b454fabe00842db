"""A GGUF's tokenizer built from its metadata without transformers (`gguf_tokenizer`) equals the one
transformers builds from the same file: the Rust tokenizer's JSON, encode and decode, the chat
template, the special tokens and their ids, for byte-level ("gpt2") and sentencepiece-style
("llama") vocabularies under every architecture radixrt runs. A file's first load then never
imports transformers, and a file this module does not reproduce still loads through transformers.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import transformers

from radixrt.benchmarks.gguf_models import LlamaShape, write_llama_gguf, written
from radixrt.model import gguf_loader
from radixrt.model.gguf_file import GGUFFile
from radixrt.model.gguf_tokenizer import tokenizer_record
from radixrt.model.loader import bundled_model_path, load_model
from radixrt.model.start_record import read_record, record_path
from radixrt.model.tokenizer import Tokenizer, TokenizerRecord
from radixrt.paths import CACHE_ENV_VAR

_TRAINING = [
    "The quick brown fox jumps over the lazy dog.",
    "A radix tree shares the key-value cache of common prompt prefixes between requests.",
    "Paged attention stores each token's keys and values in fixed-size pages of a pool.",
    "What is the age of John Doe? He is forty-two years old and lives in Springfield.",
    "Few-shot prompts repeat the same examples;   only the final question differs.\n\n  Indented 12345 line",
] * 20
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXTS = [
    "",
    " ",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "   three spaces, then\ttab",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><s></s><think>x</think>",
    "naïve café, 東京, 🙂👍🏽 Ünïcödé",
    "tabs\tand\nnew lines\n\n\n end",
    "x = [1, 2, 3]  # 1234567890 + 0.5 and 3.14159",
    "The quick brown fox jumps over the lazy dog. What is the age of John Doe?",
    "\n",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2 + 2?"}],
]  # fmt: skip
CONTROL, USER_DEFINED = int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED)


def byte_level_vocabulary() -> tuple[list[str], list[int], list[str]]:
    """A trained byte-level BPE (tokens, token types, merges) with three control tokens first and
    two user-defined tokens last."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    backend = RustTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    backend.train_from_iterator(_TRAINING, trainer)
    model = json.loads(backend.to_str())["model"]
    tokens = [token for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [CONTROL if token.startswith("<|") else int(gguf.TokenType.NORMAL) for token in tokens]
    return tokens + ["<think>", "</think>"], types + [USER_DEFINED] * 2, merges


def sentencepiece_vocabulary(spaces: bool = False) -> tuple[list[str], list[int], list[float]]:
    """A Llama-style vocabulary (tokens, types, scores): <unk> <s> </s>, the 256 byte tokens, two
    control tokens and a user-defined one, (Gemma: tokens of spaces stored as spaces) and
    "\u2581"-spelled pieces scored by their merge order."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    backend = RustTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    backend.train_from_iterator(_TRAINING, trainers.BpeTrainer(vocab_size=350, show_progress=False))
    pieces = [t for t, _ in sorted(json.loads(backend.to_str())["model"]["vocab"].items(), key=lambda kv: kv[1])]
    kind = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "<|im_start|>", "<|im_end|>", "<think>"]
    types = [int(kind.UNKNOWN), CONTROL, CONTROL, *[int(kind.BYTE)] * 256, CONTROL, CONTROL, USER_DEFINED]
    if spaces:
        tokens += ["  ", "   ", "\n\n"]
        types += [int(kind.NORMAL)] * 3
    scores = [0.0] * len(tokens) + [-float(len(tokens) + i) for i in range(len(pieces))]
    return tokens + pieces, types + [int(kind.NORMAL)] * len(pieces), scores


def write_tokenizer_gguf(path: Path, arch: str, model: str, tokens: list[str], types: list[int],
                         pre: str | None = "default", merges: list[str] | None = None,
                         scores: list[float] | None = None, ids: dict[str, int] | None = None,
                         add_bos: bool | None = None, add_eos: bool | None = None,
                         template: str | None = TEMPLATE, add_space_prefix: bool | None = None) -> Path:
    """A GGUF holding `arch`'s basic metadata, this tokenizer and a one-row-per-token embedding:
    what transformers' and radixrt's readers of config and tokenizer need, no layers."""
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if scores is not None:
        writer.add_token_scores(scores)
    if merges is not None:
        writer.add_token_merges(merges)
    adders = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id, "unk": writer.add_unk_token_id,
              "pad": writer.add_pad_token_id}  # fmt: skip
    for name, index in (ids or {}).items():
        adders[name](index)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if add_eos is not None:
        writer.add_add_eos_token(add_eos)
    if template is not None:
        writer.add_chat_template(template)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), dtype=np.float32))
    return written(writer, path)


def _cases() -> dict[str, dict[str, Any]]:
    bpe_tokens, bpe_types, merges = byte_level_vocabulary()
    spm_tokens, spm_types, scores = sentencepiece_vocabulary()
    gemma_tokens, gemma_types, gemma_scores = sentencepiece_vocabulary(spaces=True)
    bpe = dict(model="gpt2", tokens=bpe_tokens, types=bpe_types, merges=merges)
    spm = dict(model="llama", tokens=spm_tokens, types=spm_types, scores=scores)
    gemma = dict(model="llama", tokens=gemma_tokens, types=gemma_types, scores=gemma_scores)
    # Llama 3's vocabulary has no <|endoftext|> (transformers appends one); a control token spelled
    # outside the byte alphabet (not added), a user-defined one with a space (not in the vocabulary)
    llama3_tokens = ["<|begin_of_text|>", *bpe_tokens[1:], "<｜end▁of▁sentence｜>", "<tool call>", "Ġthe"]
    llama3 = dict(bpe, tokens=llama3_tokens, types=[*bpe_types, CONTROL, USER_DEFINED, 1])
    spm_merges = [f"{t[:i]} {t[i:]}" for t in spm_tokens if t.startswith("\u2581")
                  for i in range(1, len(t)) if t[:i] in spm_tokens and t[i:] in spm_tokens][::3]  # fmt: skip
    # Gemma's own names for its special tokens, <mask> included (none appended)
    gemma_named = dict(gemma, tokens=["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", *gemma_tokens[3:]],
                       types=[CONTROL, CONTROL, CONTROL, 2, 1, *gemma_types[3:]],
                       scores=[0.0] * 5 + gemma_scores[3:])  # fmt: skip
    return {
        "llama-bpe": dict(bpe, arch="llama", pre="llama-bpe", ids=dict(bos=1, eos=2), add_bos=True),
        "llama3-tekken-eos": dict(llama3, arch="llama", pre="tekken", ids=dict(bos=0, eos=402), add_bos=True,
                                  add_eos=True),
        "qwen2": dict(bpe, arch="qwen2", pre="qwen2", ids=dict(bos=0, eos=2, pad=0), add_bos=False),
        # Qwen2's class adds its named tokens once more: a user-defined pad becomes special
        "qwen2-user-defined-pad": dict(bpe, arch="qwen2", pre="qwen2", ids=dict(eos=2, pad=len(bpe_tokens) - 2)),
        "qwen2-add-bos-without-bos": dict(bpe, arch="qwen2", pre="qwen2", ids=dict(eos=2), add_bos=True),
        "qwen3-default-pre": dict(bpe, arch="qwen3", pre="default", ids=dict(eos=2, unk=0), template=None),
        "qwen3-no-pre": dict(bpe, arch="qwen3", pre=None, ids=dict(eos=2, pad=0)),
        "llama-spm": dict(spm, arch="llama", ids=dict(bos=1, eos=2, unk=0)),
        "llama-spm-merges-eos": dict(spm, arch="llama", pre=None, merges=spm_merges, ids=dict(bos=1, eos=2, unk=0),
                                     add_eos=True),
        "phi3": dict(spm, arch="phi3", ids=dict(bos=1, eos=2, unk=0, pad=2), add_bos=False, add_eos=False),
        "phi3-end-token": dict(spm, arch="phi3", ids=dict(bos=1, eos=260, unk=0, pad=0)),
        "gemma2": dict(gemma, arch="gemma2", ids=dict(bos=1, eos=2, unk=0, pad=0), add_bos=True),
        "gemma3-eos": dict(gemma, arch="gemma3", ids=dict(bos=1, eos=2, unk=0, pad=0), add_bos=True, add_eos=True),
        "gemma3-named": dict(gemma_named, arch="gemma3", ids=dict(bos=2, eos=1, unk=3, pad=0), add_bos=True),
    }  # fmt: skip


CASES = _cases()


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-tokenizers")


# SmolLM2's real vocabulary (byte-level, 49152 tokens) as other families' files would state it
BUNDLED_AS = {
    "bundled-as-qwen2": dict(arch="qwen2", pre="qwen2", add_bos=False),
    "bundled-as-llama3": dict(arch="llama", pre="llama-bpe", add_bos=True, add_eos=True),
}


def bundled_vocabulary(arch: str, pre: str, **options: Any) -> dict[str, Any]:
    meta = GGUFFile(bundled_model_path()).metadata
    ids = dict(bos=meta["tokenizer.ggml.bos_token_id"], eos=meta["tokenizer.ggml.eos_token_id"],
               unk=meta["tokenizer.ggml.unknown_token_id"], pad=meta["tokenizer.ggml.padding_token_id"])  # fmt: skip
    return dict(arch=arch, model="gpt2", pre=pre, tokens=meta["tokenizer.ggml.tokens"],
                types=meta["tokenizer.ggml.token_type"], merges=meta["tokenizer.ggml.merges"], ids=ids,
                template=meta["tokenizer.chat_template"], **options)  # fmt: skip


@pytest.fixture(params=[*CASES, *BUNDLED_AS, "bundled"])
def tokenizer_file(request: pytest.FixtureRequest, gguf_dir: Path) -> Path:
    if request.param == "bundled":  # as shipped: pre-tokenizer "smollm", no bos added
        return bundled_model_path()
    path = gguf_dir / f"{request.param}.gguf"
    if not path.exists():
        options = CASES.get(request.param) or bundled_vocabulary(**BUNDLED_AS[request.param])
        write_tokenizer_gguf(path, **options)
    return path


def transformers_tokenizer(path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def no_transformers() -> None:
    pytest.fail("the tokenizer built from the metadata fell back to transformers")


def test_built_record_equals_transformers(tokenizer_file):
    theirs = transformers_tokenizer(tokenizer_file)
    expected = TokenizerRecord.of(theirs)
    record = tokenizer_record(GGUFFile(tokenizer_file))
    assert expected is not None and record is not None
    assert json.loads(record.backend_json) == json.loads(expected.backend_json)
    assert (record.chat_template, record.special_tokens_map, record.special_ids, record.all_special_ids) == (
        expected.chat_template, expected.special_tokens_map, expected.special_ids, expected.all_special_ids)
    ours = Tokenizer(record, no_transformers)
    for text in TEXTS:
        for add_special_tokens in (True, False):
            assert ours.encode(text, add_special_tokens=add_special_tokens) == theirs.encode(
                text, add_special_tokens=add_special_tokens), text
    ids = theirs.encode("".join(TEXTS), add_special_tokens=True) + theirs.all_special_ids + [len(theirs) - 1]
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            if theirs.chat_template is None:
                assert ours.chat_template is None
                continue
            assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt) == (
                theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids",
                 "special_tokens_map", "chat_template"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert len(ours) == len(theirs)


def test_a_built_tokenizer_serves_other_attributes_from_transformers(gguf_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    path = write_tokenizer_gguf(gguf_dir / "fallback.gguf", **CASES["llama-spm"])
    file = GGUFFile(path)
    config, hf_config, _ = gguf_loader.config_of(file)
    tokenizer = gguf_loader.tokenizer_of(file, hf_config, config)
    assert isinstance(tokenizer, Tokenizer) and tokenizer._transformers is None
    theirs = transformers_tokenizer(path)
    assert tokenizer.get_vocab() == theirs.get_vocab()
    assert tokenizer("hi there")["input_ids"] == theirs("hi there")["input_ids"]


@pytest.mark.parametrize("what, change, reason", [
    ("model", dict(model="bert"), "tokenizer model 'bert'"),
    ("pre", dict(pre="deepseek-llm"), "pre-tokenizer 'deepseek-llm'"),
    ("merges", dict(merges=None), "a byte-level vocabulary without merges"),
    ("merge", dict(merges=["Ġ t", "Ġ zzz"]), "the metadata did not build one: Error while initializing BPE"),
    ("bos", dict(ids=dict(bos=10**6)), "the metadata did not build one: list index out of range"),
])  # fmt: skip
def test_what_is_not_reproduced_is_left_to_transformers_and_said(what, change, reason, gguf_dir, caplog):
    path = write_tokenizer_gguf(gguf_dir / f"not-{what}.gguf", **{**CASES["llama-bpe"], **change})
    with caplog.at_level(logging.INFO, logger="radixrt.model.gguf_tokenizer"):
        assert tokenizer_record(GGUFFile(path)) is None
    assert f"not-{what}.gguf: its tokenizer is read through transformers ({reason}" in caplog.text


def test_a_large_vocabulary_beside_a_config_json_is_left_to_transformers(tmp_path):
    """transformers checks a config.json beside a large vocabulary for Mistral's regex fix."""
    bundled = bundled_model_path()
    large = write_llama_gguf(tmp_path / "large.gguf", LlamaShape(num_layers=1, hidden=32, intermediate=32,
                                                                  num_heads=1, num_kv_heads=1, vocab=100_100),
                             tokenizer_from=bundled)  # fmt: skip
    assert tokenizer_record(GGUFFile(large)) is not None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    assert tokenizer_record(GGUFFile(large)) is None


_FIRST_LOAD = """
import sys
from radixrt.model import gguf_loader
from radixrt.model.loader import load_model

if sys.argv[2] == "recorded":  # the record must serve this start: building the tokenizer again fails
    def refuse(file):
        raise AssertionError("the tokenizer was built again")
    gguf_loader.tokenizer_record = refuse
loaded = load_model(sys.argv[1], dtype="float32")
ids = loaded.tokenizer.encode("hello there, naïve 東京 12345")
assert loaded.tokenizer.decode(ids) == "hello there, naïve 東京 12345", loaded.tokenizer.decode(ids)
print(ids, "transformers" in sys.modules)
"""


def test_first_load_of_a_gguf_does_not_import_transformers_and_records_it(tmp_path):
    path = write_llama_gguf(tmp_path / "model.gguf", LlamaShape(num_layers=1, hidden=64, intermediate=64))
    env = {**os.environ, CACHE_ENV_VAR: str(tmp_path / "cache")}
    runs = [subprocess.run([sys.executable, "-c", _FIRST_LOAD, str(path), start], env=env, capture_output=True,
                           text=True, check=True).stdout.strip()
            for start in ("first", "recorded")]  # fmt: skip
    expected = transformers_tokenizer(path).encode("hello there, naïve 東京 12345")
    assert runs == [f"{expected} False"] * 2
    assert [p.name for p in (tmp_path / "cache").rglob("*.json")] == [record_path(GGUFFile(path)).name]


def test_a_file_the_builder_does_not_cover_loads_through_transformers(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "cache"))
    tokens, types, merges = byte_level_vocabulary()
    source = write_tokenizer_gguf(tmp_path / "source.gguf", "llama", "gpt2", tokens, types, pre="deepseek-llm",
                                  merges=merges, ids=dict(bos=1, eos=2, unk=0, pad=0), add_bos=False,
                                  add_space_prefix=False)  # fmt: skip
    shape = LlamaShape(num_layers=1, hidden=64, intermediate=64, vocab=len(tokens))
    path = write_llama_gguf(tmp_path / "uncovered.gguf", shape, tokenizer_from=source)
    with caplog.at_level(logging.INFO, logger="radixrt.model.gguf_tokenizer"):
        loaded = load_model(path, dtype="float32")
    assert "uncovered.gguf: its tokenizer is read through transformers (pre-tokenizer 'deepseek-llm')" in caplog.text
    theirs = transformers_tokenizer(path)
    for text in TEXTS:
        assert loaded.tokenizer.encode(text) == theirs.encode(text), text
    record = read_record(GGUFFile(path))
    assert record is not None and record.tokenizer == TokenizerRecord.of(theirs)
