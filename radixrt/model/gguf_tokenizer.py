"""A GGUF file's tokenizer built from its metadata with the `tokenizers` library alone.

A GGUF has no `tokenizer.json`: llama.cpp stores the vocabulary, merges, scores, token types
and special ids as metadata. transformers turns these into a fast tokenizer in two layers, and
`tokenizer_record` builds the same `tokenizers.Tokenizer` (and the `TokenizerRecord` that
`TokenizerRecord.of` takes from transformers' tokenizer) without importing transformers:

    inner   the vocabulary class of `tokenizer.ggml.model`, built over the file's vocabulary:
              "gpt2"  byte-level BPE (tokens outside the byte alphabet respelled as its bytes),
                      the file's merges; named tokens <|endoftext|>
              "llama" sentencepiece-style BPE with byte fallback, merges from the file or, where
                      it has none, recovered from the vocabulary ordered by score; then by
                      architecture: Llama's Metaspace (prefix space on the first word only);
                      Phi-3's prefix space as a normalizer; Gemma's spaces kept as pieces (runs
                      of spaces respelled, merges ordered by position); named tokens <unk> <s>
                      </s> (Gemma: <bos> <eos> <unk> <pad> <mask>)
            the named tokens are added as special tokens (appended where the vocabulary lacks
            them); CONTROL tokens (type 3) are added as special tokens (a byte-level one spelled
            outside the byte alphabet is skipped), USER_DEFINED ones (type 4) that are in the
            vocabulary as plain added tokens; a `tokenizer.ggml.pre` with a known split regex
            replaces the pre-tokenizer by that split then byte-level
    outer   the model family's tokenizer class: bos/eos/unk/pad are the file's tokens at
            `tokenizer.ggml.*_token_id` (Gemma's class adds <mask>); any not yet an added token
            is added as a special one (Qwen's class adds them all once more, which makes a
            user-defined one special); the post-processor puts bos first if
            `tokenizer.ggml.add_bos_token` (true by default for "llama" vocabularies) and eos
            last if `add_eos_token`, where the file names that token; the chat template is
            `tokenizer.chat_template`

Where the file says something this module does not reproduce exactly, `tokenizer_record`
returns None and says why at INFO, and the loader reads the tokenizer through transformers: a
tokenizer model other than "gpt2" and "llama", an architecture outside `gguf_families`, a
byte-level vocabulary without merges, a `tokenizer.ggml.pre` that is neither a known split nor
one whose llama.cpp regex is GPT-2's (transformers gives every other name GPT-2's split too,
which this module does not follow blindly), metadata that does not build a tokenizer, and a
large vocabulary beside a `config.json` (transformers may patch Mistral's split regex from
it). The tables follow the installed transformers' GGUF conversion; tests/test_gguf_tokenizer.py
holds the result equal to it for each kind of vocabulary.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

from radixrt.model.gguf_file import GGUFFile
from radixrt.model.tokenizer import TokenizerRecord

logger = logging.getLogger(__name__)

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types
_SPACE_PIECE = "\u2581"
# The class transformers tokenizes each architecture with: its named special tokens beyond
# bos/eos/unk/pad (the file sets those four), and whether it adds its special tokens once more.
_OUTER_MASK = {"gemma2": "<mask>", "gemma3": "<mask>"}
_OUTER_READDS = ("qwen2", "qwen3")
_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
# The named special tokens of each vocabulary class, in transformers' attribute order
# (bos, eos, unk, sep, pad, cls, mask): added to the vocabulary before the file's own.
_GPT2_NAMED = ("<|endoftext|>",)
_LLAMA_NAMED = ("<s>", "</s>", "<unk>")
_GEMMA_NAMED = ("<bos>", "<eos>", "<unk>", "<pad>", "<mask>")
_SPECIAL_ID_KEYS = (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                    ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))  # fmt: skip
# transformers patches the split regex of a Mistral tokenizer this large (`config.json` beside the file)
_MISTRAL_PATCH_VOCAB = 100000

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> the split regex transformers pre-tokenizes with (then byte-level)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}  # fmt: skip
# Pre-tokenizers whose llama.cpp regex is GPT-2's, the one transformers keeps without a split of its
# own (a file without the key too); any other is refused rather than silently given GPT-2's.
DEFAULT_PRE_TOKENIZERS = (None, "default", "gpt-2", "smollm")


class NotReproduced(Exception):
    """The file's tokenizer is one `tokenizer_record` does not build as transformers does (the reason)."""


