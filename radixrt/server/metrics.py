"""Prometheus metrics of one server, in their own registry (one per app, so tests can build many).

Counters and histograms are fed by the routes as requests finish and tokens
stream; the gauges are read from the runtime's `cache_stats()` at scrape
time, so they are never stale.
"""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "radixrt:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.num_running_reqs = Gauge(PREFIX + "num_running_reqs", "Requests being computed", registry=registry)
        self.num_queue_reqs = Gauge(PREFIX + "num_queue_reqs", "Requests waiting for admission", registry=registry)
        self.token_usage = Gauge(PREFIX + "token_usage", "Share of the KV pool in use", registry=registry)
        self.cache_hit_rate = Gauge(
            PREFIX + "cache_hit_rate", "Cached prompt tokens / prompt tokens since start or flush", registry=registry
        )
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests", registry=registry)
        self.cached_prompt_tokens = Counter(
            PREFIX + "cached_prompt_tokens", "Prompt tokens found in the cache", registry=registry
        )
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated", registry=registry)
        self.requests = Counter(PREFIX + "requests", "Requests finished, aborted ones included", registry=registry)
        self.aborted_requests = Counter(PREFIX + "aborted_requests", "Requests aborted", registry=registry)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=registry
        )
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between two tokens of a request",
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=registry,
        )
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Submission to last token", buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_time = Histogram(
            PREFIX + "queue_time_seconds", "Submission to admission", buckets=_LATENCY_BUCKETS, registry=registry
        )
        # With replicas (radixrt serve --replicas N) the gauges above add the replicas up; these say each one's.
        self.replica_gauges = {
            "num_running_reqs": Gauge(PREFIX + "replica_num_running_reqs", "Requests being computed, per replica",
                                      ["replica"], registry=registry),
            "num_queue_reqs": Gauge(PREFIX + "replica_num_queue_reqs", "Requests waiting for admission, per replica",
                                    ["replica"], registry=registry),
            "token_usage": Gauge(PREFIX + "replica_token_usage", "Share of the replica's KV pool in use",
                                 ["replica"], registry=registry),
            "cache_hit_rate": Gauge(PREFIX + "replica_cache_hit_rate", "The replica's cached / prompt tokens",
                                    ["replica"], registry=registry),
            "in_flight": Gauge(PREFIX + "replica_in_flight", "Requests the router has in flight on the replica",
                               ["replica"], registry=registry),
            "routed": Gauge(PREFIX + "replica_routed", "1 while the router sends the replica requests, else 0",
                            ["replica"], registry=registry),
        }

    def observe_finished(self, meta: dict[str, Any]) -> None:
        """One finished request's meta_info."""
        self.requests.inc()
        self.prompt_tokens.inc(meta["prompt_tokens"])
        self.cached_prompt_tokens.inc(meta["cached_tokens"])
        self.generation_tokens.inc(meta["completion_tokens"])
        if meta["finish_reason"]["type"] == "abort":
            self.aborted_requests.inc()
            return
        self.time_to_first_token.observe(meta["ttft"])
        self.e2e_request_latency.observe(meta["e2e_latency"])
        self.queue_time.observe(meta["queue_time"])
        tokens_after_first = meta["completion_tokens"] - 1
        if tokens_after_first > 0:
            # The engine keeps no per-token timestamps: a request's mean gap
            # stands for each of its gaps (exact for the mean, smooth for p99).
            mean_gap = (meta["e2e_latency"] - meta["ttft"]) / tokens_after_first
            for _ in range(tokens_after_first):
                self.inter_token_latency.observe(mean_gap)

    def observe_aborted(self, num_requests: int, generated_tokens: int = 0) -> None:
        """Requests aborted before they reported an end (their client left), and the tokens they got."""
        self.requests.inc(num_requests)
        self.aborted_requests.inc(num_requests)
        self.generation_tokens.inc(generated_tokens)

    def render(self, stats: dict[str, Any], replicas: list[dict[str, Any]] | None = None) -> bytes:
        """The exposition text, with the gauges set from `cache_stats()` (and each replica's, if any)."""
        self.num_running_reqs.set(stats["running_requests"])
        self.num_queue_reqs.set(stats["waiting_requests"])
        self.token_usage.set(stats["pool_used_tokens"] / max(stats["pool_total_tokens"], 1))
        self.cache_hit_rate.set(stats["hit_rate"])
        for replica in replicas or []:
            self._set_replica(replica)
        return generate_latest(self.registry)

    def _set_replica(self, replica: dict[str, Any]) -> None:
        gauges, name = self.replica_gauges, replica["name"]
        gauges["in_flight"].labels(name).set(replica["in_flight"])
        gauges["routed"].labels(name).set(1 if replica["routed"] else 0)
        stats = replica.get("cache_stats")
        if stats is None:  # it did not answer: no figures rather than stale ones
            for key in ("num_running_reqs", "num_queue_reqs", "token_usage", "cache_hit_rate"):
                with contextlib.suppress(KeyError):
                    gauges[key].remove(name)
            return
        gauges["num_running_reqs"].labels(name).set(stats["running_requests"])
        gauges["num_queue_reqs"].labels(name).set(stats["waiting_requests"])
        gauges["token_usage"].labels(name).set(stats["pool_used_tokens"] / max(stats["pool_total_tokens"], 1))
        gauges["cache_hit_rate"].labels(name).set(stats["hit_rate"])

