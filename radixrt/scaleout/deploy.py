"""`radixrt serve --replicas N`: replicas of a Runtime on Ray Serve, behind one ingress that routes.

The application is N deployments of one replica each (`replica-0`, ...)
and an ingress deployment serving the same HTTP API as a single server
(`radixrt.server.app`), with a `ReplicaFleet` in place of the Runtime. One
deployment per replica is what lets the ingress pick the replica: a Serve
handle to a deployment of N replicas picks among them itself. Serve's own
request-router interface runs inside the handle, but the state it can see of
a replica is a stats dict the controller polls every few seconds and keeps
only the latest of; exact mirrors need every insert and eviction, in order,
so the ingress drains them itself (docs/scaleout.md).

Only this module imports Ray, and only when replicas are asked for.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass
from typing import Any

from radixrt.scaleout.fleet import EVENT_INTERVAL_S, ReplicaFleet
from radixrt.scaleout.replica import RuntimeReplica
from radixrt.scaleout.config import RouterConfig
from radixrt.scaleout.router import Router
from radixrt.server.app import ServerSettings, create_app

logger = logging.getLogger("radixrt.scaleout")

APP_NAME = "radixrt"
RAY_MISSING = "--replicas and --ray-address need Ray Serve: pip install 'radixrt[ray]'"


@dataclass(frozen=True)
class FleetSpec:
    """Everything that decides the application: the model, how many replicas, how they are routed."""

    model: Any
    runtime_options: dict[str, Any]
    settings: ServerSettings
    replicas: int
    router: RouterConfig
    replica_cpus: float = 1.0
    replica_threads: int | None = None
    event_interval_s: float = EVENT_INTERVAL_S

    def __post_init__(self) -> None:
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {self.replicas!r}")


def check_ray() -> None:
    """Fail before anything starts when Ray Serve is not installed."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise ValueError(RAY_MISSING) from None


def check_reachable(address: str) -> None:
    """Refuse a host:port nothing answers at: Ray itself would keep retrying for minutes."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return  # "auto", or a ray:// client address: Ray resolves and reports those itself
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as error:
        raise ValueError(
            f"--ray-address {address}: nothing answers there ({error}); start the head node with `ray start --head`"
        ) from None


class FleetIngress:
    """The ingress deployment's class: one fleet, and the HTTP app over it (Serve wraps this class)."""

    async def __init__(self, spec: FleetSpec, *replicas: Any):  # type: ignore[misc]  # Serve awaits it
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import ReplicaUnavailableError

        handles = {handle.deployment_name: handle for handle in replicas}
        description = await next(iter(handles.values())).describe.remote()
        self.spec = spec
        self.fleet = ReplicaFleet(
            handles, Router(spec.router), description, (RayActorError, ReplicaUnavailableError), spec.event_interval_s
        )
        await self.fleet.start()

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(self.fleet, self.spec.settings)  # type: ignore[arg-type]


def build_application(spec: FleetSpec) -> Any:
    """The Serve application: the replica deployments bound into the ingress."""
    from ray import serve

    env = {"OMP_NUM_THREADS": str(spec.replica_threads)} if spec.replica_threads else {}
    logs = serve_logging()
    replica: Any = serve.deployment(RuntimeReplica)
    bound = [
        replica.options(
            name=f"replica-{k}",
            num_replicas=1,
            max_ongoing_requests=spec.settings.max_queued_requests + 1024,
            ray_actor_options={"num_cpus": spec.replica_cpus, "runtime_env": {"env_vars": env}},
            logging_config=logs,
        ).bind(spec.model, spec.runtime_options)
        for k in range(spec.replicas)
    ]
    ingress: Any = serve.deployment(serve.ingress()(FleetIngress))
    return ingress.options(
        name="ingress", num_replicas=1, max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0},
        logging_config=logs,
    ).bind(spec, *bound)


def serve_logging() -> dict[str, Any]:
    """Serve's access log has a line per call, and the event pump calls every replica ten times a second."""
    debug = logger.isEnabledFor(logging.DEBUG)
    return {"log_level": "DEBUG" if debug else "WARNING", "enable_access_log": debug}


def start(spec: FleetSpec, host: str, port: int, ray_address: str | None) -> None:
    """Connect to (or start) Ray, start Serve's HTTP proxy on host:port and deploy; returns once serving."""
    import ray
    from ray import serve

    if ray_address:
        check_reachable(ray_address)
        try:
            ray.init(address=ray_address, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as error:
            raise ValueError(f"--ray-address {ray_address}: could not connect to Ray ({error})") from None
    else:
        cpus = max(os.cpu_count() or 1, int(spec.replicas * spec.replica_cpus + 0.999))
        ray.init(num_cpus=cpus, include_dashboard=False, logging_level=logging.WARNING)
    serve.start(http_options={"host": host, "port": port}, logging_config=serve_logging())
    serve.run(build_application(spec), name=APP_NAME, route_prefix="/")


def stop() -> None:
    """Tear the application and the Ray connection down (a Ray instance we started ends with it)."""
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def serve_forever(spec: FleetSpec, host: str, port: int, ray_address: str | None) -> int:
    """`radixrt serve --replicas N`: deploy, serve until SIGINT/SIGTERM, tear down, exit 0."""
    start(spec, host, port, ray_address)
    logger.info("serving %d replicas on http://%s:%d (router: %s)", spec.replicas, host, port, spec.router.policy)
    stopped = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stopped.set())
    try:
        stopped.wait()
    finally:
        stop()
    logger.info("shut down")
    return 0
