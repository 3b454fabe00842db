"""Output constraints: regexes, JSON Schemas and grammars compiled into token masks (llguidance).

    SamplingParams.regex | json_schema | ebnf | structural_tag
        ─► Grammars.compile (caller's thread, cached per constraint, time-limited)
        ─► Grammars.matcher: one `Matcher` per request (each of `n` samples its own)
        ─► per step: Matcher.fill_mask (the row's allowed tokens, a bitmask the sampler applies),
           Matcher.accept (the sampled token), Matcher.forced_tokens (jump-forward drafts)

The library (llguidance, chosen over xgrammar by measurement: docs/structured.md) is behind
this module alone. A bitmask row holds one bit per token of the model's vocabulary (the logits'
width), in 32-bit words, token t at bit t % 32 of word t // 32; a set bit allows the token.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Collection, Iterable
from typing import Any

import torch

# A constraint that takes longer than this to compile is refused: an exponential regex or a
# huge enum must not hold a caller (or, through the queue, anyone else) for long.
COMPILE_TIMEOUT_S = 10.0
# Compiled grammars kept for reuse.
CACHE_ENTRIES = 256
# JSON as models write it (json.dumps' separators), with no room for runs of whitespace: a
# grammar that allowed any whitespace would let a model pad its output until its token limit.
JSON_FORMAT: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask allowing every token: [rows, words] int32, every bit set."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def disallow(words: torch.Tensor, token_ids: Iterable[int]) -> None:
    """Clear the bits of `token_ids` in one bitmask row (int32 words); ids past its width are ignored."""
    for token in token_ids:
        word, bit = divmod(token, 32)
        if word < words.numel():
            keep = ~(1 << bit)  # as an int32: bit 31's complement is 0x7FFFFFFF
            words[word] &= keep + (1 << 32) if keep < -(1 << 31) else keep


class Matcher:
    """One request's place in its grammar: which tokens may come next, and what the grammar forces.

    Not thread-safe; the engine thread is its only user once the request is queued.
    """

    def __init__(self, matcher: Any, vocab_size: int):
        self._matcher = matcher
        self._bytes = bitmask_words(vocab_size) * 4

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (an int32 [rows, words] CPU tensor,
        contiguous)."""
        if bitmask.dtype != torch.int32 or not bitmask.is_contiguous() or bitmask.shape[1] * 4 != self._bytes:
            raise ValueError(f"bitmask must be [rows, {self._bytes // 4}] int32 and contiguous, "
                             f"got {tuple(bitmask.shape)} {bitmask.dtype}")  # fmt: skip
        self._matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), self._bytes)
        if self._matcher.is_error():
            raise RuntimeError(f"grammar matcher failed: {self._matcher.get_error()}")

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it."""
        return bool(self._matcher.consume_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if num_tokens:
            self._matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete: nothing but EOS may follow."""
        return bool(self._matcher.is_stopped())

    @property
    def forces_text(self) -> bool:
        """Whether the grammar allows only one text next (at least one byte of it)."""
        return bool(self._matcher.compute_ff_bytes())

    def forced_tokens(self, limit: int) -> list[int]:
        """At most `limit` tokens of the text the grammar allows as its only continuation, as the
        tokenizer would write them whatever follows (the library holds back a last token that
        could still merge with the next): a draft the sampler checks token by token
        (jump-forward), so the drafted tokens never decide the output. Empty when nothing is forced."""
        if limit <= 0:
            return []
        return list(self._matcher.compute_ff_tokens()[:limit])


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
        self._library_tokenizer: Any = None
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        # Compiles run here so a caller can stop waiting for one; a runaway compile keeps its
        # worker until it ends, so there are few workers and a request finds them busy quickly.
        self._workers = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="radixrt-grammar")

    def prepare(self) -> Any:
        """The library's view of the tokenizer (built once: it reads the whole vocabulary)."""
        with self._lock:
            if self._library_tokenizer is None:
                self._library_tokenizer = _library_tokenizer(self.tokenizer, self.vocab_size, self.stop_token_ids)
            return self._library_tokenizer

    def compile(self, kind: str, text: str) -> Any:
        """The compiled grammar of one constraint (cached); ValueError naming `kind` when the library
        refuses it or it takes longer than the time limit."""
        key = (kind, text)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        tokenizer = self.prepare()
        future = self._workers.submit(_compile, tokenizer, kind, text, self.vocab_size)
        try:
            compiled = future.result(timeout=self.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            raise ValueError(
                f"{kind}: compiling it took longer than {self.compile_timeout_s:g} s (the limit); "
                "simplify it (fewer alternatives, smaller repeats or enums)"
            ) from None
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > CACHE_ENTRIES:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, compiled: Any) -> Matcher:
        """A new matcher at the start of `compiled` (what `compile` returned)."""
        with self._lock:  # a copy of the compiled matcher, which nobody advances
            return Matcher(compiled.deep_copy(), self.vocab_size)


