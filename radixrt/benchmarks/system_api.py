"""The interface every system under test implements, and the record it returns.

Apart from `systems` (radixrt) and `hf_system` (transformers) so that either
can implement it, and the drivers run it, without importing the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from radixrt.benchmarks.workloads import Sampling


@dataclass(frozen=True)
class Completion:
    """One generated sequence and its timings (seconds from its submission).

    `output_ids` is empty when a radixrt.lang program generated it: the
    program keeps its own token history, and only the count is needed.
    """

    num_output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    e2e_s: float
    output_ids: tuple[int, ...] = ()


class System(Protocol):
    """What a workload driver needs from a system.

    `concurrent`: `generate` may be called from several threads at once and
    batches what they submit (radixrt); otherwise drivers batch for it.
    `runtime`: the radixrt.Runtime behind the system, or None; fork and tree
    workloads run as radixrt.lang programs on it.
    """

    name: str
    concurrent: bool
    runtime: Any

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling, n: int = 1) -> list[list[Completion]]:
        """For each prompt, its n completions (n > 1: sampled, sharing the prompt)."""
        ...

    def reset(self) -> None:
        """Forget every cached prefix, so the next repetition starts cold."""
        ...

    def cache_counts(self) -> tuple[int, int] | None:
        """(prompt tokens, of those found cached) since the last reset, as the system itself
        counts them (requests a program makes on its own included); None: count the completions."""
        ...

    def close(self) -> None:
        ...


def completion_of_meta(meta: dict[str, Any], output_ids: tuple[int, ...] = ()) -> Completion:
    """A Completion from a radixrt meta_info (a result's, or a lang gen's `get_meta_info`)."""
    return Completion(meta["completion_tokens"], meta["prompt_tokens"], meta["cached_tokens"],
                      meta["ttft"], meta["e2e_latency"], output_ids)


def resolved_device(device: str) -> str:
    """"auto" made concrete the way radixrt.Runtime does it: cuda when available, else cpu."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
