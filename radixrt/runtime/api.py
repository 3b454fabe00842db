"""`radixrt.Runtime`: the Python entry point.

The engine runs on one background thread (`driver`); every public method is
safe to call from any thread. A request is tokenized and validated in the
caller's thread (`inputs`), so bad input raises there and never reaches the
engine.
"""

from __future__ import annotations

import asyncio
import queue
from typing import Any, AsyncIterator, Iterator, Sequence

from radixrt.config import RuntimeConfig
from radixrt.engine.engine import Engine
from radixrt.engine.request import Request, RequestOutput
from radixrt.runtime.cache_report import EXPLAIN_WINDOW, explain_report, tree_svg
from radixrt.runtime.driver import EngineDriver, build_engine
from radixrt.runtime.inputs import InputProcessor, PromptInput, cache_namespace, normalise_rids, per_prompt
from radixrt.sampling import SamplingParams
from radixrt.tree import ALL_NAMESPACES, AllNamespaces
from radixrt.tree.events import CacheEvent

_Outputs = queue.Queue  # of RequestOutput | BaseException, filled on the engine thread


class Runtime:
    """Generate text with a radix-tree prefix cache.

    >>> rt = Runtime()                       # the bundled SmolLM2-135M-Instruct
    >>> rt.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})["text"]

    `model` is a Hugging Face folder, a .gguf file, None (the bundled
    model), or a `LoadedModel` from `radixrt.model.loader.load_model`:
    several runtimes can share one loaded model's weights (only read during
    a step), each with its own KV pool and cache, and skip loading it again.
    """

    def __init__(self, model: Any = None, **config: Any):
        self.config = RuntimeConfig.from_kwargs(**config)
        built = build_engine(model, self.config)
        self.tokenizer = built.loaded.tokenizer
        self.model_name = built.loaded.name
        self.inputs = InputProcessor(self.tokenizer, built.limits, built.eos_token_ids)
        # Read-only outside the engine thread: for introspection (model, device), never for driving it.
        self.engine: Engine = built.engine
        self._driver = EngineDriver(built.engine)
        # How many of the model's parameters run in each format ("Q4_K", "Q6_K", "BF16", ...): a
        # GGUF's mix as loaded, dense fallbacks included (`LlamaForCausalLM.weight_formats`).
        self.weight_formats: dict[str, int] = built.engine.runner.model.weight_formats()

    # --- generation --------------------------------------------------------------
    def generate(
        self,
        prompt: PromptInput = None,
        sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
        stream: bool = False,
        *,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        messages: Sequence[dict] | None = None,
        cache_salt: str | None = None,
        logprob_start_len: int | Sequence[int] | None = None,
        rid: str | Sequence[str] | None = None,
        return_logprob: bool | Sequence[bool] | None = None,
        top_logprobs_num: int | Sequence[int] | None = None,
        token_ids_logprob: Sequence[int] | Sequence[Sequence[int]] | None = None,
        return_text_in_logprobs: bool | None = None,
    ) -> dict | list[dict] | Iterator[dict]:
        """Complete one prompt (a dict) or a list of prompts (a list of dicts, in order).

        The first argument may be a string, a list of strings, token ids, a
        list of token-id lists, or chat messages ([{"role", "content"}, ...]).
        With `n > 1` each prompt yields n results (a list, prompt by prompt).
        `stream=True` returns an iterator of chunks
        {"index", "id", "text", "output_ids", "finished", "meta_info"?};
        `abort(chunk["id"])` stops that request.
        `cache_salt` puts the request in its own cache namespace.
        Log-probabilities, SGLang's request fields and `meta_info` shapes
        (`[logprob, token_id, text-or-None]` entries; docs/sampling.md):
        `return_logprob`, `logprob_start_len` (-1 or None: the output only; N:
        the prompt from token N on, its first entry None), `top_logprobs_num`,
        `token_ids_logprob`, `return_text_in_logprobs`. Any of them but the
        last turns `return_logprob` on. For a batch, `sampling_params` and the
        log-prob fields may be lists, one per prompt (as SGLang's `Engine`).
        `rid` names the request (a list: one id per prompt); with `n > 1` the
        samples are `rid-0`, `rid-1`, ... and `abort(rid)` stops them all.
        """
        logprobs = (return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob, return_text_in_logprobs)
        requests, many = self._prepare(prompt, sampling_params, input_ids, messages, cache_salt, logprobs, rid)
        outputs: _Outputs = queue.Queue()
        for req in requests:
            req.on_output, req.stream = outputs.put, stream
        self._driver.submit(requests)
        if stream:
            return self._stream(requests, outputs)
        results = _collect(requests, outputs)
        return results if many else results[0]

    async def async_generate(
        self,
        prompt: PromptInput = None,
        sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
        stream: bool = False,
        *,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        messages: Sequence[dict] | None = None,
        cache_salt: str | None = None,
        logprob_start_len: int | Sequence[int] | None = None,
        rid: str | Sequence[str] | None = None,
        return_logprob: bool | Sequence[bool] | None = None,
        top_logprobs_num: int | Sequence[int] | None = None,
        token_ids_logprob: Sequence[int] | Sequence[Sequence[int]] | None = None,
        return_text_in_logprobs: bool | None = None,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """`generate` for asyncio callers; with stream=True, returns an async iterator of chunks.

        Tokenizing and validation run in a worker thread, so a long prompt or
        chat template never blocks the event loop; outputs reach the loop
        from the engine thread without a thread hop per chunk. Cancelling the
        awaiting task (or closing the iterator early) aborts the requests.
        """
        logprobs = (return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob, return_text_in_logprobs)
        requests, many = await asyncio.to_thread(
            self._prepare, prompt, sampling_params, input_ids, messages, cache_salt, logprobs, rid
        )
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def deliver(item: RequestOutput | BaseException) -> None:
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed: nobody waits for this any more
                pass

        for req in requests:
            req.on_output, req.stream = deliver, stream
        self._driver.submit(requests)
        if stream:
            return self._astream(requests, outputs)
        try:
            results = await _acollect(requests, outputs)
        except BaseException:
            self._abort_all(requests)
            raise
        return results if many else results[0]

    def _prepare(
        self,
        prompt: PromptInput,
        sampling_params: Any,
        input_ids: Any,
        messages: Any,
        cache_salt: str | None,
        logprobs: tuple[Any, ...],
        rid: Any,
    ) -> tuple[list[Request], bool]:
        """Validated requests for one call, and whether it returns a list (a batch or n > 1)."""
        prompts, is_batch = self.inputs.token_ids(prompt, input_ids, messages)
        params, starts = per_prompt(sampling_params, logprobs, len(prompts), is_batch)
        rids = normalise_rids(rid, is_batch, len(prompts))
        requests = self.inputs.make_requests(prompts, params, cache_salt, starts, rids)
        return requests, is_batch or any(p.n > 1 for p in params)

    def abort(self, request_id: str) -> None:
        """Stop a request; its caller gets finish_reason {"type": "abort"}."""
        self._driver.abort(request_id)

    # --- cache -------------------------------------------------------------------------
    def cache_stats(self) -> dict[str, float | int]:
        """Hit rate (cached prompt tokens / prompt tokens), tree and pool usage, evictions.

        RuntimeError after `shutdown()`: the numbers would describe a runtime that is gone.
        """
        stats: dict[str, float | int] = self._driver.call(self.engine.stats)
        return stats

    def explain_cache(
        self,
        prompt: PromptInput = None,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[dict] | None = None,
        cache_salt: str | None = None,
    ) -> dict[str, Any]:
        """Why a prompt would (not) hit the cache: how much is cached and where it leaves the tree.

        Returns {"prompt_tokens", "cached_tokens" (what a request would reuse
        now), "diverged_at" (the first token not in the cache, None when all
        of it is), "context_text" (the text just before that point),
        "prompt_text" and "cached_text" (the prompt's and the closest cached
        branch's text from that point on)}. Reads the tree between two steps
        and changes nothing: no eviction order moves. Takes one prompt in
        any form `generate` takes, with the same errors.
        """
        ids = self.inputs.one_prompt(prompt, input_ids, messages)
        namespace, cache = cache_namespace(cache_salt), self.engine.cache
        divergence = self._driver.call(lambda: cache.explain(ids, namespace, EXPLAIN_WINDOW))
        return explain_report(ids, divergence, self.config.page_size, self._decode)

    def cache_tree_svg(
        self, max_nodes: int = 200, *, cache_salt: str | None | AllNamespaces = ALL_NAMESPACES
    ) -> str:
        """An SVG picture of the live cache tree (see docs/cache.md for how to read it).

        At most `max_nodes` nodes are drawn, heaviest branches first; the rest
        fold into "+N more" boxes. `cache_salt` (None is the default
        namespace) draws one namespace only; by default all are drawn.
        """
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
            raise ValueError(f"max_nodes must be an int >= 1, got {max_nodes!r}")
        namespace = cache_salt if isinstance(cache_salt, AllNamespaces) else cache_namespace(cache_salt)
        cache = self.engine.cache
        snapshot = self._driver.call(lambda: cache.snapshot(max_nodes, namespace))
        return tree_svg(snapshot, self._decode)

    def drain_cache_events(self) -> list[CacheEvent]:
        """What the cache inserted and evicted since the last call, oldest first, for a router's mirror.

        The first call starts the record and returns everything cached then,
        so a router that applies every drain in order (`Router.apply_events`)
        holds exactly this runtime's token sets. See docs/scaleout.md.
        """
        cache = self.engine.cache
        events: list[CacheEvent] = self._driver.call(cache.drain_events)
        return events

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def flush_cache(self) -> None:
        """Drop every cached prefix and reset the hit counters (the runtime must be idle)."""
        self._driver.call(self.engine.flush_cache)

    # --- lifecycle ---------------------------------------------------------------------
    @property
    def deterministic(self) -> bool:
        """Whether outputs are batch-invariant here (`deterministic="auto"` resolved; docs/determinism.md)."""
        return self.engine.runner.deterministic

    @property
    def kernel_isa(self) -> str | None:
        """The CPU kernels' instruction-set level in use (portable, avx2, avx512; None on a GPU)."""
        return self.engine.runner.kernel_isa

    def is_alive(self) -> bool:
        """True while the engine thread runs and has not stopped on an error."""
        return self._driver.is_alive()

    def shutdown(self) -> None:
        """Stop the engine thread; calls still waiting for a request raise RuntimeError.

        Safe to call twice. Afterwards every method that needs the engine raises
        RuntimeError rather than answer for a runtime that is gone.
        """
        self._driver.shutdown()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # --- internals -----------------------------------------------------------------------
    def _stream(self, requests: list[Request], outputs: _Outputs) -> Iterator[dict]:
        index_of = {r.rid: i for i, r in enumerate(requests)}
        remaining = len(requests)
        try:
            while remaining:
                output = _next_output(outputs)
                remaining -= output.finished
                yield output.chunk(index_of[output.rid])
        finally:
            if remaining:  # the caller stopped reading: free what its requests hold
                self._abort_all(requests)

    async def _astream(
        self, requests: list[Request], outputs: asyncio.Queue[RequestOutput | BaseException]
    ) -> AsyncIterator[dict]:
        index_of = {r.rid: i for i, r in enumerate(requests)}
        remaining = len(requests)
        try:
            while remaining:
                output = _checked(await outputs.get())
                remaining -= output.finished
                yield output.chunk(index_of[output.rid])
        finally:
            if remaining:
                self._abort_all(requests)

    def _abort_all(self, requests: list[Request]) -> None:
        """Abort every request of a call; a runtime already shut down has nothing left to free."""
        try:
            for req in requests:
                self._driver.abort(req.rid)
        except RuntimeError:
            pass


def _checked(item: RequestOutput | BaseException) -> RequestOutput:
    if isinstance(item, BaseException):
        raise RuntimeError(f"the request did not complete: {item}") from item
    return item


async def _acollect(requests: list[Request], outputs: asyncio.Queue[RequestOutput | BaseException]) -> list[dict]:
    results: dict[str, dict] = {}
    while len(results) < len(requests):
        output = _checked(await outputs.get())
        if output.result is not None:
            results[output.rid] = output.result
    return [results[r.rid] for r in requests]


def _next_output(outputs: _Outputs) -> RequestOutput:
    return _checked(outputs.get())


def _collect(requests: list[Request], outputs: _Outputs) -> list[dict]:
    results: dict[str, dict] = {}
    while len(results) < len(requests):
        output = _next_output(outputs)
        if output.result is not None:
            results[output.rid] = output.result
    return [results[r.rid] for r in requests]

