"""Past one machine: replicas of a Runtime behind a cache-aware router (see docs/scaleout.md)."""

from radixrt.scaleout.router import POLICIES, Route, Router, RouterConfig

__all__ = ["POLICIES", "Route", "Router", "RouterConfig"]
