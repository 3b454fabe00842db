"""Runs one state's operations in order: inline, or on a worker thread.

A program's own state runs inline: `s += gen(...)` returns when the text is
there, so the program reads like ordinary code and an error raises at its
line. Fork branches (and the root of a streamed run) are threaded: `+=`
queues the operation and returns at once, so `for f in forks: f += gen(...)`
starts every branch's gen before any finishes and the runtime batches them.
Reads wait until the queue is empty.

A threaded executor's worker exists only while operations are queued, so an
idle state holds no thread. When an operation fails the executor drops the
rest of its queue and keeps the error; every later read or `+=` raises
ProgramError from it (the worker cannot raise into the program's thread).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable


class ProgramError(RuntimeError):
    """A program, or one of its fork branches, failed; the original error is the __cause__."""


class Executor:
    """Applies operations in submission order; shares `changed` with the state's context."""

    def __init__(self, threaded: bool, changed: threading.Condition, label: str):
        self.threaded = threaded
        self._changed = changed
        self._label = label
        self._queue: deque[Callable[[], object]] = deque()
        self._busy = False
        self.error: BaseException | None = None
        self.error_reported = False  # raised to some reader, so the end of the program need not

    def submit(self, operation: Callable[[], object]) -> None:
        """Run `operation` now (inline) or queue it (threaded); what it returns is dropped."""
        self.raise_if_failed()
        if not self.threaded:
            operation()
            return
        with self._changed:
            self._queue.append(operation)
            if not self._busy:
                self._busy = True
                threading.Thread(target=self._drain, name=f"radixrt-{self._label}", daemon=True).start()

    def fail(self, error: BaseException) -> None:
        """Record that the state's program failed with `error` (the first error wins)."""
        with self._changed:
            if self.error is None:
                self.error = error
            self._changed.notify_all()

    @property
    def idle(self) -> bool:
        return not self._busy

    def wait(self) -> None:
        """Block until every submitted operation has run; raise ProgramError if one failed."""
        self.wait_idle()
        self.raise_if_failed()

    def wait_idle(self) -> None:
        with self._changed:
            while self._busy:
                self._changed.wait()

    def raise_if_failed(self) -> None:
        failure = self.failure()
        if failure is not None:
            raise failure

    def failure(self) -> ProgramError | None:
        """A ProgramError caused by the recorded error (None if none); counts as reported."""
        error = self.error
        if error is None:
            return None
        self.error_reported = True
        failure = ProgramError(f"the {self._label} failed: {type(error).__name__}: {error}")
        failure.__cause__ = error
        return failure

    def _drain(self) -> None:
        while True:
            with self._changed:
                if not self._queue or self.error is not None:
                    self._queue.clear()
                    self._busy = False
                    self._changed.notify_all()
                    return
                operation = self._queue.popleft()
            try:
                operation()
            except BaseException as error:  # kept for the reader: a worker has no caller to raise to
                self.fail(error)
