"""One replica: a `Runtime` behind the calls the ingress makes (deployed on Ray Serve by `deploy`).

Plain Python, no Ray import: `deploy` wraps the class into a Serve
deployment. Every method is async, and whatever waits for the engine thread
runs in a worker thread, so one replica's event loop keeps streaming other
requests' tokens while it answers.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any, AsyncIterator

from radixrt.runtime import Runtime
from radixrt.tree.events import CacheEvent


class RuntimeReplica:
    """A Runtime with an instance id: the router resets its mirror when the id changes (a restart)."""

    def __init__(self, model: Any, runtime_options: dict[str, Any]):
        self.runtime = Runtime(model, **runtime_options)
        self.instance = uuid.uuid4().hex

    def describe(self) -> dict[str, Any]:
        """What the ingress needs to tokenize and validate requests exactly as this replica would."""
        tokenizer = self.runtime.tokenizer
        record = getattr(tokenizer, "record", None)
        return {
            "instance": self.instance,
            "pid": os.getpid(),
            "model_name": self.runtime.model_name,
            "config": self.runtime.config,
            "deterministic": self.runtime.deterministic,
            "limits": self.runtime.inputs.limits,
            "eos_token_ids": sorted(self.runtime.inputs.eos_token_ids),
            # A recorded tokenizer travels as plain data; any other as the (picklable) transformers object.
            "tokenizer_record": record,
            "tokenizer": None if record is not None else tokenizer,
        }

    async def generate(self, request: dict[str, Any]) -> Any:
        """One `Runtime.async_generate` call (not streamed); cancelling it aborts its requests."""
        return await self.runtime.async_generate(**request)

    async def generate_stream(self, request: dict[str, Any]) -> AsyncIterator[dict]:
        chunks = await self.runtime.async_generate(stream=True, **request)
        async for chunk in chunks:  # type: ignore[union-attr]
            yield chunk

    async def drain_cache_events(self) -> tuple[str, list[CacheEvent]]:
        return self.instance, await asyncio.to_thread(self.runtime.drain_cache_events)

    async def cache_stats(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.runtime.cache_stats)

    def identity(self) -> dict[str, Any]:
        """Which process serves this replica now (it changes when Serve restarts it)."""
        return {"instance": self.instance, "pid": os.getpid()}

    async def flush_cache(self) -> None:
        await asyncio.to_thread(self.runtime.flush_cache)

    async def explain_cache(self, request: dict[str, Any]) -> dict[str, Any]:
        return await asyncio.to_thread(lambda: self.runtime.explain_cache(**request))

    async def cache_tree_svg(self, max_nodes: int, cache_salt: Any) -> str:
        return await asyncio.to_thread(lambda: self.runtime.cache_tree_svg(max_nodes, cache_salt=cache_salt))

    def abort(self, rid: str) -> None:
        self.runtime.abort(rid)

    def is_alive(self) -> bool:
        return self.runtime.is_alive()

    def check_health(self) -> None:
        """Ray Serve's health check: an engine that stopped makes Serve restart the replica."""
        if not self.runtime.is_alive():
            raise RuntimeError("the replica's engine has stopped")

    def __del__(self) -> None:
        runtime = getattr(self, "runtime", None)
        if runtime is not None:
            runtime.shutdown()
