r"""Token ids to streamed text: incremental detokenization and stop strings.

A request's `OutputText` (in `request.py`) chains the two pieces here to turn
sampled tokens into the text a user may see so far. Two things are held back
until they are decided (here with the stop string "\nQ:"):

    tokens:  "The" " answer" ":" " 42" "\n"  "\xf0\x9f" (half an emoji)
    text:    The answer: 42          \n      U+FFFD
             └── streamed ────────┘  │       └ held by IncrementalDetokenizer
                                     │         until the last bytes arrive
                                     └ held by StopStringMatcher: may begin
                                       "\nQ:"; the next text decides

The request owns the token ids (output_ids includes a stop or EOS token); the
text never includes a stop token, a matched stop string, or anything after it.

`make_detokenizer` picks the implementation: for a fast (Rust) tokenizer
`StreamDetokenizer`, which runs the same window technique inside the
`tokenizers` library (several times cheaper per token, docs/benchmarks.md), and
`IncrementalDetokenizer` otherwise and wherever the fast path would differ.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from radixrt.model.tokenizer import Tokenizer as RecordedTokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# Prompt tokens decoded in front of the output: tokenizers that drop the
# leading space of the first token (SentencePiece) need a left context.
_CONTEXT_TOKENS = 5

# An incomplete character is held back at most this many tokens: a valid
# UTF-8 character spans at most 4 byte tokens, so only invalid output gets
# here, and the bound keeps the decoded window, hence the cost per token, O(1).
_MAX_HELD_TOKENS = 16

_REPLACEMENT = "\ufffd"


class TokenDecoder(Protocol):
    """The one tokenizer method the detokenizer needs (any transformers tokenizer has it)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ..., **kwargs: Any) -> str: ...