def tokenizer_record(file: GGUFFile) -> TokenizerRecord | None:
    """The record of the tokenizer transformers builds from `file`'s metadata, or None (the reason
    logged at INFO) where this module does not reproduce it."""
    try:
        return _record(file)
    except NotReproduced as reason:
        logger.info("%s: its tokenizer is read through transformers (%s)", file.path.name, reason)
    except Exception as error:  # noqa: BLE001 - `tokenizers` raises plain Exception (a merge of unknown tokens)
        logger.info("%s: its tokenizer is read through transformers (the metadata did not build one: %s)",
                    file.path.name, error)
    return None


def _record(file: GGUFFile) -> TokenizerRecord:
    from tokenizers import AddedToken

    meta = file.metadata
    arch, model = file.architecture, meta.get("tokenizer.ggml.model")
    if arch not in _ARCHITECTURES:
        raise NotReproduced(f"architecture {arch!r}")
    if model not in ("gpt2", "llama"):
        raise NotReproduced(f"tokenizer model {model!r}")
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZER_SPLITS and pre not in DEFAULT_PRE_TOKENIZERS:
        raise NotReproduced(f"pre-tokenizer {pre!r}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: Sequence[int] = meta.get("tokenizer.ggml.token_type") or ()
    named: tuple[str, ...]
    if model == "gpt2":
        backend, named = _byte_level(tokens, meta.get("tokenizer.ggml.merges")), _GPT2_NAMED
    elif arch in ("gemma2", "gemma3"):
        backend, named = _gemma(tokens, meta.get("tokenizer.ggml.merges")), _GEMMA_NAMED
    else:
        backend, named = _sentencepiece(tokens, meta.get("tokenizer.ggml.merges"), meta.get("tokenizer.ggml.scores"),
                                        phi3=arch == "phi3"), _LLAMA_NAMED  # fmt: skip
    _add_missing_specials(backend, named)
    _add_file_specials(backend, tokens, token_types, byte_level=model == "gpt2")
    split = PRE_TOKENIZER_SPLITS.get(pre) if isinstance(pre, str) else None
    if split is not None:
        from tokenizers import Regex, pre_tokenizers

        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip

    special: dict[str, str | None] = {}
    for name, key in _SPECIAL_ID_KEYS:
        index = meta.get(f"tokenizer.ggml.{key}")
        special[name] = None if index is None else tokens[index]
    if arch in _OUTER_MASK:
        special["mask_token"] = _OUTER_MASK[arch]
    named_tokens = [token for token in special.values() if token is not None]
    _add_missing_specials(backend, named_tokens)
    if arch in _OUTER_READDS:
        backend.add_tokens([AddedToken(token, special=True) for token in dict.fromkeys(named_tokens)])
    if backend.get_vocab_size() > _MISTRAL_PATCH_VOCAB and (file.path.parent / "config.json").exists():
        raise NotReproduced("a large vocabulary beside a config.json, which transformers checks for Mistral's regex")

    add_bos = meta.get("tokenizer.ggml.add_bos_token", model == "llama")
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
    ids = {name: None if token is None else backend.token_to_id(token) for name, token in special.items()}
    backend.post_processor = _post_processor(special["bos_token"] if add_bos else None, ids["bos_token"],
                                             special["eos_token"] if add_eos else None, ids["eos_token"])  # fmt: skip
    backend.no_truncation()
    backend.no_padding()
    template = meta.get("tokenizer.chat_template")
    ordered = ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token")
    special_tokens = [special[name] for name in ordered if special.get(name) is not None]
    return TokenizerRecord(
        backend_json=backend.to_str(),
        chat_template=template if isinstance(template, str) else None,
        special_tokens_map={name: token for name in ordered if (token := special.get(name)) is not None},
        special_ids={f"{name}_id": ids[name] for name in ("bos_token", "eos_token", "pad_token", "unk_token")},
        all_special_ids=[backend.token_to_id(token) for token in dict.fromkeys(special_tokens)],
    )


def _byte_level(tokens: list[str], merges: list[str] | None) -> Any:
    """GPT-2's byte-level BPE over the file's vocabulary (a token outside the byte alphabet is
    respelled as its UTF-8 bytes in it) and merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if merges is None:
        raise NotReproduced("a byte-level vocabulary without merges")
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
             for index, token in enumerate(tokens)}  # fmt: skip
    backend = Tokenizer(models.BPE(vocab=vocab, merges=_pairs(merges), dropout=None, continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False))  # fmt: skip
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(tokens: list[str], merges: list[str] | None, scores: list[float] | None, phi3: bool) -> Any:
    """Llama's sentencepiece-style BPE (byte fallback, a prefix space on the first word); Phi-3's
    prefix space comes from a normalizer instead, before every text."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {token: index for index, token in enumerate(tokens)}
    if merges is not None:
        pairs = _pairs(merges)
    elif scores is None:
        raise NotReproduced("a sentencepiece vocabulary with neither merges nor scores")
    else:
        pairs = _recovered_merges(vocab, dict(zip(tokens, scores)))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, dropout=None))
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE_PIECE, prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE_PIECE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1)])  # fmt: skip
    if phi3:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(prepend=_SPACE_PIECE),
                                                   normalizers.Replace(pattern=" ", content=_SPACE_PIECE)])  # fmt: skip
        backend.pre_tokenizer = None
    return backend


