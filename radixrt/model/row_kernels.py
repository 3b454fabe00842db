"""The sampler's compiled row passes (`sampling.sampler.RowKernels`), supplied by the executor so
that the sampler itself imports no kernels: argmax and log-sum-exp (`row_stats.c`), constraint
masks and draws (`sample_rows.c`), each split over the step's large thread count: a batch's rows
are independent, so more threads change no result, and from a few rows on they finish sooner
(docs/benchmarks.md, "The sampler")."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixrt.kernels import cpu
from radixrt.sampling.params import SamplingParams


class CpuRowKernels:
    """`RowKernels` over radixrt's C passes; `threads`: how many threads they split rows over
    (None: torch's count)."""

    def __init__(self, stats: cpu.RowStats, masks: cpu.TokenMasks, sampler: cpu.RowSampler, threads: int | None):
        self._stats, self._masks, self._sampler = stats, masks, sampler
        self._threads = threads

    def takes(self, logits: torch.Tensor) -> bool:
        return cpu.RowStats.takes(logits)

    def row_stats(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with cpu.kernel_threads(self._threads):
            return self._stats(logits)

    def mask_rows(self, logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> None:
        self._masks(logits, rows, allowed)

    def sample_rows(self, logits: torch.Tensor, rows: torch.Tensor, maxima: torch.Tensor,
                    params: Sequence[SamplingParams], uniforms: Sequence[float], tokens: torch.Tensor) -> None:
        with cpu.kernel_threads(self._threads):
            self._sampler(logits, rows, maxima, [p.temperature for p in params], [p.top_k for p in params],
                          [p.top_p for p in params], [p.min_p for p in params], uniforms, tokens)


def cpu_row_kernels(threads: int | None = None) -> CpuRowKernels | None:
    """The C passes, or None where the kernels cannot be built (the sampler then runs torch's ops)."""
    stats, masks, sampler = cpu.row_stats(), cpu.token_masks(), cpu.row_sampler()
    if stats is None or masks is None or sampler is None:
        return None
    return CpuRowKernels(stats, masks, sampler, threads)
