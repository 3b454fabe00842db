"""`ProgramState`: the `s` a program appends to, reads from, and forks.

Execution model (executor.py has the details):

    program thread            s += "..."; s += gen("a")        inline: returns when done
        │ s.fork(3)           tokenizes the text so far, computes it once in the runtime
        ├── branch 0 worker   f += gen("x") ─┐                  threaded: += queues, returns
        ├── branch 1 worker   f += gen("x") ─┼─ run concurrently; the runtime batches them and
        └── branch 2 worker   f += gen("x") ─┘  every branch hits the shared prefix in the tree
        │ f["x"] / s.join(forks)              waits for the branch; raises its error

Every state of one run shares a `family` list of its branches, so the end
of the run can wait for all of them and report a branch error nobody read.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator, Sequence

from radixrt.lang.context import ProgramContext
from radixrt.lang.executor import Executor
from radixrt.lang.interpreter import apply, cache_prefix
from radixrt.lang.ir import check_expr


class ProgramState:
    """A program's text, token ids and variables; created by `Program.run` and `fork`."""

    def __init__(
        self,
        ctx: ProgramContext,
        *,
        threaded: bool,
        label: str = "program",
        parent: ProgramState | None = None,
        family: list[ProgramState] | None = None,
    ):
        self._ctx = ctx
        self._executor = Executor(threaded, ctx.changed, label)
        self._parent = parent
        self._family: list[ProgramState] = [] if family is None else family
        self._family_lock: threading.Lock = threading.Lock() if parent is None else parent._family_lock

    # --- writing -------------------------------------------------------------------
    def __iadd__(self, expr: Any) -> ProgramState:
        """Append text, gen(...), select(...) or a role block (queued on a fork branch)."""
        checked = check_expr(expr)
        self._executor.submit(lambda: apply(self._ctx, checked))
        return self

    def fork(self, n: int) -> list[ProgramState]:
        """n branches that continue from the state so far; their operations run concurrently.

        The text so far is tokenized once and (for n > 1) computed once in the
        runtime before the branches start, so each branch's first request finds
        the whole shared prefix in the radix tree.
        """
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"fork(n): n must be an int >= 1, got {type(n).__name__} {n!r}")
        if n < 1:
            raise ValueError(f"fork(n): n must be >= 1, got {n}")
        if n == 1:
            self._executor.submit(self._ctx.prompt_ids)
        else:
            self._executor.submit(lambda: cache_prefix(self._ctx))
        self._executor.wait()
        branches = [
            ProgramState(self._ctx.fork(), threaded=True, label=f"fork branch {i}", parent=self, family=self._family)
            for i in range(n)
        ]
        with self._family_lock:
            self._family.extend(branches)
        return branches

    def join(self, forks: Sequence[ProgramState]) -> None:
        """Wait for branches forked from this state; gather what they generated.

        Every variable a branch set after the fork becomes a list here, in
        the order of `forks` (None for a branch that did not set it), and so
        does its meta info: after `s.join(forks)`, `s["answer"]` holds each
        branch's answer. Raises ProgramError if a branch failed.
        """
        if not isinstance(forks, (list, tuple)) or not all(isinstance(f, ProgramState) for f in forks):
            raise TypeError("join(forks): forks must be a list of states returned by fork()")
        if any(f._parent is not self for f in forks):
            raise ValueError("join(forks): every state must have been forked from this state")
        for branch in forks:
            branch._executor.wait()
        names = list(dict.fromkeys(name for f in forks for name in f._ctx.assigned))

        def gather() -> None:
            for name in names:
                values = [f._ctx.variables.get(name) if name in f._ctx.assigned else None for f in forks]
                metas = [f._ctx.meta_info.get(name) if name in f._ctx.assigned else None for f in forks]
                self._ctx.set_variable(name, values, metas)

        self._executor.submit(gather)

    # --- reading -------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        """The value of a gen/select variable (waits for this state's queued operations)."""
        self._executor.wait()
        return self._ctx.variables[self._known(name)]

    def get_meta_info(self, name: str) -> Any:
        """The runtime's meta_info of the gen that set `name` (prompt_tokens, cached_tokens,
        finish_reason, ...), or select's scores; a list after join."""
        self._executor.wait()
        return self._ctx.meta_info[self._known(name)]

    def text(self) -> str:
        """The whole text so far, prompt and generated parts, once this state's queued operations are done."""
        self._executor.wait()
        return self._ctx.text()

    def messages(self) -> list[dict[str, str]]:
        """The chat messages appended with system/user/assistant, content included."""
        self._executor.wait()
        return [dict(m) for m in self._ctx.messages]

    def token_ids(self) -> list[int]:
        """The token ids of the state: what the next gen's prompt would be."""
        self._executor.wait()
        return self._ctx.token_ids()

    @property
    def error(self) -> BaseException | None:
        """The error that stopped this state's program, or None (waits for queued operations)."""
        self._executor.wait_idle()
        if self._executor.error is not None:
            self._executor.error_reported = True  # seen, so the end of the run need not raise it
        return self._executor.error

    def text_iter(self, name: str | None = None) -> Iterator[str]:
        """Yield the text as it is produced: all of it, or only variable `name`'s.

        For a streamed run (`program.run(..., stream=True)`) the chunks arrive
        while the program runs; otherwise they replay what was produced. Ends
        when the state is idle (or `name` is complete); raises ProgramError if
        the program failed.
        """
        if name is not None and not isinstance(name, str):
            raise TypeError(f"text_iter(name): name must be a string or None, got {type(name).__name__}")
        changed, index = self._ctx.changed, 0
        while True:
            with changed:
                while index == len(self._ctx.pieces) and not self._settled(name):
                    changed.wait()
                new, index = self._ctx.pieces[index:], len(self._ctx.pieces)
                done = self._settled(name)
            for variable, text in new:
                if name is None or variable == name:
                    yield text
            if done and index == len(self._ctx.pieces):
                break
        self._executor.raise_if_failed()

    # --- internals -----------------------------------------------------------------
    def _settled(self, name: str | None) -> bool:
        return self._executor.idle or (name is not None and name in self._ctx.variables)

    def _known(self, name: Any) -> str:
        if not isinstance(name, str):
            raise TypeError(f"variable names are strings, got {type(name).__name__} {name!r}")
        if name not in self._ctx.variables:
            known = ", ".join(repr(n) for n in self._ctx.variables) or "none"
            raise KeyError(f"no variable {name!r} in this state; known variables: {known}")
        return name

    def _finish(self, error: BaseException | None = None) -> BaseException | None:
        """End of the run (the program's body returned or raised): wait for every branch.

        The run's error is the body's, else the first branch error nobody
        read. It is recorded on this state (reads raise it) and returned.
        """
        with self._family_lock:
            branches = list(self._family)
        for branch in branches:
            branch._executor.wait_idle()
        unread = [b._executor for b in branches if b._executor.error is not None and not b._executor.error_reported]
        if error is None and unread:
            error = unread[0].failure()
        if error is not None:
            self._executor.fail(error)
        return error

    def _finish_after_queue(self) -> None:
        """_finish as the last operation of a streamed run's queue; an error fails the state."""
        self._executor.submit(self._finish)