def _gemma(tokens: list[str], merges: list[str] | None) -> Any:
    """Gemma's sentencepiece-style BPE: a token of whitespace with a space in it is stored as spaces
    and looked up as that many "\u2581"; merges recovered in the file's order (its scores are not its
    merge order)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    respelled = [_SPACE_PIECE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(respelled)}
    if merges is not None:
        pairs = _pairs(merges)
    else:
        pairs = _recovered_merges(vocab, {token: -index for index, token in enumerate(respelled)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, unk_token="<unk>", dropout=None,
                                   byte_fallback=True))  # fmt: skip
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE_PIECE, " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.normalizer = normalizers.Replace(" ", _SPACE_PIECE)
    return backend


def _pairs(merges: list[str]) -> list[tuple[str, str]]:
    pairs = [tuple(merge.split(" ")) for merge in merges]
    if any(len(pair) != 2 for pair in pairs):
        raise NotReproduced("a merge that is not two tokens separated by one space")
    return pairs  # type: ignore[return-value]


def _recovered_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a sentencepiece vocabulary implies: every split of a token into two tokens of the
    vocabulary, the best-scored token's first (ties: shorter left, then shorter right piece, then
    the pieces' ids), as transformers recovers them."""
    found: list[tuple[str, str, float]] = []
    for token, score in scores.items():
        splits = [(token[:i], token[i:], score) for i in range(1, len(token))
                  if token[:i] in vocab and token[i:] in vocab]  # fmt: skip
        splits.sort(key=lambda split: (vocab[split[0]], vocab[split[1]]))
        found.extend(splits)
    found.sort(key=lambda split: (split[2], len(split[0]), len(split[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_missing_specials(backend: Any, named: Sequence[str]) -> None:
    """The named special tokens that are not added tokens yet, added as special ones (a token of
    the vocabulary keeps its id, another is appended)."""
    from tokenizers import AddedToken

    added = {token.content for token in backend.get_added_tokens_decoder().values()}
    missing = [token for token in dict.fromkeys(named) if token not in added]
    if missing:
        backend.add_tokens([AddedToken(token, special=True) for token in missing])


def _add_file_specials(backend: Any, tokens: list[str], token_types: Sequence[int], byte_level: bool) -> None:
    """CONTROL tokens as special added tokens (in a byte-level vocabulary only those spelled in its
    alphabet: another is a mislabel that would grow the vocabulary), then USER_DEFINED tokens that
    are in the vocabulary as plain added tokens, all matched whole in the text."""
    from tokenizers import AddedToken

    alphabet = set(_bytes_to_unicode().values()) if byte_level else None
    control = [AddedToken(token, normalized=False, special=True)
               for token, kind in zip(tokens, token_types)
               if kind == _CONTROL and (alphabet is None or set(token) <= alphabet)]  # fmt: skip
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab(with_added_tokens=True)
    user_defined = [AddedToken(token, normalized=False, special=False)
                    for token, kind in zip(tokens, token_types)
                    if kind == _USER_DEFINED and token in vocab]  # fmt: skip
    if user_defined:
        backend.add_tokens(user_defined)


def _post_processor(bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None) -> Any:
    """bos before the text and eos after it where given (each sequence of a pair too)."""
    from tokenizers import processors

    single = f"{f'{bos}:0 ' if bos else ''}$A:0{f' {eos}:0' if eos else ''}"
    pair = f"{single}{f' {bos}:1' if bos else ''} $B:1{f' {eos}:1' if eos else ''}"
    special = [(token, index) for token, index in ((bos, bos_id), (eos, eos_id)) if token]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the others for the characters from 256 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(code) for code in codes)))
