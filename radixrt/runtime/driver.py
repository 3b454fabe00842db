"""The engine's thread: building the engine, and the only place that touches it afterwards.

Callers post actions (add requests, abort, run a function between steps);
the thread applies them and steps while there is work. The lock guards only
the action list, never a step, so a caller never waits for a long step to
post an abort or ask for stats.

Sizing the KV pool is the one decision made when building: an explicit
`max_total_tokens`, else a share of free GPU memory after the weights, else a
byte budget on the CPU.

At log level info the build ends with one summary line (model, dtype,
device, backend, KV pool), and while there is work the thread logs a status
line every `STATUS_INTERVAL_S`, so a long batch job shows it is moving.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from radixrt.config import RuntimeConfig
from radixrt.engine.cache_manager import CacheManager, NoPrefixCache
from radixrt.engine.engine import Engine
from radixrt.engine.radix_cache import RadixCacheManager
from radixrt.engine.request import Request
from radixrt.kernels.registry import create_backend
from radixrt.memory import KVCache, KVShape, PagePool
from radixrt.model.loader import LoadedModel, load_model, resolve_device, resolve_dtype
from radixrt.model.runner import ModelRunner, StepThreads
from radixrt.runtime.inputs import RequestLimits

logger = logging.getLogger(__name__)

STATUS_INTERVAL_S = 10.0


@dataclass(frozen=True)
class BuiltEngine:
    engine: Engine
    loaded: LoadedModel
    limits: RequestLimits
    eos_token_ids: tuple[int, ...]


def build_engine(model: Any, config: RuntimeConfig) -> BuiltEngine:
    """Load the model (or take a loaded one), size the KV pool and wire the engine's parts together."""
    started = time.perf_counter()
    wanted = config.device
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(model, LoadedModel):
        check_loaded_model(model, config)
        loaded = model
    else:
        loaded = load_model(model, device=wanted, dtype=config.dtype, weights=config.weights, quantize=config.quantize,
                            kv_pool_bytes=lambda kv: pool_tokens(config, kv, torch.device(wanted)) * kv.bytes_per_token)
    device = loaded.model.device
    model_config = loaded.config
    shape = model_config.kv_shape(loaded.model.dtype)
    num_pages = pool_tokens(config, shape, device) // config.page_size
    if num_pages < 1:
        raise ValueError("the KV budget holds less than one page; raise max_total_tokens or the memory budget")
    logger.info("allocating the KV pool: %d tokens, %.0f MB", num_pages * config.page_size,
                num_pages * config.page_size * shape.bytes_per_token / 2**20)
    kv_cache = KVCache(shape, num_pages * config.page_size, device)
    backend = create_backend(
        config.attention_backend,
        kv_cache,
        model_config.num_heads,
        model_config.num_kv_heads,
        model_config.head_dim,
        config.page_size,
        shared_prefix_min_tokens=config.shared_prefix_min_tokens,
    )
    threads = StepThreads(config.small_step_threads, config.small_step_tokens)
    runner = ModelRunner(loaded.model, kv_cache, backend, threads, deterministic=config.deterministic)
    pool = PagePool(num_pages, config.page_size)
    cache: CacheManager = NoPrefixCache(pool) if config.disable_radix_cache else RadixCacheManager(pool)
    limits = RequestLimits(
        vocab_size=model_config.vocab_size,
        context_len=model_config.context_len,
        pool_tokens=num_pages * config.page_size,
    )
    logger.info(
        "ready in %.1f s: %s, %s on %s, %s weights, attention backend %s, KV pool %d tokens (%.0f MB), "
        "page size %d, radix cache %s%s",
        time.perf_counter() - started, loaded.name, str(loaded.model.dtype).removeprefix("torch."), device,
        loaded.weights, backend.name, kv_cache.num_slots, kv_cache.total_bytes / 2**20, config.page_size,
        "off" if config.disable_radix_cache else "on", ", deterministic" if runner.deterministic else "",
    )
    return BuiltEngine(Engine(runner, cache, config), loaded, limits, tuple(eos_token_ids(loaded)))


def check_loaded_model(loaded: LoadedModel, config: RuntimeConfig) -> None:
    """A model loaded beforehand is used as it is: device, dtype and weights must be "auto" or match it."""
    device, dtype = loaded.model.device, loaded.model.dtype
    if config.device != "auto" and resolve_device(config.device).type != device.type:
        raise ValueError(f"device {config.device!r} asked for, but the loaded model is on {device}")
    if config.dtype != "auto" and resolve_dtype(config.dtype, device) != dtype:
        raise ValueError(f"dtype {config.dtype!r} asked for, but the loaded model is in {dtype}")
    if config.weights not in ("auto", loaded.weights):
        raise ValueError(f"weights {config.weights!r} asked for, but the loaded model's are {loaded.weights!r}")
    if config.quantize not in (None, loaded.weights):
        raise ValueError(f"quantize {config.quantize!r} asked for, but the loaded model's weights are "
                         f"{loaded.weights!r}")


def pool_tokens(config: RuntimeConfig, shape: KVShape, device: torch.device) -> int:
    if config.max_total_tokens is not None:
        return config.max_total_tokens
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return shape.tokens_for_bytes(int(free_bytes * config.kv_memory_fraction))
    return shape.tokens_for_bytes(config.kv_memory_bytes)


