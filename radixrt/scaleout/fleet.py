"""`ReplicaFleet`: what the HTTP app needs from a Runtime, answered by replicas behind the router.

The ingress tokenizes (chat template included) and validates exactly as a
replica would, so bad input is a 400 before any routing, and the router
matches the full templated token sequence. Each prompt of a call is routed
on its own and sent to its replica as token ids; the replica's answers are
put back in the call's order.

The mirrors stay exact through a pump that drains every replica's cache
events every `event_interval_s`. A replica whose call fails is taken out of
routing at once; the pump brings it back when it answers again, with a new
instance id and so an empty mirror (Ray Serve restarts a dead replica empty).
A request whose replica fails before anything was sent to the client is
retried once elsewhere; after that, it fails with an error naming the replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Hashable, Sequence
from dataclasses import replace
from typing import Any

from radixrt.config import RuntimeConfig
from radixrt.model.tokenizer import Tokenizer
from radixrt.runtime.inputs import InputProcessor, PromptInput, cache_namespace, normalise_rids, per_prompt
from radixrt.sampling import SamplingParams
from radixrt.scaleout.router import Route, Router
from radixrt.tree import ALL_NAMESPACES, AllNamespaces

logger = logging.getLogger("radixrt.scaleout")

EVENT_INTERVAL_S = 0.1
# A drain waits for the step in progress; a replica silent for longer is taken out of routing until it answers.
DRAIN_TIMEOUT_S = 5.0


class ReplicaFailed(RuntimeError):
    """A replica died or stopped answering while it held a request."""


class ReplicaFleet:
    """Routes calls over replicas (Ray Serve deployment handles, one per replica)."""

    def __init__(
        self,
        handles: dict[str, Any],
        router: Router,
        description: dict[str, Any],
        replica_failures: tuple[type[BaseException], ...],
        event_interval_s: float = EVENT_INTERVAL_S,
    ):
        self._handles = handles
        self.router = router
        self._failures = replica_failures
        self._interval = event_interval_s
        self._instances: dict[str, str] = {}
        self.model_name: str = description["model_name"]
        self.deterministic: bool = description["deterministic"]  # every replica runs the same model and options
        replica_config: RuntimeConfig = description["config"]
        # The app sizes its admission queue from max_running_requests: the fleet runs that many per replica.
        self.config = replace(replica_config, max_running_requests=replica_config.max_running_requests * len(handles))
        record = description["tokenizer_record"]
        self.tokenizer = Tokenizer(record, _no_transformers) if record is not None else description["tokenizer"]
        self.inputs = InputProcessor(self.tokenizer, description["limits"], description["eos_token_ids"])
        self._pump: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        """Join every replica that answers, then keep the mirrors current in the background."""
        self._loop = asyncio.get_running_loop()
        await self._refresh_all()
        self._pump = asyncio.create_task(self._pump_events())

    async def _pump_events(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self._refresh_all()

    async def _refresh_all(self) -> None:
        await asyncio.gather(*(self._refresh(name) for name in self._handles))

    async def _refresh(self, name: str) -> None:
        try:
            instance, events = await asyncio.wait_for(self._handles[name].drain_cache_events.remote(),
                                                      DRAIN_TIMEOUT_S)
        except self._failures + (asyncio.TimeoutError,) as error:
            self._lost(name, error)
            return
        if self._instances.get(name) != instance:
            if name in self._instances:
                logger.warning("replica %s restarted: routing to it again, with an empty cache", name)
            self._instances[name] = instance
            self.router.add_replica(name)
        elif name not in self.router.replicas:
            logger.warning("replica %s answers again: routing to it again", name)
            self.router.resume(name)
        self.router.apply_events(name, events)

    def _lost(self, name: str, error: BaseException) -> None:
        """Stop routing to a replica that failed a call or did not drain in time (its mirror is kept)."""
        if name in self.router.replicas:
            logger.warning("replica %s failed (%s): no longer routing to it", name, type(error).__name__)
        self.router.suspend(name)

    def is_alive(self) -> bool:
        return bool(self.router.replicas)

    def shutdown(self) -> None:
        if self._pump is not None:
            self._pump.cancel()

    # --- generation -------------------------------------------------------------------
    async def async_generate(
        self,
        prompt: PromptInput = None,
        sampling_params: Any = None,
        stream: bool = False,
        *,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        messages: Sequence[dict] | None = None,
        cache_salt: str | None = None,
        logprob_start_len: Any = None,
        rid: str | Sequence[str] | None = None,
        return_logprob: Any = None,
        top_logprobs_num: Any = None,
        token_ids_logprob: Any = None,
        return_text_in_logprobs: bool | None = None,
    ) -> Any:
        """`Runtime.async_generate`, each prompt on the replica the router picks for it."""
        prompts, is_batch = await asyncio.to_thread(self.inputs.token_ids, prompt, input_ids, messages)
        logprobs = (return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob, return_text_in_logprobs)
        params, starts = per_prompt(sampling_params, logprobs, len(prompts), is_batch)
        rids = normalise_rids(rid, is_batch, len(prompts))
        self.inputs.make_requests(prompts, params, cache_salt, starts, rids)  # validation only
        calls = [
            {"input_ids": ids, "sampling_params": params[i], "cache_salt": cache_salt,
             "logprob_start_len": starts[i], "rid": rids[i] if rids else None}
            for i, ids in enumerate(prompts)
        ]
        namespace = cache_namespace(cache_salt)
        if stream:
            if len({p.n for p in params}) > 1:
                raise ValueError("n must be the same for every prompt of a streamed batch")
            return self._stream(calls, namespace, params[0].n)
        results = await asyncio.gather(*(self._generate(call, namespace) for call in calls))
        flat = [item for p, result in zip(params, results) for item in (result if p.n > 1 else [result])]
        return flat if is_batch or any(p.n > 1 for p in params) else flat[0]

    async def _generate(self, call: dict[str, Any], namespace: Hashable) -> Any:
        for attempt in (1, 2):
            route = self._route(call["input_ids"], namespace)
            try:
                return await cancel_with_caller(self._handles[route.replica].generate.remote(call))
            except self._failures as error:
                self._lost(route.replica, error)
                if attempt == 2 or not self.router.replicas:
                    raise ReplicaFailed(f"replica {route.replica} failed while serving the request: {error}") from error
            finally:
                self.router.finished(route)
        raise AssertionError("unreachable")

    async def _stream(self, calls: list[dict[str, Any]], namespace: Hashable, n: int) -> AsyncIterator[dict]:
        """The chunks of every prompt's stream as they come, indexed as one Runtime call would index them."""
        queue: asyncio.Queue[dict | BaseException | None] = asyncio.Queue()

        async def pump(position: int, call: dict[str, Any]) -> None:
            try:
                async for chunk in self._stream_one(call, namespace):
                    queue.put_nowait({**chunk, "index": position * n + chunk["index"]})
                queue.put_nowait(None)
            except Exception as error:  # handed to the consumer, who raises it
                queue.put_nowait(error)

        tasks = [asyncio.create_task(pump(i, call)) for i, call in enumerate(calls)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    async def _stream_one(self, call: dict[str, Any], namespace: Hashable) -> AsyncIterator[dict]:
        for attempt in (1, 2):
            route = self._route(call["input_ids"], namespace)
            sent = False
            chunks = self._handles[route.replica].options(stream=True).generate_stream.remote(call)
            try:
                async for chunk in chunks:
                    sent = True
                    yield chunk
                return
            except self._failures as error:
                self._lost(route.replica, error)
                if sent or attempt == 2 or not self.router.replicas:
                    raise ReplicaFailed(f"replica {route.replica} failed while serving the request: {error}") from error
            finally:
                chunks.cancel()
                self.router.finished(route)

    def _route(self, input_ids: Sequence[int], namespace: Hashable) -> Route:
        if not self.router.replicas:
            raise ReplicaFailed("no replica is available")
        return self.router.route(input_ids, namespace)

    def abort(self, request_id: str) -> None:
        for handle in self._handles.values():
            handle.abort.remote(request_id)

    # --- cache (called from worker threads by the app) --------------------------------
    def cache_stats(self) -> dict[str, Any]:
        """Every replica's counters added up, with the hit rate of the sums."""
        total: dict[str, Any] = {}
        for stats in self._each("cache_stats"):
            for key, value in stats.items():
                total[key] = total.get(key, 0) + value
        total["hit_rate"] = total["cached_prompt_tokens"] / total["prompt_tokens"] if total.get("prompt_tokens") else 0.0
        return total

    def replica_stats(self) -> list[dict[str, Any]]:
        """Per replica: name, process, whether it is routed to, requests in flight, and its `cache_stats`."""
        out = []
        for name, handle in self._handles.items():
            routed = name in self.router.replicas
            entry: dict[str, Any] = {"name": name, "routed": routed, "in_flight": self.router.load(name) if routed else 0}
            try:
                entry.update(handle.identity.remote().result())
                entry["cache_stats"] = handle.cache_stats.remote().result()
            except self._failures as error:
                entry["error"] = f"{type(error).__name__}: {error}"
            out.append(entry)
        return out

    def flush_cache(self) -> None:
        """Flush every replica, and the mirrors with them before returning (not at the next pump)."""
        self._each("flush_cache")
        assert self._loop is not None, "start() first"
        asyncio.run_coroutine_threadsafe(self._refresh_all(), self._loop).result()

    def explain_cache(
        self,
        prompt: PromptInput = None,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[dict] | None = None,
        cache_salt: str | None = None,
    ) -> dict[str, Any]:
        """The explanation from the replica the router would pick for this prompt now."""
        ids = self.inputs.one_prompt(prompt, input_ids, messages)
        name = self.router.closest(ids, cache_namespace(cache_salt))
        report = self._handles[name].explain_cache.remote({"input_ids": ids, "cache_salt": cache_salt}).result()
        return {**report, "replica": name}

    def cache_tree_svg(self, max_nodes: int = 200, *, cache_salt: str | None | AllNamespaces = ALL_NAMESPACES) -> str:
        """Every replica's picture, one under the other, each titled with its replica's name."""
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
            raise ValueError(f"max_nodes must be an int >= 1, got {max_nodes!r}")
        pictures = [(name, handle.cache_tree_svg.remote(max_nodes, cache_salt).result())
                    for name, handle in self._handles.items() if name in self.router.replicas]
        return stack_svgs(pictures)

    def _each(self, method: str) -> list[Any]:
        responses = [getattr(self._handles[name], method).remote() for name in self.router.replicas]
        return [response.result() for response in responses]


async def cancel_with_caller(response: Any) -> Any:
    """Await a Serve response; if the caller is cancelled, cancel it on the replica too."""
    try:
        return await response
    except asyncio.CancelledError:
        response.cancel()
        raise


def _no_transformers() -> Any:
    raise RuntimeError("the ingress has the tokenizer's record only; this attribute needs transformers' tokenizer")


def stack_svgs(pictures: list[tuple[str, str]]) -> str:
    """One SVG holding several, each under a title line."""
    import xml.etree.ElementTree as ET

    namespace = "http://www.w3.org/2000/svg"
    ET.register_namespace("", namespace)
    parts, y, width = [], 0, 200
    for name, svg in pictures:
        root = ET.fromstring(svg)
        height = int(float(root.get("height", "0")))
        width = max(width, int(float(root.get("width", "0"))))
        parts.append(f'<text x="16" y="{y + 18}" font-size="14" font-weight="bold">replica {name}</text>')
        root.set("y", str(y + 24))
        parts.append(ET.tostring(root, encoding="unicode"))
        y += height + 32
    return (
        f'<svg xmlns="{namespace}" width="{width}" height="{y}" viewBox="0 0 {width} {y}" '
        f'font-family="ui-monospace, monospace">' + "".join(parts) + "</svg>"
    )

