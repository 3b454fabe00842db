"""Which replica gets a request: the longest cached prefix, unless that replica is too busy.

A radix cache pays only when a request lands where its prefix is cached.
The router keeps, per replica, an exact mirror of that replica's tree: each
replica records its tree's inserts and evictions (`RadixTree.record_events`)
and the router applies them in order, so it never routes to a prefix the
replica has already evicted (a router that guesses from the text it routed
does). Requests routed but not yet finished count too: their prompts will be
cached once prefilled, so a burst of one conversation stays on one replica
before any event arrives.

Routing, per request (`prefix`):
  1. match the request's tokens against every live replica: the longest
     cached prefix, in the request's namespace only;
  2. if the best match is at least `min_match_tokens` and its replica has at
     most `max_load_gap` more requests in flight than the least loaded one,
     send it there (a guard per request: one hot replica loses only the
     requests that would queue behind it, not everyone's affinity);
  3. otherwise the least loaded replica, and among equals the one holding the
     fewest cached tokens, so new prefixes (a new tenant's system prompt)
     spread over the replicas.
`round_robin` and `least_load` ignore the cache: they are the baselines.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from radixrt.scaleout.config import Reason, RouterConfig
from radixrt.tree import RadixTree
from radixrt.tree.events import CacheEvent
from radixrt.tree.keys import TOKEN_BYTES

@dataclass
class _Replica:
    name: str
    mirror: RadixTree = field(default_factory=RadixTree)
    in_flight: dict[int, tuple[Hashable, bytes]] = field(default_factory=dict)  # ticket -> (namespace, tokens)
    suspended: bool = False


@dataclass(frozen=True)
class Route:
    """Where a request goes, and why (for logs, metrics and tests)."""

    replica: str
    ticket: int
    matched_tokens: int
    reason: Reason


class Router:
    """Routing state for a set of replicas; not thread-safe (one event loop owns it)."""

    def __init__(self, config: RouterConfig | None = None):
        self.config = config or RouterConfig()
        self._replicas: dict[str, _Replica] = {}
        self._tickets = itertools.count()
        self._turn = 0

    # --- membership -----------------------------------------------------------------
    @property
    def replicas(self) -> list[str]:
        """The replicas requests are routed to now (members not suspended)."""
        return [name for name, replica in self._replicas.items() if not replica.suspended]

    def add_replica(self, name: str) -> None:
        """A replica joins (or restarts) with an empty cache."""
        self._replicas[name] = _Replica(name)

    def remove_replica(self, name: str) -> None:
        """A replica left for good: nothing is routed to it any more; unknown names are ignored."""
        self._replicas.pop(name, None)

    def suspend(self, name: str) -> None:
        """Stop routing to a replica that does not answer, keeping its mirror for when it does again."""
        if name in self._replicas:
            self._replicas[name].suspended = True

    def resume(self, name: str) -> None:
        if name in self._replicas:
            self._replicas[name].suspended = False

    # --- what replicas report ---------------------------------------------------------
    def apply_events(self, name: str, events: list[CacheEvent]) -> None:
        """A replica's tree changed: replay its events on its mirror (in the order it sent them)."""
        replica = self._replicas.get(name)
        if replica is not None:
            replica.mirror.apply_events(events)

    def finished(self, route: Route) -> None:
        """The routed request is done (or failed): it no longer loads its replica."""
        replica = self._replicas.get(route.replica)
        if replica is not None:
            replica.in_flight.pop(route.ticket, None)

    def load(self, name: str) -> int:
        return len(self._replicas[name].in_flight)

    def cached_tokens(self, name: str) -> int:
        return self._replicas[name].mirror.total_tokens

    # --- routing --------------------------------------------------------------------
    def route(self, tokens: Sequence[int], namespace: Hashable = None) -> Route:
        """Pick a replica for a request of `tokens` in `namespace`, and count it as in flight there."""
        replicas = [r for r in self._replicas.values() if not r.suspended]
        if not replicas:
            raise RuntimeError("no replica is available")
        values = array("q", tokens)
        reason: Reason
        if self.config.policy == "round_robin":
            chosen, matched, reason = replicas[self._turn % len(replicas)], 0, "round_robin"
            self._turn += 1
        elif self.config.policy == "least_load":
            chosen, matched, reason = self._least_loaded(replicas), 0, "load"
        else:
            chosen, matched, reason = self._by_prefix(replicas, values, namespace)
        ticket = next(self._tickets)
        chosen.in_flight[ticket] = (namespace, values.tobytes())
        return Route(chosen.name, ticket, matched, reason)

    def closest(self, tokens: Sequence[int], namespace: Hashable = None) -> str:
        """The replica holding the longest prefix of `tokens` (least loaded among equals); routes nothing."""
        replicas = [r for r in self._replicas.values() if not r.suspended]
        if not replicas:
            raise RuntimeError("no replica is available")
        values = array("q", tokens)
        return max(replicas, key=lambda r: (_match(r, values, namespace), -len(r.in_flight))).name

    def _by_prefix(
        self, replicas: list[_Replica], values: array, namespace: Hashable
    ) -> tuple[_Replica, int, Literal["prefix", "load"]]:
        least = self._least_loaded(replicas)
        within = [r for r in replicas if len(r.in_flight) - len(least.in_flight) <= self.config.max_load_gap]
        matches = {r.name: _match(r, values, namespace) for r in within}
        best = max(within, key=lambda r: (matches[r.name], -len(r.in_flight), -r.mirror.total_tokens))
        if matches[best.name] >= max(self.config.min_match_tokens, 1):
            return best, matches[best.name], "prefix"
        return least, matches[least.name], "load"

    @staticmethod
    def _least_loaded(replicas: list[_Replica]) -> _Replica:
        return min(replicas, key=lambda r: (len(r.in_flight), r.mirror.total_tokens))


def _match(replica: _Replica, values: array, namespace: Hashable) -> int:
    """Tokens of `values` the replica has cached or is about to (a request in flight there has them)."""
    best = replica.mirror.explain(values, namespace).matched_tokens
    if best < len(values):
        packed = memoryview(values).cast("B")
        for other_namespace, other in replica.in_flight.values():
            if other_namespace == namespace:
                best = max(best, _common_tokens(packed, memoryview(other)))
    return best


def _common_tokens(a: memoryview, b: memoryview) -> int:
    """Leading tokens two packed sequences share (bisection over slice compares, no copies)."""
    low, high = 0, min(len(a), len(b)) // TOKEN_BYTES
    while low < high:
        mid = (low + high + 1) // 2
        if a[: mid * TOKEN_BYTES] == b[: mid * TOKEN_BYTES]:
            low = mid
        else:
            high = mid - 1
    return low