def eos_token_ids(loaded: LoadedModel) -> list[int]:
    ids = set(loaded.config.eos_token_ids)
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    return sorted(ids)


class EngineDriver:
    """Runs `engine` on a background thread; every public method is safe from any thread."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._cv = threading.Condition()
        self._actions: list[tuple[str, Any]] = []
        self._closed = False
        self._shut_down = False  # by shutdown(); _closed also covers an engine error
        self._engine_error: BaseException | None = None
        self._status = StatusLine(engine)
        self._thread = threading.Thread(target=self._loop, name="radixrt-engine", daemon=True)
        self._thread.start()
        _live_drivers.add(self)

    def submit(self, requests: list[Request]) -> None:
        self._post("add", requests)

    def abort(self, rid: str) -> None:
        self._post("abort", rid)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between two steps and return its result.

        Only the engine thread touches engine state while it runs, so callers
        never see a half-done step and never hold a lock the step loop needs.
        """
        if threading.current_thread() is self._thread:
            return fn()
        with self._cv:
            closed, shut_down = self._closed, self._shut_down
        if shut_down:
            raise RuntimeError("the runtime is shut down")
        if closed or not self._thread.is_alive():
            # Stopped by an engine error: once the thread has ended, its state is safe to read (and worth it).
            self._thread.join()
            return fn()
        reply: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self._post("call", (fn, reply))
        ok, value = reply.get()
        if not ok:
            raise value
        return value

    def is_alive(self) -> bool:
        with self._cv:
            return self._thread.is_alive() and not self._closed and self._engine_error is None

    def shutdown(self) -> None:
        with self._cv:
            self._closed = self._shut_down = True
            self.engine.interrupt_run()
            self._cv.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def _post(self, action: str, payload: Any) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("the runtime is shut down")
            if self._engine_error is not None:
                raise RuntimeError("the engine stopped after an internal error") from self._engine_error
            self._actions.append((action, payload))
            self.engine.interrupt_run()  # a decode run in progress ends at its next step
            self._cv.notify()

    def _loop(self) -> None:
        """Apply posted actions, then step; the lock is never held during a step.

        The whole loop runs in inference mode: the engine never needs autograd, and a runtime
        built inside a caller's `torch.inference_mode()` holds inference tensors (the KV pool,
        the page pool's free map) that may only be updated in place in that mode.
        """
        failure: BaseException | None = None
        threads = self.engine.runner.threads
        if threads is not None:  # this thread's torch ops between steps are small
            torch.set_num_threads(threads.between_steps())
        try:
            with torch.inference_mode():
                self._serve()
        except Exception as error:  # an engine bug: fail every request, keep the process alive
            logger.exception("engine step failed")
            failure = self._engine_error = error
        finally:
            self._fail_outstanding(failure or RuntimeError("the runtime was shut down"))

    def _serve(self) -> None:
        """Until shut down: the posted actions, then a step whenever there is work."""
        while True:
            with self._cv:
                while not self._actions and not self.engine.has_work and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                actions, self._actions = self._actions, []
                self.engine.interrupt_run(False)  # taken: the next run may run its length
            for action, payload in actions:
                self._apply(action, payload)
            if self.engine.has_work:
                self.engine.step()
                self._status.tick(busy=self.engine.has_work)

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

    def _fail_outstanding(self, reason: BaseException) -> None:
        """Nobody waits forever: every request still running or queued gets `reason`."""
        with self._cv:
            self._closed = True
            actions, self._actions = self._actions, []
        waiting = list(self.engine.scheduler.requests())
        for action, payload in actions:
            if action == "add":
                waiting.extend(payload)
            elif action == "call":
                payload[1].put((False, reason))
        for req in waiting:
            if req.on_output is not None:
                req.on_output(reason)


class StatusLine:
    """Every `interval_s` of stepping, one info line: requests, pool use, hit rate, generation speed.

    Called by the engine thread after each step, so it reads the engine
    directly; an idle engine does not step and so logs nothing.
    """

    def __init__(self, engine: Engine, interval_s: float = STATUS_INTERVAL_S):
        self.engine = engine
        self.interval_s = interval_s
        self._last_time = time.perf_counter()
        self._last_tokens = 0

    def tick(self, busy: bool) -> None:
        """After a step; `busy`: work remains. The interval restarts when the engine goes idle."""
        now = time.perf_counter()
        if not busy:
            self._last_time, self._last_tokens = now, self.engine.num_generated_tokens
            return
        if now - self._last_time < self.interval_s:
            return
        stats = self.engine.stats()
        generated = int(stats["generated_tokens"])
        logger.info(
            "running %d, queued %d, KV pool %.0f%% used, cache hit rate %.1f%%, generation %.1f tokens/s",
            stats["running_requests"], stats["waiting_requests"],
            100 * stats["pool_used_tokens"] / max(stats["pool_total_tokens"], 1), 100 * stats["hit_rate"],
            (generated - self._last_tokens) / (now - self._last_time),
        )
        self._last_time, self._last_tokens = now, generated


# The engine thread is a daemon so a forgotten Runtime never blocks exit, but
# a daemon killed inside a torch op aborts the interpreter: stop them first.
_live_drivers: weakref.WeakSet[EngineDriver] = weakref.WeakSet()


@atexit.register
def _shutdown_live_drivers() -> None:
    for driver in list(_live_drivers):
        driver.shutdown()
