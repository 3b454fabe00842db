"""The batched sampler: one batch of next-token logits in, one token per row out.

`Sampler.sample` uses a fixed number of batched tensor operations, whatever
the mix of settings in the batch:

    logits ─► constraint masks ─► penalties (repetition, then frequency/presence) ─► logit_bias ─► logprobs
           └► greedy rows: argmax
           └► sampled rows: / temperature ─► top-k, top-p, min-p threshold
                            ─► inverse CDF at u = hash(seed, step)

Reproducibility: the only randomness is the one uniform number per row,
derived from the request's seed and the index of the token being sampled
(counter-based, no generator state), and every other operation works on each
row alone. So a seeded request draws the same tokens alone or in a batch of
64, at any row. docs/sampling.md has the user-facing rules.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from radixrt.sampling.params import SamplingParams
from radixrt.sampling.run_data import RunMasks, RunPenalties, RunSampling

# top_p first looks for the nucleus among this many most likely tokens and
# sorts the whole vocabulary only for rows whose nucleus is larger: a full
# sort of a large vocabulary costs far more than a top-k of a few hundred on
# the CPU (docs/benchmarks.md, "The sampler").
_NUCLEUS_CANDIDATES = 256

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform_for(seed: int, step: int) -> float:
    """The uniform number in (0, 1) that picks output token `step` of a request seeded `seed`.

    A pure function of (seed, step): no generator state, so the draw does not
    depend on what else is in the batch or on how often the sampler ran.
    """
    key = _splitmix64(_splitmix64(seed & _MASK64) ^ step)
    return ((key >> 12) + 0.5) / 2.0**52  # 52 bits + 0.5 is exact in a float64, so never 0 or 1


class RowKernels(Protocol):
    """Compiled passes over float32 logits rows that compute what the sampler's torch ops do, bit
    for bit where it says so (the executor supplies them: `radixrt.model.row_kernels`)."""

    def takes(self, logits: torch.Tensor) -> bool:
        """Whether these logits are laid out as the passes read them."""
        ...

    def row_stats(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's first argmax, its value and its log-sum-exp."""
        ...

    def mask_rows(self, logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> None:
        """In place: row rows[i]'s tokens that allowed[i] does not allow become -inf."""
        ...

    def sample_rows(self, logits: torch.Tensor, rows: torch.Tensor, maxima: torch.Tensor,
                    params: Sequence[SamplingParams], uniforms: Sequence[float], tokens: torch.Tensor) -> None:
        """tokens[rows[i]] drawn at uniforms[i] from its row after params[i]'s temperature and filters."""
        ...


@dataclass(frozen=True)
class TokenMasks:
    """Output constraints of some rows of a batch: row `rows[i]` may pick only the tokens that
    `allowed[i]` allows ([len(rows), words] int32, a bit per token, set when allowed:
    `radixrt.sampling.grammar`)."""

    rows: list[int]
    allowed: torch.Tensor


def apply_masks(logits: torch.Tensor, masks: TokenMasks | None, kernels: RowKernels | None = None) -> torch.Tensor:
    """A copy of float32 `logits` whose disallowed tokens are -inf, or `logits` itself without
    masks. Masking comes first: the penalties, the log-probabilities and every filter then see
    the constrained distribution alone."""
    if masks is None or not masks.rows:
        return logits
    logits = logits.clone()
    rows = torch.tensor(masks.rows, dtype=torch.int64)
    if kernels is not None and kernels.takes(logits):
        kernels.mask_rows(logits, rows, masks.allowed)
        return logits
    bits = (masks.allowed.to(logits.device)[:, :, None] >> torch.arange(32, device=logits.device)) & 1
    allowed = bits.flatten(1)[:, : logits.shape[1]].bool()
    logits[rows.to(logits.device)] = logits[rows.to(logits.device)].masked_fill(~allowed, -math.inf)
    return logits


@dataclass(frozen=True)
class SampleOutput:
    """One sampled token per row.

    `logprobs[i]` is the log-probability of `token_ids[i]` under the
    masked and penalised distribution at temperature 1, before
    top-k/top-p/min-p: the model's own opinion of the token (after its
    constraint and penalties), comparable across requests whatever their
    temperature, and finite for greedy rows too.
    `top_logprobs[i]` lists row i's `top_logprobs_num` most likely tokens
    under the same distribution (None when no row asked for any), and
    `ids_logprobs[i]` the log-probabilities of its `token_ids_logprob`, in
    their order (None when no row asked).
    """

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32
    top_logprobs: list[list[tuple[int, float]]] | None = None
    ids_logprobs: list[list[float]] | None = None


class Sampler:
    """Picks the next token of every row of a batch; stateless, so one instance serves all steps.
    `kernels`: compiled passes that take over rows they can read (None: torch's ops alone)."""

    def __init__(self, kernels: RowKernels | None = None):
        self.kernels = kernels

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        masks: TokenMasks | None = None,
    ) -> SampleOutput:
        """Sample row i of `logits` [B, V] with `params[i]`, among the tokens `masks` allows it.

        `seeds[i]` is the request's seed (the engine draws one at submission
        when the user gave none). `output_ids[i]` are the tokens the request
        has generated so far: its length is the step that selects the random
        draw, and with `prompt_ids[i]` it is the history the penalties count;
        the histories are read only for rows with a penalty. `logits` is not
        modified.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        batch_size = logits.shape[0]
        for name, seq in (("params", params), ("seeds", seeds), ("prompt_ids", prompt_ids), ("output_ids", output_ids)):
            if len(seq) != batch_size:
                raise ValueError(f"{name} must have one entry per logits row ({batch_size}), got {len(seq)}")
        logits = apply_logit_bias(
            apply_penalties(apply_masks(logits.float(), masks, self.kernels), params, prompt_ids, output_ids), params
        )
        argmax, row_max, log_norm = _row_stats(logits, self.kernels)
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        if not sampled:  # every token is its row's largest value: no gather
            return SampleOutput(argmax, row_max - log_norm, _top_logprobs(logits, log_norm, params),
                                _ids_logprobs(logits, log_norm, params))
        token_ids = argmax  # right for the greedy rows; the sampled ones are drawn into it below
        rows = torch.tensor(sampled, dtype=torch.int64, device=logits.device)
        rows_params = [params[i] for i in sampled]
        row_uniforms = [uniform_for(seeds[i], len(output_ids[i])) for i in sampled]
        if self.kernels is not None and self.kernels.takes(logits):
            self.kernels.sample_rows(logits, rows, row_max, rows_params, row_uniforms, token_ids)
        else:
            token_ids[rows] = _sample_rows(_select(logits, sampled), rows_params, row_uniforms)
        logprobs = logits.gather(1, token_ids[:, None]).squeeze(1) - log_norm
        return SampleOutput(token_ids, logprobs, _top_logprobs(logits, log_norm, params),
                            _ids_logprobs(logits, log_norm, params))


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`logits` with each row's `logit_bias` added (a copy; `logits` itself without any bias).
    After the masks and the penalties, as OpenAI and SGLang add it just before sampling; a
    masked token stays -inf. Each row alone, so a row's bits do not depend on its batch."""
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    if not biased:
        return logits
    logits = logits.clone()
    for i in biased:
        ids = torch.tensor([t for t, _ in params[i].logit_bias], dtype=torch.int64, device=logits.device)
        bias = torch.tensor([b for _, b in params[i].logit_bias], dtype=logits.dtype, device=logits.device)
        logits[i, ids] += bias
    return logits


