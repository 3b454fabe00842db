"""Ray Serve's own PrefixCacheAffinityRouter in front of radixrt replicas: a baseline for scaleout_bench.

Not part of radixrt: the same replicas and the same HTTP app, but the N
replicas form one Serve deployment and Serve's handle picks the replica
with Ray's router (ray 2.60: a character-level prefix tree of the text it
routed, in a separate actor; it never hears of evictions). The ingress
gives it each request's templated prompt text as `.prompt` (Ray's own chat
path would give it only the messages' contents). Settings, stated for a
fair comparison: imbalanced_threshold 4 (radixrt's --router-max-load-gap
default; Ray's default is no load guard), match_rate_threshold 0.1 (its
default), do_eviction on (off by default; on is kinder to it over a long run).

Run: python bench/ray_prefix_baseline.py --port P --replicas N [--max-total-tokens T]
(serves until SIGTERM; started by scaleout_bench.py --systems ray_prefix)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Hashable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixrt.scaleout.config import RouterConfig  # noqa: E402
from radixrt.scaleout.deploy import FleetSpec, serve_logging  # noqa: E402
from radixrt.scaleout.fleet import ReplicaFleet, cancel_with_caller  # noqa: E402
from radixrt.scaleout.replica import RuntimeReplica  # noqa: E402
from radixrt.scaleout.router import Router  # noqa: E402
from radixrt.server.app import ServerSettings, create_app  # noqa: E402

RAY_ROUTER = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter"
RAY_ROUTER_SETTINGS = {"imbalanced_threshold": 4, "match_rate_threshold": 0.1, "do_eviction": True}


class PromptReplica(RuntimeReplica):
    """A replica whose calls carry `.prompt`, the attribute Ray's router reads."""

    async def generate(self, routed: Any) -> Any:  # type: ignore[override]
        return await super().generate(routed.call)

    async def generate_stream(self, routed: Any) -> AsyncIterator[dict]:  # type: ignore[override]
        async for chunk in super().generate_stream(routed.call):
            yield chunk


class PoolFleet(ReplicaFleet):
    """The fleet with routing left to Serve's handle (one deployment of N replicas)."""

    async def start(self) -> None:
        import asyncio

        self._loop = asyncio.get_running_loop()
        self.router.add_replica("pool")

    async def _generate(self, call: dict[str, Any], namespace: Hashable) -> Any:
        return await cancel_with_caller(self._handles["pool"].generate.remote(self._routed(call)))

    async def _stream_one(self, call: dict[str, Any], namespace: Hashable) -> AsyncIterator[dict]:
        chunks = self._handles["pool"].options(stream=True).generate_stream.remote(self._routed(call))
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            chunks.cancel()

    def _routed(self, call: dict[str, Any]) -> SimpleNamespace:
        return SimpleNamespace(prompt=self.tokenizer.decode(call["input_ids"]), call=call)

    def replica_stats(self) -> list[dict[str, Any]]:
        return []  # Serve picks the replica: the ingress cannot address one to ask


class PoolIngress:
    async def __init__(self, spec: FleetSpec, pool: Any):  # type: ignore[misc]
        from ray.exceptions import RayActorError

        description = await pool.describe.remote()
        self.spec = spec
        self.fleet = PoolFleet({"pool": pool}, Router(spec.router), description, (RayActorError,))
        await self.fleet.start()

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(self.fleet, self.spec.settings)  # type: ignore[arg-type]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--max-total-tokens", type=int, default=32768)
    args = parser.parse_args()
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    spec = FleetSpec(None, {"max_total_tokens": args.max_total_tokens}, ServerSettings(), args.replicas,
                     RouterConfig())
    threads = max(1, (os.cpu_count() or 1) // args.replicas)
    ray.init(num_cpus=max(os.cpu_count() or 1, args.replicas), include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port}, logging_config=serve_logging())
    pool: Any = serve.deployment(PromptReplica)
    ingress: Any = serve.deployment(serve.ingress()(PoolIngress))
    app = ingress.options(name="ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000,
                          logging_config=serve_logging()).bind(
        spec,
        pool.options(
            name="pool", num_replicas=args.replicas, max_ongoing_requests=2048, logging_config=serve_logging(),
            ray_actor_options={"num_cpus": 1, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}}},
            request_router_config=RequestRouterConfig(request_router_class=RAY_ROUTER,
                                                      request_router_kwargs=RAY_ROUTER_SETTINGS),
        ).bind(None, spec.runtime_options),
    )
    serve.run(app, name="ray_prefix", route_prefix="/")
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    stopped.wait()
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
