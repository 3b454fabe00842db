"""What a program has produced so far, as text and as the token ids the model saw.

Why token ids and not just text: the radix tree matches token ids, so the
prompt of each model call must extend the previous call's prompt plus its
output *token by token* for the cache to hit. Re-tokenizing the whole text
at every call does not guarantee that: BPE can merge across the junction of
the old text and the new piece, or tokenize the model's output differently
from how the model produced it, and one changed token early on invalidates
the whole cached suffix. So the context keeps a running list of ids:

    ids = tokenize(text piece 1) + output ids of gen 1 + tokenize(text piece 2) + ...

Text appended between two model calls is tokenized together (one piece,
`add_special_tokens=False`) when the next call needs the prompt; a `gen`
appends the ids the model produced, so the next prompt is exactly the
sequence the tree cached for that gen. Fork branches copy the ids, so they
share the prefix exactly too.

Thread rule: one thread at a time mutates a context (the state's executor);
readers wait until the state is idle, except text_iter, which reads the text
pieces under `changed` while they grow.
"""

from __future__ import annotations

import threading
from typing import Any


class ProgramContext:
    """The text, token ids, variables and chat messages of one program state."""

    def __init__(self, runtime: Any):
        self.runtime = runtime
        self.changed = threading.Condition()  # notified on every new piece and variable
        self.pieces: list[tuple[str | None, str]] = []  # (variable the text belongs to, or None; text)
        self.ids: list[int] = []
        self.pending_text = ""  # appended since the last model call, not tokenized yet
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.messages: list[dict[str, str]] = []
        self.assigned: list[str] = []  # variables set since this context was forked

    # --- writing (the executing thread) ------------------------------------------
    def append_text(self, text: str, variable: str | None = None) -> None:
        """Add text whose tokens come from tokenizing it with the rest of the pending text."""
        self.show(text, variable)
        self.tokenize_later(text)

    def show(self, text: str, variable: str | None = None) -> None:
        """Add text to what readers see; its tokens are added separately."""
        if text:
            with self.changed:
                self.pieces.append((variable, text))
                self.changed.notify_all()

    def tokenize_later(self, text: str) -> None:
        self.pending_text += text

    def append_ids(self, ids: list[int]) -> None:
        """Add tokens the model produced or scored, after the pending text's."""
        self.ids.extend(self._take_pending())
        self.ids.extend(ids)

    def prompt_ids(self) -> list[int]:
        """The ids of everything so far, tokenizing the pending text (a model call is about to use them)."""
        self.ids.extend(self._take_pending())
        return list(self.ids)

    def set_variable(self, name: str, value: Any, meta_info: Any) -> None:
        with self.changed:
            self.variables[name] = value
            self.meta_info[name] = meta_info
            if name not in self.assigned:
                self.assigned.append(name)
            self.changed.notify_all()

    def _take_pending(self) -> list[int]:
        if not self.pending_text:
            return []
        ids = self.runtime.tokenizer.encode(self.pending_text, add_special_tokens=False)
        self.pending_text = ""
        return list(ids)

    # --- reading -------------------------------------------------------------------
    def text(self) -> str:
        with self.changed:
            return "".join(text for _, text in self.pieces)

    def text_since(self, piece_index: int) -> str:
        with self.changed:
            return "".join(text for _, text in self.pieces[piece_index:])

    def token_ids(self) -> list[int]:
        """The ids the next model call would see, without committing the pending text."""
        if not self.pending_text:
            return list(self.ids)
        return self.ids + list(self.runtime.tokenizer.encode(self.pending_text, add_special_tokens=False))

    def fork(self) -> ProgramContext:
        """A copy for a branch; call prompt_ids() first so every branch shares the same ids."""
        assert not self.pending_text, "fork a context only after tokenizing its pending text"
        child = ProgramContext(self.runtime)
        with self.changed:
            child.pieces = list(self.pieces)
            child.variables = dict(self.variables)
            child.meta_info = dict(self.meta_info)
        child.ids = list(self.ids)
        child.messages = [dict(m) for m in self.messages]
        return child
