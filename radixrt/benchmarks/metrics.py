"""Figures of one repetition, and the medians over repetitions that the report shows.

Per repetition: wall time, output tokens/s (all output tokens over the wall
time), TTFT and end-to-end latency percentiles over its requests, prompt
tokens, cached prompt tokens and their ratio (the cache hit rate). A figure
in the summary is the median of that figure over the repetitions, so one
noisy repetition (the CPU is shared) does not move it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from radixrt.benchmarks.drivers import Run

SUMMARY_FIELDS = (
    "wall_s", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s",
    "num_requests", "prompt_tokens", "cached_tokens", "hit_rate", "output_tokens",
)
SEQUENTIAL_FIELDS = ("ttft_first_s", "ttft_rest_p50_s")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linearly interpolated between order statistics (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class RepMetrics:
    wall_s: float
    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: tuple[float, ...]  # per request, in request order
    e2e_s: tuple[float, ...]
    load_1m: float  # the machine's 1-minute load average when the repetition started

    @classmethod
    def from_run(cls, run: Run, load_1m: float) -> "RepMetrics":
        done = run.completions
        return cls(
            load_1m=load_1m,
            wall_s=run.wall_s,
            num_requests=len(done),
            prompt_tokens=run.prompt_tokens,
            cached_tokens=run.cached_tokens,
            output_tokens=sum(c.num_output_tokens for c in done),
            ttft_s=tuple(c.ttft_s for c in done),
            e2e_s=tuple(c.e2e_s for c in done),
        )

    def figures(self) -> dict[str, float]:
        return {
            "wall_s": self.wall_s,
            "output_tokens_per_s": self.output_tokens / self.wall_s if self.wall_s > 0 else math.nan,
            "ttft_p50_s": percentile(self.ttft_s, 50),
            "ttft_p99_s": percentile(self.ttft_s, 99),
            "e2e_p50_s": percentile(self.e2e_s, 50),
            "e2e_p99_s": percentile(self.e2e_s, 99),
            "num_requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "output_tokens": self.output_tokens,
            # Latency-bound workloads: the first request (a miss when the cache starts cold) vs the rest.
            "ttft_first_s": self.ttft_s[0] if self.ttft_s else math.nan,
            "ttft_rest_p50_s": percentile(self.ttft_s[1:], 50),
        }


def summarize(reps: Sequence[RepMetrics], sequential: bool) -> dict[str, Any]:
    """Median of every figure over the repetitions, plus each repetition's figures and raw latencies."""
    if not reps:
        raise ValueError("summarize needs at least one repetition")
    per_rep = [rep.figures() for rep in reps]
    names = SUMMARY_FIELDS + (SEQUENTIAL_FIELDS if sequential else ())
    summary: dict[str, Any] = {name: statistics.median(f[name] for f in per_rep) for name in names}
    summary["reps"] = [{**{n: f[n] for n in names}, **_raw(rep)} for f, rep in zip(per_rep, reps)]
    return summary


def _raw(rep: RepMetrics) -> dict[str, Any]:
    return {"load_1m": rep.load_1m, "ttft_s": list(rep.ttft_s), "e2e_s": list(rep.e2e_s)}
