"""The cache-aware router's policy, with replicas that are real radix trees publishing their events.

Each fake replica is a `RadixTree` recording events: serving a request
inserts its tokens, and the router hears about it only through the drained
events, as it will from a real replica.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.scaleout.config import RouterConfig
from radixrt.scaleout.router import Router
from radixrt.tree import RadixTree

SYSTEM_A = list(range(1000, 1100))
SYSTEM_B = list(range(2000, 2100))


class Fleet:
    """Replicas as plain trees, and a router fed their events."""

    def __init__(self, names=("r0", "r1"), **config):
        self.router = Router(RouterConfig(**config))
        self.trees: dict[str, RadixTree] = {}
        self.slot = 0
        for name in names:
            self.join(name)

    def join(self, name: str) -> None:
        self.trees[name] = RadixTree()
        self.trees[name].record_events()
        self.router.add_replica(name)

    def serve(self, tokens, namespace=None, finish: bool = True):
        """Route a request, let its replica cache it, publish the events; return the route."""
        route = self.router.route(tokens, namespace)
        tree = self.trees[route.replica]
        tree.insert(tokens, torch.arange(self.slot, self.slot + len(tokens)), namespace)
        self.slot += len(tokens)
        self.publish(route.replica)
        if finish:
            self.router.finished(route)
        return route

    def publish(self, name: str) -> None:
        self.router.apply_events(name, self.trees[name].drain_events())


def turn(conversation: list[int], n: int) -> list[int]:
    return conversation + [7, n] * 20


def test_a_conversation_stays_on_one_replica_and_tenants_spread():
    fleet = Fleet()
    first_a = fleet.serve(SYSTEM_A + [1, 2, 3])
    first_b = fleet.serve(SYSTEM_B + [4, 5, 6])
    assert first_a.reason == first_b.reason == "load"
    assert first_a.replica != first_b.replica  # the new tenant goes where nothing is cached
    conversation = SYSTEM_A + [1, 2, 3]
    for n in range(5):
        conversation = turn(conversation, n)
        route = fleet.serve(conversation)
        assert route.replica == first_a.replica and route.reason == "prefix"
        assert route.matched_tokens >= len(SYSTEM_A)
    assert fleet.serve(SYSTEM_B + [9]).replica == first_b.replica


def test_requests_in_flight_attract_their_prefix_before_any_event():
    fleet = Fleet()
    first = fleet.router.route(SYSTEM_A + [1])  # routed, not served: no event yet
    for n in range(3):
        route = fleet.router.route(SYSTEM_A + [n + 2])
        assert route.replica == first.replica and route.reason == "prefix"


def test_the_load_guard_is_per_request():
    fleet = Fleet(max_load_gap=2)
    home = fleet.serve(SYSTEM_A + [1]).replica
    other = next(n for n in fleet.trees if n != home)
    busy = [fleet.router.route(SYSTEM_A + [10 + i]) for i in range(4)]
    # In flight at home before each: 0, 1, 2, 3 against 0 on the other; a gap of 2 allows the first three.
    assert [(r.replica, r.reason) for r in busy] == [(home, "prefix")] * 3 + [(other, "load")]
    fleet.router.finished(busy[0])
    fleet.router.finished(busy[3])  # never served: the other replica holds nothing of it now
    assert fleet.router.route(SYSTEM_A + [99]).replica == home  # 2 in flight against 0: within the gap again


def test_an_eviction_event_stops_routing_to_the_evicted_prefix():
    fleet = Fleet()
    home = fleet.serve(SYSTEM_A + [1]).replica
    fleet.trees[home].evict(10_000)
    fleet.publish(home)
    assert fleet.router.cached_tokens(home) == 0
    route = fleet.router.route(SYSTEM_A + [2])
    assert route.reason == "load" and route.matched_tokens == 0


def test_a_replica_that_leaves_gets_nothing_and_comes_back_empty():
    fleet = Fleet(names=("r0", "r1", "r2"))
    home = fleet.serve(SYSTEM_A + [1]).replica
    fleet.router.remove_replica(home)
    assert all(fleet.serve(SYSTEM_A + [n]).replica != home for n in range(6))
    fleet.join(home)  # restarted: an empty tree on both sides
    assert fleet.router.cached_tokens(home) == 0 and fleet.router.load(home) == 0
    fleet.router.apply_events("never-joined", [])  # a late report from an unknown replica is ignored
    fleet.router.remove_replica("never-joined")
    with pytest.raises(RuntimeError, match="no replica"):
        Router().route([1, 2])


def test_namespaces_never_share_routing_state():
    fleet = Fleet()
    home = fleet.serve(SYSTEM_A + [1], namespace=("cache_salt", "tenant-x")).replica
    route = fleet.router.route(SYSTEM_A + [2], namespace=("cache_salt", "tenant-y"))
    assert route.matched_tokens == 0 and route.reason == "load"
    assert route.replica != home  # least loaded with the fewest cached tokens


def test_short_matches_route_by_load():
    fleet = Fleet(min_match_tokens=32)
    template = [5] * 10
    home = fleet.serve(template + [1]).replica
    route = fleet.router.route(template + [2])
    assert route.reason == "load" and route.replica != home


def test_baselines_ignore_the_cache():
    fleet = Fleet(names=("r0", "r1", "r2"), policy="round_robin")
    assert [fleet.serve(SYSTEM_A).replica for _ in range(6)] == ["r0", "r1", "r2"] * 2
    least = Fleet(policy="least_load")
    held = least.router.route(SYSTEM_A)
    assert least.router.route(SYSTEM_A).replica != held.replica


@pytest.mark.parametrize(
    ("config", "field"),
    [({"policy": "random"}, "router"), ({"min_match_tokens": -1}, "min_match_tokens"), ({"max_load_gap": 1.5}, "max_load_gap")],
)
def test_bad_config_names_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        RouterConfig(**config)


@settings(max_examples=100, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.booleans()), max_size=40),
    gap=st.integers(0, 3),
)
def test_prefix_routing_never_exceeds_the_load_gap(requests, gap):
    fleet = Fleet(names=("r0", "r1", "r2"), max_load_gap=gap, min_match_tokens=4)
    open_routes = []
    for prefix, suffix, finish in requests:
        loads = {name: fleet.router.load(name) for name in fleet.trees}
        route = fleet.serve([prefix] * 8 + [suffix], finish=finish)
        assert loads[route.replica] - min(loads.values()) <= gap
        if not finish:
            open_routes.append(route)
        elif open_routes:
            fleet.router.finished(open_routes.pop(0))


def test_a_runtime_drains_events_that_keep_a_router_exact(tiny_llama_dir):
    from radixrt import Runtime

    with Runtime(tiny_llama_dir, device="cpu", dtype="float32", max_total_tokens=256) as rt:
        first = list(range(10, 70))
        rt.generate(input_ids=first, sampling_params={"max_new_tokens": 2, "temperature": 0})
        router = Router()
        router.add_replica("rt")
        router.apply_events("rt", rt.drain_cache_events())  # the first drain: everything cached so far
        assert router.cached_tokens("rt") == rt.cache_stats()["tree_tokens"]
        for n in range(6):  # a 256-token pool: later prompts evict earlier ones
            rt.generate(input_ids=[3 + n] * 90, sampling_params={"max_new_tokens": 2, "temperature": 0})
            router.apply_events("rt", rt.drain_cache_events())
            assert router.cached_tokens("rt") == rt.cache_stats()["tree_tokens"]
        assert rt.cache_stats()["evicted_tokens"] > 0
        assert router.route(first).matched_tokens == 0  # evicted there, so not matched here


def test_a_suspended_replica_keeps_its_mirror_and_gets_nothing_until_resumed():
    fleet = Fleet()
    home = fleet.serve(SYSTEM_A + [1]).replica
    fleet.router.suspend(home)
    assert fleet.router.replicas == [n for n in fleet.trees if n != home]
    assert fleet.router.route(SYSTEM_A + [2]).replica != home
    fleet.router.resume(home)
    assert fleet.router.cached_tokens(home) == len(SYSTEM_A) + 1  # the mirror survived
    assert fleet.router.route(SYSTEM_A + [3]).replica == home