def _ids_logprobs(
    logits: torch.Tensor, log_norm: torch.Tensor, params: Sequence[SamplingParams]
) -> list[list[float]] | None:
    """Per row, the log-probabilities of its `token_ids_logprob` (None when no row asks)."""
    if all(p.token_ids_logprob is None for p in params):
        return None
    out: list[list[float]] = [[] for _ in params]
    for i, p in enumerate(params):
        if p.token_ids_logprob:
            ids = torch.tensor(p.token_ids_logprob, dtype=torch.int64, device=logits.device)
            out[i] = (logits[i, ids] - log_norm[i]).tolist()
    return out


def run_sampling(
    params: Sequence[SamplingParams], seeds: Sequence[int], prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]], stop_ids: Sequence[Sequence[int]], num_steps: int, vocab_size: int,
    masks: RunMasks | None = None,
) -> RunSampling:
    """How a decode run samples each row, as `Sampler.sample` does: row i with `params[i]`, its
    step s the request's output token `len(output_ids[i]) + s` (the draw `Sampler.sample` would
    make), penalties counted from its prompt and output so far, stopping the run at any of
    `stop_ids[i]`; every step reporting the most top log-probabilities any row asks for."""
    temperatures = torch.tensor([0.0 if p.is_greedy else p.temperature for p in params], dtype=torch.float32)
    uniforms = torch.tensor([[uniform_for(seed, len(output) + step) for seed, output in zip(seeds, output_ids)]
                             for step in range(num_steps)], dtype=torch.float64)  # fmt: skip
    penalties = None
    if any(p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0 for p in params):
        factors = torch.tensor([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params],
                               dtype=torch.float32).T.contiguous()  # fmt: skip
        penalties = RunPenalties(factors[0], factors[1], factors[2],
                                 _dense_token_counts(list(zip(prompt_ids, output_ids)), vocab_size),
                                 _dense_token_counts([(output,) for output in output_ids], vocab_size))
    stop_ptr = [0]
    for ids in stop_ids:
        stop_ptr.append(stop_ptr[-1] + len(ids))
    return RunSampling(
        temperatures, torch.tensor([p.top_k for p in params], dtype=torch.int64),
        torch.tensor([p.top_p for p in params], dtype=torch.float32),
        torch.tensor([p.min_p for p in params], dtype=torch.float32), uniforms,
        torch.tensor(stop_ptr, dtype=torch.int64), torch.tensor([i for ids in stop_ids for i in ids], dtype=torch.int64),
        penalties, max((p.top_logprobs_num for p in params), default=0), masks,
    )


