"""`radixrt serve`: build the runtime and serve the app with uvicorn.

The runtime itself logs its start-up summary and, while busy, a status line
(`radixrt.runtime.driver`); this module only adds the serving address.

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
from collections.abc import Iterator
from typing import Any

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
    graceful_timeout_s: float = 30.0,
) -> int:
    logger.info("loading %s (the first start converts a GGUF model; later starts reuse the conversion)",
                model or "the bundled SmolLM2-135M-Instruct")
    runtime = Runtime(model, **runtime_options)
    try:
        app = create_app(runtime, settings)
        config = uvicorn.Config(
            app, host=host, port=port, log_level=logging.getLevelName(logger.getEffectiveLevel()).lower(),
            timeout_graceful_shutdown=int(graceful_timeout_s), access_log=logger.isEnabledFor(logging.DEBUG),
        )
        server = uvicorn.Server(config)
        logger.info("serving on http://%s:%d (OpenAI API under /v1)", host, port)
        with _signals_end_serving():
            asyncio.run(server.serve())
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