class Detokenizer(Protocol):
    """Token ids in, stable text out: what `OutputText` feeds."""

    def append(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


def make_detokenizer(
    tokenizer: TokenDecoder, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True
) -> Detokenizer:
    """The fastest detokenizer whose text equals `IncrementalDetokenizer`'s for this tokenizer."""
    backend = _rust_tokenizer(tokenizer)
    if backend is not None:
        context = list(prompt_ids[-_CONTEXT_TOKENS:]) if prompt_ids else []
        # A context ending inside a character would be streamed again as output
        # (DecodeStream only takes a context that decodes completely).
        if not backend.decode(context, skip_special_tokens=skip_special_tokens).endswith(_REPLACEMENT):
            return StreamDetokenizer(tokenizer, backend, context, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)


def _rust_tokenizer(tokenizer: TokenDecoder) -> Tokenizer | None:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer (or our `Tokenizer`), or None.

    None as well for subclasses that override decoding (whisper, marian, ...):
    their text is more than the Rust decode. Looking the class up in
    `sys.modules` avoids importing transformers for a tokenizer that is not one.
    """
    if isinstance(tokenizer, RecordedTokenizer):  # its decode is the Rust decode
        return tokenizer.backend_tokenizer
    module = sys.modules.get("transformers.tokenization_utils_tokenizers")
    fast_class = getattr(module, "TokenizersBackend", None)
    if fast_class is None or not isinstance(tokenizer, fast_class):
        return None
    own_class = type(tokenizer)
    if own_class.decode is not fast_class.decode or own_class._decode is not fast_class._decode:
        return None
    return tokenizer.backend_tokenizer


class IncrementalDetokenizer:
    """Decodes one token at a time, returning only text that later tokens cannot change.

    The prefix-offset/read-offset technique: each step decodes the short window
    ids[prefix_offset:] and emits what it adds to the text of
    ids[prefix_offset:read_offset], so the cost per token does not grow with
    the output. Text ending in U+FFFD (a character whose remaining bytes are in
    later tokens) is held back, and so is a token that adds no text (a skipped
    special token): were it the next window's only context, a SentencePiece
    decoder would drop the leading space of the token after it. The
    concatenated chunks plus `flush()` equal
    `tokenizer.decode(ids, skip_special_tokens, clean_up_tokenization_spaces=False)`
    when decoding is byte-wise (byte-level BPE) and no character stays
    incomplete for `_MAX_HELD_TOKENS` tokens.
    """

    def __init__(
        self, tokenizer: TokenDecoder, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True
    ):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:]) if prompt_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_len = len(self._decode(self._ids))

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def append(self, token_id: int) -> str:
        """Add one token; return the newly stable text (often '')."""
        self._ids.append(token_id)
        text = self._decode(self._ids[self._prefix_offset :])
        undecided = text.endswith(_REPLACEMENT) or len(text) <= self._prefix_len
        if undecided and len(self._ids) - self._read_offset < _MAX_HELD_TOKENS:
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """The held-back text, once no more tokens will come (a trailing U+FFFD stays)."""
        if self._read_offset == len(self._ids):
            return ""
        return self._advance(self._decode(self._ids[self._prefix_offset :]))

    def _advance(self, text: str) -> str:
        chunk = text[self._prefix_len :]
        # The emitted tokens become the next window's context; older ones are dropped.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._prefix_len = len(self._decode(self._ids))
        return chunk


class StreamDetokenizer:
    """`IncrementalDetokenizer`'s output, computed by `tokenizers.decoders.DecodeStream`.

    DecodeStream runs the same prefix/read-offset windows in Rust, one call
    per token, and releases the same chunks. It has no `flush` and holds an
    incomplete character forever, so the tokens it holds since its last chunk
    are kept here too: at `flush`, after `_MAX_HELD_TOKENS` held tokens, or if
    it raises (a decoder whose text for a window does not extend the text of
    the window's front), an `IncrementalDetokenizer` takes over from the last
    released chunk and replays them.
    """

    def __init__(self, tokenizer: TokenDecoder, backend: Tokenizer, context: list[int], skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._released = context  # tokens of the last released chunk (or the prompt's tail)
        self._held: list[int] = []
        self._fallback: IncrementalDetokenizer | None = None

    def append(self, token_id: int) -> str:
        """Add one token; return the newly stable text (often '')."""
        if self._fallback is not None:
            return self._fallback.append(token_id)
        self._held.append(token_id)
        try:
            chunk = self._stream.step(self._backend, token_id)
        except Exception:  # tokenizers raises a bare Exception for a prefix that changed
            return self._hand_over()
        if chunk is not None:
            self._released, self._held = self._held, []
            return chunk
        return self._hand_over() if len(self._held) >= _MAX_HELD_TOKENS else ""

    def flush(self) -> str:
        """The held-back text, once no more tokens will come (a trailing U+FFFD stays)."""
        if self._fallback is None:
            if not self._held:
                return ""
            return self._hand_over() + self.flush()  # the replay sets _fallback
        return self._fallback.flush()

    def _hand_over(self) -> str:
        self._fallback = IncrementalDetokenizer(self._tokenizer, self._released, self._skip_special_tokens)
        return "".join([self._fallback.append(token_id) for token_id in self._held])


class StopStringMatcher:
    """Cuts streamed text at the first stop string, holding back what may begin one.

    "First" is the stop occurrence that ends earliest in the text (the longest
    one if several end there), which is what streaming sees first, so the
    result does not depend on how the text was chunked. A stop string may span
    any number of chunks.
    """

    def __init__(self, stops: Sequence[str], keep_stop: bool = False):
        if isinstance(stops, str) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stops must be a sequence of non-empty strings, got {stops!r}")
        self._stops = tuple(stops)
        self._keep_stop = keep_stop  # no_stop_trim: the matched stop string stays in the text
        self._prefixes = frozenset(s[:i] for s in self._stops for i in range(1, len(s)))
        self._longest_prefix = max((len(s) - 1 for s in self._stops), default=0)
        self._streamed: list[str] = []
        self._pending = ""
        self.matched: str | None = None

    @property
    def text(self) -> str:
        """Everything released so far."""
        if len(self._streamed) > 1:
            self._streamed = ["".join(self._streamed)]
        return self._streamed[0] if self._streamed else ""

    def feed(self, text: str) -> str:
        """Add text; return the part that can be streamed now ('' after a match)."""
        if self.matched is not None or not text:
            return ""
        pending = self._pending + text
        start, matched = self._first_stop(pending)
        if matched is not None:
            self.matched, self._pending = matched, ""
            return self._release(pending[: start + len(matched) if self._keep_stop else start])
        hold = self._held_length(pending)
        self._pending = pending[len(pending) - hold :]
        return self._release(pending[: len(pending) - hold])

    def feed_unmatched(self, text: str) -> str:
        """Add text that no stop may match in (before min_new_tokens); release it with what was held."""
        if self.matched is not None:
            return ""
        pending, self._pending = self._pending + text, ""
        return self._release(pending)

    @property
    def seen(self) -> str:
        """Everything fed so far and not cut: the released text and the held-back tail."""
        return self.text + self._pending

    def cut(self, end: int, matched: str) -> str:
        """End the text at `end` in `seen` (a stop found outside this matcher, e.g. a stop_regex):
        release what lies before it; text already released past `end` is dropped from `text`
        (the stream has sent it, the final text does not have it)."""
        released = self.text
        self.matched = matched
        tail, self._pending = self.seen[len(released) : max(end, len(released))], ""
        if end < len(released):
            self._streamed = [released[:end]]
            return ""
        return self._release(tail)

    def flush(self) -> str:
        """Release the held-back tail: no more text will come, so it cannot become a stop."""
        pending, self._pending = self._pending, ""
        return self._release(pending)

    def _release(self, text: str) -> str:
        if text:
            self._streamed.append(text)
        return text

    def _first_stop(self, text: str) -> tuple[int, str | None]:
        # Only `text` needs searching: an occurrence that began earlier would
        # have a longer held-back prefix than the one kept.
        best_end, best_start, best = len(text) + 1, 0, None
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0 and (start + len(stop), start) < (best_end, best_start):
                best_end, best_start, best = start + len(stop), start, stop
        return best_start, best

    def _held_length(self, text: str) -> int:
        for length in range(min(len(text), self._longest_prefix), 0, -1):
            if text[-length:] in self._prefixes:
                return length
        return 0