def _dense_token_counts(histories: Sequence[Sequence[Sequence[int]]], vocab_size: int) -> torch.Tensor:
    """How often each token is in each history (one or more token lists): [N, vocab_size] int32."""
    counts = torch.zeros(len(histories), vocab_size, dtype=torch.int32)
    rows, tokens, found = _token_counts(range(len(histories)), histories, vocab_size, counts.device)
    counts[rows, tokens] = found.to(torch.int32)
    return counts


def _as_tensor(tokens: Sequence[int]) -> torch.Tensor:
    """int64 token ids; a request's own `array('q')` is read in place, not element by element."""
    if isinstance(tokens, array) and tokens.typecode == "q":
        return torch.frombuffer(tokens, dtype=torch.int64)
    return torch.tensor(list(tokens), dtype=torch.int64)


def _row_stats(logits: torch.Tensor, kernels: RowKernels | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's first argmax, its value and its log-sum-exp: the compiled pass where it reads the
    rows, else torch's reductions."""
    if kernels is not None and kernels.takes(logits):
        return kernels.row_stats(logits)
    return logits.argmax(dim=-1), logits.amax(dim=-1), torch.logsumexp(logits, dim=-1)


def _top_logprobs(
    logits: torch.Tensor, log_norm: torch.Tensor, params: Sequence[SamplingParams]
) -> list[list[tuple[int, float]]] | None:
    """Per row, its `top_logprobs_num` most likely (token, log-probability) pairs; None when no row asks."""
    wanted = [p.top_logprobs_num for p in params]
    if not any(wanted):
        return None
    rows = [i for i, k in enumerate(wanted) if k]
    values, tokens = top_tokens(_select(logits, rows), max(wanted))
    logprobs = (values - _select(log_norm[:, None], rows)).tolist()
    top: list[list[tuple[int, float]]] = [[] for _ in params]
    for row, row_tokens, row_values in zip(rows, tokens.tolist(), logprobs):
        top[row] = list(zip(row_tokens, row_values))[: wanted[row]]
    return top


def top_tokens(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest values and their tokens ([R, k] each): largest first, equal values in
    token order, and of the values equal to the last one kept, the lowest tokens. torch's topk
    leaves ties in no set order; this is the order a decode run reports (`radixrt_top_row`).
    Only a row with equal values among its k + 1 largest is ordered again, one row at a time."""
    wider = min(k + 1, rows.shape[-1])
    values, tokens = rows.topk(wider, dim=-1)
    tied = (values[:, 1:] == values[:, :-1]).any(dim=1).tolist()
    values, tokens = values[:, :k].clone(), tokens[:, :k].clone()
    for i in (i for i, has_ties in enumerate(tied) if has_ties):
        row, threshold = rows[i], values[i, -1]
        above = (row > threshold).nonzero().squeeze(1)
        picked = torch.cat([above, (row == threshold).nonzero().squeeze(1)[: k - above.numel()]])
        tokens[i] = picked[row[picked].sort(descending=True, stable=True).indices]
        values[i] = row[tokens[i]]
    return values, tokens


def _token_counts(
    rows: Sequence[int], histories: Sequence[Sequence[Sequence[int]]], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch row, token, count) for each distinct token in each row's token lists."""
    lengths = torch.tensor([sum(map(len, lists)) for lists in histories], dtype=torch.int64)
    parts = [_as_tensor(tokens) for lists in histories for tokens in lists if len(tokens)]
    tokens = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    if tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab_size:
        raise ValueError(f"token ids in prompt_ids and output_ids must be in [0, {vocab_size})")
    row_of = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)
    keys, counts = torch.unique(row_of * vocab_size + tokens, return_counts=True)
    return (keys // vocab_size).to(device), (keys % vocab_size).to(device), counts.to(device)


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Penalised copy of `logits`, or `logits` itself when no row has a penalty (the common case).

    Repetition (HF): a logit of a token seen in prompt or output is divided by
    the penalty when positive, multiplied when negative. Then frequency and
    presence (OpenAI): subtract `frequency * count + presence * (count > 0)`,
    counting output tokens only. Only the logits of tokens in the history are
    touched, so the cost grows with the history, not with batch x vocabulary.
    Each operation is one IEEE float32 rounding, in this order: decode runs
    (`RunPenalties`) compute the same bits in C.
    """
    repetition = [i for i, p in enumerate(params) if p.repetition_penalty != 1]
    additive = [i for i, p in enumerate(params) if p.frequency_penalty != 0 or p.presence_penalty != 0]
    if not repetition and not additive:
        return logits
    device, vocab_size = logits.device, logits.shape[1]
    logits = logits.clone()
    if repetition:
        histories = [(prompt_ids[i], output_ids[i]) for i in repetition]
        rows, tokens, _ = _token_counts(repetition, histories, vocab_size, device)
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device)[rows]
        values = logits[rows, tokens]
        logits[rows, tokens] = torch.where(values > 0, values / penalty, values * penalty)
    if additive:
        rows, tokens, counts = _token_counts(additive, [(output_ids[i],) for i in additive], vocab_size, device)
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[rows]
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[rows]
        logits[rows, tokens] -= frequency * counts + presence
    return logits


def _select(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`tensor[rows]`, without the copy when `rows` is every row (the usual case)."""
    if len(rows) == tensor.shape[0]:
        return tensor
    return tensor[torch.tensor(rows, device=tensor.device)]


def _sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: Sequence[float]) -> torch.Tensor:
    """Inverse-CDF sampling of each row from its temperature-scaled, filtered distribution.

    Every filter becomes a per-row logit threshold (ties at the threshold are
    kept), and all filters are computed on the same full distribution, as in
    SGLang, so their order does not matter.
    """
    device, (num_rows, vocab_size) = logits.device, logits.shape
    temperature = torch.tensor([p.temperature for p in params], device=device)
    scaled = logits / temperature[:, None]
    row_max = scaled.amax(dim=-1)
    threshold = torch.full((num_rows,), -math.inf, device=device)
    top_k = [i for i, p in enumerate(params) if 1 < p.top_k < vocab_size]
    if top_k:
        ks = torch.tensor([params[i].top_k for i in top_k], device=device)
        kth = _select(scaled, top_k).topk(int(ks.max()), dim=-1).values.gather(1, ks[:, None] - 1).squeeze(1)
        rows = torch.tensor(top_k, device=device)
        threshold[rows] = torch.maximum(threshold[rows], kth)
    top_p = [i for i, p in enumerate(params) if p.top_p < 1]
    if top_p:
        ps = torch.tensor([params[i].top_p for i in top_p], device=device)
        rows = torch.tensor(top_p, device=device)
        threshold[rows] = torch.maximum(threshold[rows], _nucleus_threshold(_select(scaled, top_p), ps))
    min_p = [p.min_p for p in params]
    if any(min_p):
        # p >= min_p * p_max, in logits; log(0) = -inf keeps every token
        threshold = torch.maximum(threshold, row_max + torch.tensor(min_p, device=device).log())
    weights = (scaled - row_max[:, None]).exp_()
    if top_k or top_p or any(min_p):
        weights.masked_fill_(scaled < threshold[:, None], 0.0)
    # float32 is enough: the CPU kernel accumulates in float64, and a
    # filtered-out token adds exactly 0, so it can never be picked.
    cdf = weights.cumsum_(dim=-1)
    total = cdf[:, -1]
    # target < total, so the first cdf entry above it belongs to a token of weight > 0
    targets = torch.minimum(
        (torch.tensor(uniforms, dtype=torch.float64, device=device) * total).float(),
        torch.nextafter(total, torch.zeros_like(total)),
    )
    # the clamp only matters for NaN logits, which have no meaningful token anyway
    return torch.searchsorted(cdf, targets[:, None], right=True).squeeze(1).clamp_(max=vocab_size - 1)


def _nucleus_threshold(scaled: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest logit of the nucleus: the fewest most-likely tokens whose mass reaches top_p.

    A token is kept when the mass strictly before it (in descending order) is
    below top_p, so the most likely token always is. Rows whose nucleus does
    not fit in the first candidates fall back to a full sort; which path a
    row takes depends on that row alone.
    """
    log_norm = torch.logsumexp(scaled, dim=-1, keepdim=True)
    num_candidates = min(_NUCLEUS_CANDIDATES, scaled.shape[1])
    values = scaled.topk(num_candidates, dim=-1).values
    threshold, fits = _threshold_in(values, log_norm, top_p)
    if num_candidates < scaled.shape[1] and not bool(fits.all()):
        rows = (~fits).nonzero().squeeze(1)
        full = scaled[rows].sort(dim=-1, descending=True).values
        threshold[rows] = _threshold_in(full, log_norm[rows], top_p[rows])[0]
    return threshold


def _threshold_in(
    values: torch.Tensor, log_norm: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Nucleus threshold within descending `values`, and whether the nucleus fits in them."""
    probs = (values - log_norm).exp()
    mass = probs.cumsum(dim=-1)
    kept = ((mass - probs) < top_p[:, None]).sum(dim=-1)
    threshold = values.gather(1, (kept - 1)[:, None]).squeeze(1)
    return threshold, mass[:, -1] >= top_p
