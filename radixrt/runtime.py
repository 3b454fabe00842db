"""`radixrt.Runtime`: the Python entry point.

The engine runs in one background thread; every public method is safe to
call from any thread. A request's validation happens in the caller's thread,
so bad input raises there and never reaches the engine.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import random
import threading
import weakref
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

from radixrt.config import RuntimeConfig
from radixrt.engine.engine import Engine
from radixrt.engine.request import Request, RequestOutput
from radixrt.runtime_setup import build_engine
from radixrt.sampling import SamplingParams

logger = logging.getLogger("radixrt")

PromptInput = Any  # str | list[str] | list[int] | list[list[int]] | messages | list of messages


class Runtime:
    """Generate text with a radix-tree prefix cache.

    >>> rt = Runtime()                       # the bundled SmolLM2-135M-Instruct
    >>> rt.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})["text"]
    """

    def __init__(self, model: Any = None, **config: Any):
        self.config = RuntimeConfig.from_kwargs(**config)
        self.engine: Engine
        self.engine, self.tokenizer, self.model_name = build_engine(model, self.config)
        self._cv = threading.Condition()
        self._actions: list[tuple[str, Any]] = []
        self._closed = False
        self._engine_error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="radixrt-engine", daemon=True)
        self._thread.start()
        _live_runtimes.add(self)

    # --- generation --------------------------------------------------------------
    def generate(
        self,
        prompt: PromptInput = None,
        sampling_params: SamplingParams | dict | None = None,
        stream: bool = False,
        *,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        messages: Sequence[dict] | None = None,
        cache_salt: str | None = None,
        logprob_start_len: int | None = None,
    ) -> dict | list[dict] | Iterator[dict]:
        """Complete one prompt (a dict) or a list of prompts (a list of dicts, in order).

        The first argument may be a string, a list of strings, token ids, a
        list of token-id lists, or chat messages ([{"role", "content"}, ...]).
        With `n > 1` each prompt yields n results (a list, prompt by prompt).
        `stream=True` returns an iterator of chunks
        {"index", "id", "text", "output_ids", "finished", "meta_info"?};
        `abort(chunk["id"])` stops that request.
        `cache_salt` puts the request in its own cache namespace.
        `logprob_start_len` asks for the prompt tokens' log-probabilities from
        that position on (in meta_info["input_token_logprobs"]).
        """
        prompts, is_batch = self._token_ids(prompt, input_ids, messages)
        params = SamplingParams.from_any(sampling_params)
        requests = self._make_requests(prompts, params, cache_salt, logprob_start_len)
        many = is_batch or params.n > 1
        outputs: queue.Queue[RequestOutput | BaseException] = queue.Queue()
        for req in requests:
            req.on_output = outputs.put
        self._submit(requests)
        if stream:
            return self._stream(requests, outputs)
        results = self._collect(requests, outputs)
        return results if many else results[0]

    async def async_generate(self, *args: Any, **kwargs: Any) -> dict | list[dict] | AsyncIterator[dict]:
        """`generate` for asyncio callers; with stream=True, returns an async iterator of chunks."""
        if not kwargs.get("stream", len(args) > 2 and args[2]):
            return await asyncio.to_thread(self.generate, *args, **kwargs)
        chunks = self.generate(*args, **kwargs)
        return _async_iterate(chunks)

    def abort(self, request_id: str) -> None:
        """Stop a request; its caller gets finish_reason {"type": "abort"}."""
        self._post("abort", request_id)

    # --- cache -------------------------------------------------------------------------
    def cache_stats(self) -> dict[str, float | int]:
        """Hit rate (cached prompt tokens / prompt tokens), tree and pool usage, evictions."""
        return self._call(self.engine.stats)

    def flush_cache(self) -> None:
        """Drop every cached prefix and reset the hit counters (the runtime must be idle)."""
        self._call(self.engine.flush_cache)

    # --- lifecycle ---------------------------------------------------------------------
    def shutdown(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # --- internals -----------------------------------------------------------------------
    def _token_ids(self, prompt: PromptInput, input_ids: Any, messages: Any) -> tuple[list[list[int]], bool]:
        given = [x is not None for x in (prompt, input_ids, messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, input_ids or messages")
        if messages is not None:
            return [self._encode_messages(messages)], False
        if input_ids is not None:
            prompt = input_ids
        if isinstance(prompt, str):
            return [self._encode_text(prompt)], False
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt must be a non-empty string, list of strings, token ids or messages")
        first = prompt[0]
        if isinstance(first, str):
            return [self._encode_text(p) for p in prompt], True
        if isinstance(first, dict):
            return [self._encode_messages(prompt)], False
        if isinstance(first, (list, tuple)) and first and isinstance(first[0], dict):
            return [self._encode_messages(m) for m in prompt], True
        if isinstance(first, (list, tuple)):
            return [_check_ids(ids) for ids in prompt], True
        return [_check_ids(prompt)], False

    def _encode_text(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a string, got {type(text).__name__}")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _encode_messages(self, messages: Sequence[dict]) -> list[int]:
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _make_requests(
        self, prompts: list[list[int]], params: SamplingParams, cache_salt: str | None, logprob_start_len: int | None
    ) -> list[Request]:
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        params.validate(vocab_size=self.engine.vocab_size)
        namespace = None if cache_salt is None else ("cache_salt", cache_salt)
        requests = []
        for ids in prompts:
            if logprob_start_len is not None and not 0 <= logprob_start_len < max(len(ids), 1):
                raise ValueError(f"logprob_start_len must be in [0, {len(ids)}), got {logprob_start_len}")
            base_seed = params.seed if params.seed is not None else random.getrandbits(62)
            for i in range(params.n):
                req = Request(ids, params, namespace=namespace, logprob_start_len=logprob_start_len)
                req.seed = base_seed + i
                self.engine.validate(req)
                requests.append(req)
        return requests

    def _submit(self, requests: list[Request]) -> None:
        self._post("add", requests)

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between two steps and return its result.

        Only the engine thread touches engine state while it runs, so callers
        never see a half-done step and never hold a lock the step loop needs.
        """
        if threading.current_thread() is self._thread:
            return fn()
        with self._cv:
            closed = self._closed
        if closed or not self._thread.is_alive():
            self._thread.join()  # a shut-down engine finishes its last step first
            return fn()
        reply: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self._post("call", (fn, reply))
        ok, value = reply.get()
        if not ok:
            raise value
        return value

    def _post(self, action: str, payload: Any) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("the runtime is shut down")
            if self._engine_error is not None:
                raise RuntimeError("the engine stopped after an internal error") from self._engine_error
            self._actions.append((action, payload))
            self._cv.notify()

    def _collect(self, requests: list[Request], outputs: queue.Queue) -> list[dict]:
        results: dict[str, dict] = {}
        while len(results) < len(requests):
            item = outputs.get()
            if isinstance(item, BaseException):
                raise RuntimeError(f"the request did not complete: {item}") from item
            if item.finished:
                results[item.rid] = item.result
        return [results[r.rid] for r in requests]

    def _stream(self, requests: list[Request], outputs: queue.Queue) -> Iterator[dict]:
        index_of = {r.rid: i for i, r in enumerate(requests)}
        remaining = len(requests)
        try:
            while remaining:
                item = outputs.get()
                if isinstance(item, BaseException):
                    raise RuntimeError(f"the request did not complete: {item}") from item
                chunk = {"index": index_of[item.rid], "id": item.rid, "text": item.text_delta,
                         "output_ids": item.token_ids_delta, "finished": item.finished}
                if item.finished:
                    remaining -= 1
                    chunk["meta_info"] = item.result["meta_info"]
                yield chunk
        finally:
            if remaining:  # the caller stopped reading: free what its requests hold
                for req in requests:
                    self.abort(req.rid)

    def _loop(self) -> None:
        """Apply posted actions, then step; the lock is never held during a step."""
        failure: BaseException | None = None
        try:
            while True:
                with self._cv:
                    while not self._actions and not self.engine.has_work and not self._closed:
                        self._cv.wait()
                    if self._closed:
                        break
                    actions, self._actions = self._actions, []
                for action, payload in actions:
                    self._apply(action, payload)
                if self.engine.has_work:
                    self.engine.step()
        except Exception as error:  # an engine bug: fail every request, keep the process alive
            logger.exception("engine step failed")
            failure = self._engine_error = error
        finally:
            self._fail_outstanding(failure or RuntimeError("the runtime was shut down"))

    def _fail_outstanding(self, reason: BaseException) -> None:
        """Nobody waits forever: every request still running or queued gets `reason`."""
        with self._cv:
            self._closed = True
            actions, self._actions = self._actions, []
        waiting = list(self.engine.requests.values())
        for action, payload in actions:
            if action == "add":
                waiting.extend(payload)
            elif action == "call":
                payload[1].put((False, reason))
        for req in waiting:
            if req.on_output is not None:
                req.on_output(reason)  # type: ignore[arg-type]

    def _apply(self, action: str, payload: Any) -> None:
        if action == "add":
            for req in payload:
                self.engine.add_request(req)
        elif action == "abort":
            self.engine.abort(payload)
        elif action == "call":
            fn, reply = payload
            try:
                reply.put((True, fn()))
            except Exception as error:
                reply.put((False, error))


# The engine thread is a daemon so a forgotten Runtime never blocks exit, but
# a daemon killed inside a torch op aborts the interpreter: stop them first.
_live_runtimes: "weakref.WeakSet[Runtime]" = weakref.WeakSet()


@atexit.register
def _shutdown_live_runtimes() -> None:
    for runtime in list(_live_runtimes):
        runtime.shutdown()


def _check_ids(ids: Any) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("input_ids must be a list of ints (or a list of such lists)")
    return list(ids)


async def _async_iterate(chunks: Iterator[dict]) -> AsyncIterator[dict]:
    sentinel = object()
    while True:
        chunk = await asyncio.to_thread(next, chunks, sentinel)
        if chunk is sentinel:
            return
        yield chunk
