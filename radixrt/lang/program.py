"""`@function` programs and how they run: one at a time, streamed, or as a batch.

    @radixrt.function
    def qa(s, question):
        s += "Q: " + question + "\\nA:"
        s += radixrt.gen("answer", max_tokens=16, stop="\\n")

    qa.run(question="...", runtime=rt)["answer"]
    qa.run_batch([{"question": q} for q in questions], runtime=rt, num_threads=32)

run_batch runs each item's program on its own thread from a pool; the
runtime's engine batches whatever the threads submit, and items sharing a
prefix (a few-shot preamble) hit it in the radix tree. An item whose program
raises does not stop the others: its state has `.error` set, and reading its
values raises ProgramError caused by that error.
"""

from __future__ import annotations

import functools
import inspect
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from tqdm import tqdm

from radixrt.lang.context import ProgramContext
from radixrt.lang.state import ProgramState

_default_runtime: Any = None
AUTO_NUM_THREADS = 64  # threads for num_threads="auto"; enough to fill a CPU batch, few enough to start fast


def set_default_runtime(runtime: Any) -> None:
    """The Runtime programs use when run without `runtime=` (None clears it)."""
    global _default_runtime
    if runtime is not None and not callable(getattr(runtime, "generate", None)):
        raise TypeError(f"set_default_runtime: expected a radixrt.Runtime, got {type(runtime).__name__}")
    _default_runtime = runtime


class Program:
    """A function over a program state, run with `run` or `run_batch`."""

    def __init__(self, func: Callable[..., Any]):
        if not callable(func):
            raise TypeError(f"radixrt.function decorates a function, got {type(func).__name__}")
        self.func = func
        self._signature = inspect.signature(func)
        if not self._signature.parameters:
            raise TypeError(f"{func.__name__} must take the program state as its first parameter")
        # typeshed wants a callable wrapper; update_wrapper only copies attributes, which any object takes.
        functools.update_wrapper(self, func)  # type: ignore[arg-type]

    def run(self, *args: Any, runtime: Any = None, stream: bool = False, **kwargs: Any) -> ProgramState:
        """Run the program once and return its final state.

        The program's errors raise here. With `stream=True` the program's own
        state runs on a worker thread as well: `run` returns once the body has
        queued its operations, and `state.text_iter()` yields the text as it
        is generated; an operation's error then surfaces when reading the state
        (the body's own exceptions still raise here).
        """
        self._bind(args, kwargs)
        rt = _resolve_runtime(runtime)
        state = ProgramState(ProgramContext(rt), threaded=bool(stream))
        if stream:
            self.func(state, *args, **kwargs)
            state._finish_after_queue()
            return state
        try:
            self.func(state, *args, **kwargs)
        except Exception as error:
            state._finish(error)
            raise
        _raise_if(state._finish())
        return state

    def run_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any]],
        *,
        runtime: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
    ) -> list[ProgramState]:
        """Run the program once per arguments dict, concurrently; the states in input order.

        An item whose program fails has `state.error` set (reading its values
        raises ProgramError); the other items are unaffected.
        """
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError(f"run_batch takes a list of argument dicts, got {type(batch_kwargs).__name__}")
        for index, item in enumerate(batch_kwargs):
            if not isinstance(item, dict):
                raise TypeError(f"run_batch item {index} must be a dict of arguments, got {type(item).__name__}")
            self._bind((), item, f"run_batch item {index}")
        rt = _resolve_runtime(runtime)
        threads = _num_threads(num_threads, len(batch_kwargs))
        if not batch_kwargs:
            return []
        with tqdm(total=len(batch_kwargs), disable=not progress_bar, desc=self.func.__name__) as bar:
            with ThreadPoolExecutor(threads, thread_name_prefix="radixrt-batch") as pool:
                futures = [pool.submit(self._run_item, rt, item) for item in batch_kwargs]
                for future in futures:
                    future.add_done_callback(lambda _: bar.update())
                return [future.result() for future in futures]

    def _run_item(self, runtime: Any, kwargs: dict[str, Any]) -> ProgramState:
        state = ProgramState(ProgramContext(runtime), threaded=False)
        try:
            self.func(state, **kwargs)
        except Exception as error:  # recorded on the item's state; the batch goes on
            state._finish(error)
            return state
        state._finish()
        return state

    def _bind(self, args: Sequence[Any], kwargs: dict[str, Any], where: str | None = None) -> None:
        """TypeError naming every unexpected and every missing argument at once: a misspelt
        keyword shows up as both, and the pair makes the typo plain."""
        try:
            self._signature.bind(None, *args, **kwargs)
        except TypeError as error:
            problems = _argument_problems(self._signature, len(args), kwargs)
            raise TypeError(f"{where or self.func.__name__}: {problems or error}") from None


def function(func: Callable[..., Any]) -> Program:
    """Decorate `def program(s, ...)` to make a Program."""
    return Program(func)


def _argument_problems(signature: inspect.Signature, num_positional: int, kwargs: dict[str, Any]) -> str:
    """The unexpected keywords and the missing parameters of a call (the state excluded), or ""."""
    params = list(signature.parameters.values())[1:]
    kinds = {p.kind for p in params}
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    filled = {p.name for p in params[:num_positional] if p.kind != p.VAR_POSITIONAL} | set(kwargs)
    problems = []
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        unexpected = [name for name in kwargs if name not in {p.name for p in named}]
        if unexpected:
            problems.append("unexpected argument(s) " + ", ".join(map(repr, unexpected)))
    missing = [p.name for p in named if p.default is p.empty and p.name not in filled]
    if missing:
        problems.append("missing argument(s) " + ", ".join(map(repr, missing)))
    if problems:
        problems.append("the program takes " + (", ".join(p.name for p in named) or "no arguments"))
    return "; ".join(problems)


def _resolve_runtime(runtime: Any) -> Any:
    chosen = runtime if runtime is not None else _default_runtime
    if chosen is None:
        raise ValueError("no runtime: pass runtime=radixrt.Runtime(...) or call radixrt.set_default_runtime(rt) first")
    return chosen


def _num_threads(num_threads: int | str, num_items: int) -> int:
    if num_threads == "auto":
        return max(1, min(AUTO_NUM_THREADS, num_items))
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be an int >= 1 or 'auto', got {num_threads!r}")
    return num_threads


def _raise_if(error: BaseException | None) -> None:
    if error is not None:
        raise error
