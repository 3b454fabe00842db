"""What a decode run needs to sample each of its steps' rows, as plain tensors: built by the
sampler (`sampler.run_sampling`) and the engine (the masks' call back), read by the executor's
kernel (`radixrt_int4_decode_run_bf16`). Data only: nothing here computes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class RunPenalties(NamedTuple):
    """A decode run's penalties (the sampler's `apply_penalties`, in C): per row its three factors,
    and how often each token is in its prompt and output (`seen`) and in its output
    (`output_counts`), [B, vocab] int32 each, which the run counts on as it draws tokens."""

    repetition: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32
    presence: torch.Tensor  # [B] float32
    seen: torch.Tensor
    output_counts: torch.Tensor


class RunMasks(NamedTuple):
    """A decode run's output constraints: row r with `masked[r]` picks only among the tokens its
    row of `allowed` ([B, words] int32, a bit per token, set when allowed) allows; after each step
    but the last, `advance(step, tokens)` (the step's token of every row) writes the next step's
    masks into `allowed` and returns True to end the run after that step."""

    allowed: torch.Tensor
    masked: torch.Tensor  # [B] uint8
    advance: Callable[[int, list[int]], bool]


class RunSampling(NamedTuple):
    """How each row of a decode run picks its tokens: temperature 0 greedy (the first argmax), else
    a draw at `uniforms[s, r]` ([steps, B] float64) after its filters, as `RowSampler`, each after
    the row's mask and penalties when there are any; the run stops after a step where row r drew
    one of `stop_ids[stop_ptr[r]:stop_ptr[r + 1]]`. Each step also reports every row's
    `top_logprobs` most likely tokens (0: none)."""

    temperatures: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    uniforms: torch.Tensor  # [steps, B] float64
    stop_ptr: torch.Tensor  # [B + 1] int64
    stop_ids: torch.Tensor  # int64
    penalties: RunPenalties | None = None
    top_logprobs: int = 0
    masks: RunMasks | None = None
