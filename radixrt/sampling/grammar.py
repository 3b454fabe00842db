"""Output constraints: regexes, JSON Schemas and grammars compiled into token masks (xgrammar).

    SamplingParams.regex | json_schema | ebnf | structural_tag
        ─► Grammars.compile (caller's thread, cached per constraint, time-limited)
        ─► Grammars.matcher: one `Matcher` per request (each of `n` samples its own)
        ─► per step: Matcher.fill_mask (the row's allowed tokens, a bitmask the sampler applies),
           Matcher.accept (the sampled token), Matcher.forced_tokens (jump-forward drafts)

The library (xgrammar) is behind this module alone; docs/structured.md says
why it was chosen and what each constraint accepts. A bitmask row holds one
bit per token of the model's vocabulary (the logits' width), in 32-bit words,
token t at bit t % 32 of word t // 32; a set bit allows the token.
"""

from __future__ import annotations

import concurrent.futures
import functools
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

# A constraint that takes longer than this to compile is refused: an exponential regex or a
# huge enum must not hold a caller (or, through the queue, anyone else) for minutes.
COMPILE_TIMEOUT_S = 10.0
# Compiled grammars kept for reuse (a few hundred KB each for JSON Schemas).
CACHE_ENTRIES = 256


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask allowing every token: [rows, words] int32, every bit set."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """A bool vector (a multiple of 32 long) as bitmask words: [words] int32."""
    bits = allowed.view(-1, 32).to(torch.int64) << torch.arange(32)
    words = bits.sum(dim=1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


class Matcher:
    """One request's place in its grammar: which tokens may come next, and what the grammar forces.

    Not thread-safe; the engine thread is its only user once the request is queued.
    """

    def __init__(self, matcher: Any, encode: Callable[[str], Sequence[int]], vocab_size: int,
                 also_allowed: torch.Tensor | None = None):  # fmt: skip
        self._matcher = matcher
        self._encode = encode
        self._vocab_size = vocab_size
        self._also_allowed = also_allowed

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (an int32 [rows, words] CPU tensor)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._also_allowed is not None:
            bitmask[row] &= self._also_allowed

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False (and no change) when the grammar does not allow it."""
        return bool(self._matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if num_tokens:
            self._matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""
        return bool(self._matcher.is_terminated())

    @property
    def forces_text(self) -> bool:
        """Whether the grammar allows only one text next (at least one character of it)."""
        return bool(self._matcher.find_jump_forward_string())

    def forced_tokens(self, limit: int) -> list[int]:
        """At most `limit` tokens of the text the grammar allows as its only continuation, as the
        tokenizer writes that text alone: a draft the sampler checks token by token (jump-forward),
        so the tokenization never decides the output. Empty when the next text is not forced."""
        if limit <= 0:
            return []
        text = self._matcher.find_jump_forward_string()
        if not text:
            return []
        draft: list[int] = []
        for token_id in list(self._encode(text))[:limit]:
            if not 0 <= token_id < self._vocab_size or not self._matcher.accept_token(token_id):
                break
            draft.append(token_id)
        self.rollback(len(draft))
        return draft


class Grammars:
    """Compiles constraints for one tokenizer and vocabulary, and makes matchers for requests.

    Thread-safe: callers' threads compile concurrently. The tokenizer's preparation for the
    library happens once, on the first constrained request (`prepare` does it at will).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Collection[int],
                 compile_timeout_s: float = COMPILE_TIMEOUT_S):  # fmt: skip
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._info: Any = None
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._json_mask: torch.Tensor | None = None
        # Compiles run here so a caller can stop waiting for one; a runaway compile keeps its
        # worker until it ends, so there are few workers and a request finds them busy quickly.
        self._workers = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="radixrt-grammar")

    def prepare(self) -> Any:
        """The library's compiler for this tokenizer (built once: it reads the whole vocabulary)."""
        with self._lock:
            if self._compiler is None:
                import xgrammar

                self._info = _tokenizer_info(xgrammar, self.tokenizer, self.vocab_size, self.stop_token_ids)
                self._compiler = xgrammar.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, kind: str, text: str) -> Any:
        """The compiled grammar of one constraint (cached); ValueError naming `kind` when the library
        refuses it or it takes longer than the time limit."""
        key = (kind, text)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        compiler = self.prepare()
        future = self._workers.submit(_compile, compiler, kind, text)
        try:
            compiled = future.result(timeout=self.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            raise ValueError(
                f"{kind}: compiling it took longer than {self.compile_timeout_s:g} s (the limit); "
                "simplify it (fewer alternatives, smaller repeats or enums)"
            ) from None
        except (RuntimeError, ValueError) as error:  # the library's parse and schema errors
            raise ValueError(f"{kind} is not valid: {_message(error)}") from None
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > CACHE_ENTRIES:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, compiled: Any, kind: str = "") -> Matcher:
        """A new matcher at the start of `compiled`, the grammar of a constraint of `kind`."""
        import xgrammar

        also_allowed = self._json_tokens() if kind == "json_schema" else None
        return Matcher(xgrammar.GrammarMatcher(compiled), self._encode, self.vocab_size, also_allowed)

    def _json_tokens(self) -> torch.Tensor:
        """The tokens without a control character (bytes 0-31): JSON text never holds one raw, and
        xgrammar 0.2.8 lets them into strings with a `maxLength`."""
        with self._lock:
            if self._json_mask is None:
                allowed = torch.ones(bitmask_words(self.vocab_size) * 32, dtype=torch.bool)
                for token, text in enumerate(self._info.decoded_vocab[: self.vocab_size]):
                    allowed[token] = not any(byte < 32 for byte in text)
                self._json_mask = pack_bits(allowed)
            return self._json_mask

    def _encode(self, text: str) -> Sequence[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def _compile(compiler: Any, kind: str, text: str) -> Any:
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "json_schema":
        return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
    if kind == "ebnf":
        return compiler.compile_grammar(text)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(text)
    raise ValueError(f"unknown constraint {kind!r}")


def _message(error: BaseException) -> str:
    """The library's message without its log prefix ("[18:43:19] /project/cpp/file.cc:83: ")."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0]) if lines else type(error).__name__


def _tokenizer_info(xgrammar: Any, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> Any:
    """xgrammar's view of the tokenizer: every token's text, by id, and how the vocabulary is encoded.

    radixrt's own `Tokenizer` carries the `tokenizers` backend transformers built, which is all
    the library reads; going through it avoids building a transformers tokenizer (seconds).
    """
    stops = list(stop_token_ids) or None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(xgrammar.TokenizerInfo, "_detect_metadata_from_hf"):
        return xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
    vocab = backend.get_vocab(with_added_tokens=True)
    encoded = [""] * vocab_size
    for token, index in vocab.items():
        if index < vocab_size:
            encoded[index] = token
    metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgrammar.TokenizerInfo(encoded, vocab_type=metadata["vocab_type"], vocab_size=vocab_size,
                                  stop_token_ids=stops, add_prefix_space=metadata["add_prefix_space"])  # fmt: skip


@functools.lru_cache(maxsize=1)
def library_version() -> str:
    from importlib.metadata import version

    return f"xgrammar {version('xgrammar')}"