def _compile(tokenizer: Any, kind: str, text: str, vocab_size: int) -> Any:
    """A matcher at the start of the constraint's grammar, its first mask computed (the library
    builds its lexer lazily: a grammar too costly to start on shows here, under the time limit)."""
    import llguidance

    try:
        if kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        elif kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_FORMAT)
        elif kind == "ebnf":
            grammar = llguidance.grammar_from("gbnf", text)
        elif kind == "structural_tag":
            grammar = _structural_tag_grammar(llguidance, text)
        else:
            raise ValueError(f"unknown constraint {kind!r}")
    except (ValueError, AssertionError) as error:
        raise ValueError(f"{kind} is not valid: {error}") from None
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(f"{kind} is not valid: {_message(matcher.get_error())}")
    Matcher(matcher.deep_copy(), vocab_size).fill_mask(new_bitmask(1, vocab_size), 0)
    return matcher


def _structural_tag_grammar(llguidance: Any, text: str) -> str:
    """SGLang's structural tag, {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}:
    free text in which each structure, once the text reaches a trigger its `begin` starts with,
    is `begin`, JSON valid under its `schema`, then `end`."""
    tag = json.loads(text)
    if not isinstance(tag, dict) or not isinstance(tag.get("structures"), list) or not tag["structures"]:
        raise ValueError('give {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}')
    triggers = tag.get("triggers") or []
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("triggers must be a list of non-empty strings")
    tags = []
    for index, structure in enumerate(tag["structures"]):
        if not isinstance(structure, dict) or not {"begin", "schema", "end"} <= set(structure):
            raise ValueError(f"structures[{index}] must have begin, schema and end")
        trigger = next((t for t in triggers if structure["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structures[{index}].begin {structure['begin']!r} starts with none of the triggers")
        schema = structure["schema"]
        schema = schema if isinstance(schema, dict) else json.loads(schema)
        schema = {**schema, "x-guidance": {**JSON_FORMAT, **schema.get("x-guidance", {})}}
        tags.append(llguidance.StructTag(trigger=trigger, begin=structure["begin"], grammar=schema,
                                         end=structure["end"]))  # fmt: skip
    return str(llguidance.StructTag.to_grammar(tags))


def _message(error: str) -> str:
    """The library's message, its first line (the rest is the grammar it was given)."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return lines[0] if lines else "the grammar library refused it"


def _library_tokenizer(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """llguidance's view of the tokenizer: built from the `tokenizers` backend that radixrt's own
    `Tokenizer` and transformers' fast tokenizers carry (no transformers tokenizer is built)."""
    import llguidance

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("output constraints need a fast (tokenizers-backed) tokenizer")
    eos = stop_token_ids or None
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)


@functools.lru_cache(maxsize=1)
def library_version() -> str:
    from importlib.metadata import version

    return f"llguidance {version('llguidance')}"
