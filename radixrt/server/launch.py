"""`radixrt serve`: build the runtime, serve the app with uvicorn, log a status line while busy.

SIGINT/SIGTERM stop the server gracefully: uvicorn stops accepting, lets
in-flight requests finish (for up to `graceful_timeout_s`, after which their
tasks are cancelled, which aborts them in the engine), then the runtime
shuts down and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from typing import Any, Iterator

import uvicorn

from radixrt.runtime import Runtime
from radixrt.server.app import ServerSettings, create_app

logger = logging.getLogger("radixrt.server")


def serve(
    model: Any,
    runtime_options: dict[str, Any],
    settings: ServerSettings,
    host: str = "127.0.0.1",
    port: int = 30000,
    status_interval_s: float = 5.0,
    graceful_timeout_s: float = 30.0,
) -> int:
    started = time.perf_counter()
    logger.info("loading %s (the first start converts a GGUF model; later starts reuse the conversion)",
                model or "the bundled SmolLM2-135M-Instruct")
    runtime = Runtime(model, **runtime_options)
    try:
        engine = runtime.engine
        kv = engine.runner.kv_cache
        logger.info(
            "model %s: %s on %s, attention backend %s, KV pool %d tokens (%.0f MB), page size %d; loaded in %.1f s",
            runtime.model_name, str(engine.runner.model.dtype).removeprefix("torch."), engine.device,
            engine.runner.backend.name, kv.num_slots, kv.total_bytes / 2**20, runtime.config.page_size,
            time.perf_counter() - started,
        )
        app = create_app(runtime, settings)
        config = uvicorn.Config(
            app, host=host, port=port, log_level=logging.getLevelName(logger.getEffectiveLevel()).lower(),
            timeout_graceful_shutdown=int(graceful_timeout_s), access_log=logger.isEnabledFor(logging.DEBUG),
        )
        server = uvicorn.Server(config)
        logger.info("serving on http://%s:%d (OpenAI API under /v1)", host, port)
        with _signals_end_serving():
            asyncio.run(_serve_with_status(server, runtime, status_interval_s))
    finally:
        runtime.shutdown()
    logger.info("shut down")
    return 0


@contextlib.contextmanager
def _signals_end_serving() -> Iterator[None]:
    """Make SIGINT/SIGTERM mean "stop serving", then exit 0.

    uvicorn handles the signal while it serves (a graceful shutdown) and then
    raises it again for the handler that was there before; this one takes it
    quietly, so the runtime still shuts down and the exit code is 0.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop_requested(signum: int, frame: Any) -> None:
        logger.info("%s: shutting down", signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, stop_requested) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


async def _serve_with_status(server: uvicorn.Server, runtime: Runtime, interval_s: float) -> None:
    status = asyncio.create_task(_log_status(runtime, interval_s))
    try:
        await server.serve()
    finally:
        status.cancel()


async def _log_status(runtime: Runtime, interval_s: float) -> None:
    """Every `interval_s` while there is work: running, queued, pool use, hit rate, generation speed."""
    last_tokens, last_time = 0, time.perf_counter()
    while True:
        await asyncio.sleep(interval_s)
        stats = await asyncio.to_thread(runtime.cache_stats)
        now = time.perf_counter()
        generated = int(stats["generated_tokens"])
        if stats["running_requests"] or stats["waiting_requests"] or generated != last_tokens:
            logger.info(
                "running %d, queued %d, token usage %.2f, cache hit rate %.1f%%, generation %.1f tokens/s",
                stats["running_requests"], stats["waiting_requests"],
                stats["pool_used_tokens"] / max(stats["pool_total_tokens"], 1), 100 * stats["hit_rate"],
                (generated - last_tokens) / (now - last_time),
            )
        last_tokens, last_time = generated, now
