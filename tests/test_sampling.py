"""SamplingParams validation and the batched sampler: exact greedy, filters, penalties, seeds, distribution."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.sampling import SamplingParams
from radixrt.kernels import cpu
from radixrt.sampling import sampler as sampler_module
from radixrt.model.row_kernels import cpu_row_kernels
from radixrt.sampling.sampler import SampleOutput, Sampler, apply_penalties, uniform_for

SAMPLER = Sampler(cpu_row_kernels())  # C passes where they build; torch ops elsewhere


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds=None, prompts=None, outputs=None) -> SampleOutput:
    batch = logits.shape[0]
    return SAMPLER.sample(
        logits,
        params,
        seeds if seeds is not None else list(range(batch)),
        prompts if prompts is not None else [[]] * batch,
        outputs if outputs is not None else [[]] * batch,
    )


# --- SamplingParams -----------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, accepted",
    [
        ("max_new_tokens", -1, ">= 0"),
        ("max_new_tokens", 1.5, ">= 0"),
        ("temperature", -0.1, ">= 0"),
        ("temperature", math.nan, ">= 0"),
        ("temperature", math.inf, ">= 0"),
        ("temperature", "1", ">= 0"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.01, "(0, 1]"),
        ("top_p", math.nan, "(0, 1]"),
        ("top_k", 0, ">= 1"),
        ("top_k", -2, ">= 1"),
        ("top_k", 2.0, ">= 1"),
        ("min_p", -0.1, "[0, 1]"),
        ("min_p", 1.5, "[0, 1]"),
        ("frequency_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -2.5, "[-2, 2]"),
        ("presence_penalty", 3, "[-2, 2]"),
        ("presence_penalty", math.inf, "[-2, 2]"),
        ("repetition_penalty", 0.0, "> 0"),
        ("repetition_penalty", -1.0, "> 0"),
        ("n", 0, ">= 1"),
        ("n", True, ">= 1"),
        ("seed", 1.5, "int"),
        ("seed", "7", "int"),
        ("stop", 5, "non-empty string"),
        ("stop", "", "non-empty string"),
        ("stop", ["ok", ""], "non-empty string"),
        ("stop", ["ok", 3], "non-empty string"),
        ("stop_token_ids", [-1], ">= 0"),
        ("stop_token_ids", ["2"], ">= 0"),
        ("stop_token_ids", 2, ">= 0"),
        ("ignore_eos", "yes", "True or False"),
        ("return_logprob", 1, "True or False"),
        ("skip_special_tokens", None, "True or False"),
    ],
)
def test_invalid_field_names_field_and_range(field, value, accepted):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert field in str(info.value) and accepted in str(info.value)


def test_boundary_values_are_accepted():
    SamplingParams(max_new_tokens=0, temperature=0, top_p=1, top_k=1, min_p=1, frequency_penalty=-2,
                   presence_penalty=2, repetition_penalty=0.01, seed=-5, n=3)


def test_stop_token_ids_checked_against_vocabulary():
    params = SamplingParams(stop_token_ids=[3, 100])
    params.validate(vocab_size=101)
    with pytest.raises(ValueError, match=r"stop_token_ids must be in \[0, 100\), got \[100\]"):
        params.validate(vocab_size=100)


def test_stop_and_stop_token_ids_are_normalised_to_tuples():
    assert SamplingParams().stop == () and SamplingParams().stop_token_ids == ()
    assert SamplingParams(stop="x").stop == ("x",)
    listed = SamplingParams(stop=["a", "bc"], stop_token_ids=[1, 2])
    assert listed == SamplingParams(stop=("a", "bc"), stop_token_ids=(1, 2))


def test_from_any():
    assert SamplingParams.from_any(None) == SamplingParams()
    params = SamplingParams(temperature=0)
    assert SamplingParams.from_any(params) is params
    assert SamplingParams.from_any({"top_k": 5, "stop": "\n"}) == SamplingParams(top_k=5, stop=("\n",))
    with pytest.raises(ValueError, match="unknown sampling parameter.*max_tokens, topk.*accepted: .*max_new_tokens"):
        SamplingParams.from_any({"max_tokens": 5, "topk": 1, "top_p": 0.5})
    with pytest.raises(ValueError, match="sampling_params"):
        SamplingParams.from_any([("top_k", 5)])


def test_greedy_rule():
    assert SamplingParams(temperature=0).is_greedy and SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(top_k=1).is_greedy and not SamplingParams(temperature=0.01).is_greedy


# --- the sampler ---------------------------------------------------------------


def random_logits(batch: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def test_greedy_rows_take_argmax_lowest_index_on_ties():
    logits = random_logits(6, 50)
    logits[2, 7] = logits[2, 31] = logits[2].max() + 1  # a tie: index 7 wins
    params = [SamplingParams(temperature=0), SamplingParams(), SamplingParams(temperature=0)] * 2
    out = sample(logits, params)
    expected = logits.argmax(dim=-1)
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (6,)
    assert out.token_ids[[0, 2, 3, 5]].tolist() == expected[[0, 2, 3, 5]].tolist()
    assert out.token_ids[2] == 7


def test_top_k_1_and_tiny_top_p_and_min_p_1_are_greedy():
    logits = random_logits(32, 1000)
    expected = logits.argmax(dim=-1).tolist()
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0),
                   SamplingParams(temperature=1e-6)):
        assert sample(logits, [params] * 32).token_ids.tolist() == expected


def draws(logits_row: torch.Tensor, params: SamplingParams, num: int) -> torch.Tensor:
    """`num` samples of one distribution: one row per seed, all in one batch."""
    return sample(logits_row.expand(num, -1), [params] * num).token_ids


def test_top_k_keeps_only_the_k_most_likely():
    row = random_logits(1, 200)[0]
    allowed = set(row.topk(5).indices.tolist())
    got = set(draws(row, SamplingParams(top_k=5, temperature=2.0), 500).tolist())
    assert got == allowed


def test_top_p_keeps_only_the_nucleus():
    row = random_logits(1, 500, scale=2.0)[0]
    probs = torch.softmax(row / 0.7, -1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    nucleus = set(order[mass_before < 0.8].tolist())
    got = set(draws(row, SamplingParams(top_p=0.8, temperature=0.7), 3000).tolist())
    assert got <= nucleus and len(got) > len(nucleus) // 2


def test_top_p_nucleus_beyond_the_candidate_window_uses_a_full_sort():
    row = torch.zeros(5000)  # flat: the 0.9 nucleus has 4500 tokens, more than the 256 candidates
    got = draws(row, SamplingParams(top_p=0.9), 2000)
    assert len(set(got.tolist())) > 1000


def test_min_p_filter():
    row = random_logits(1, 300)[0]
    probs = torch.softmax(row, -1)
    allowed = set((probs >= 0.1 * probs.max()).nonzero().squeeze(1).tolist())
    got = set(draws(row, SamplingParams(min_p=0.1), 2000).tolist())
    assert got == allowed


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize(
    "params, keep",
    [
        (SamplingParams(), None),
        (SamplingParams(temperature=0.6), None),
        (SamplingParams(temperature=1.5, top_k=4), lambda p: p >= p.sort(descending=True).values[3]),
        (SamplingParams(top_p=0.7), None),
        (SamplingParams(min_p=0.2), lambda p: p >= 0.2 * p.max()),
    ],
)
def test_distribution_matches_softmax(params, keep):
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    probs = torch.softmax(row / params.temperature, -1)
    if keep is not None:
        probs = torch.where(keep(probs), probs, 0.0)
    if params.top_p < 1:
        order = probs.argsort(descending=True)
        dropped = order[(probs[order].cumsum(0) - probs[order]) >= params.top_p]
        probs[dropped] = 0.0
    probs = probs / probs.sum()
    counts = torch.bincount(draws(row, params, 4000), minlength=8).float()
    # Deterministic seeds, so this cannot flake; the bound is loose (p < 1e-6 for 7 degrees of freedom).
    assert chi_square(counts, probs) < 45


@pytest.mark.parametrize(
    "vocab, scale, target",
    [
        # odd vocabulary: rows start at different offsets of the flat buffer
        (1001, 3.0, SamplingParams(temperature=0.9, top_p=0.95, top_k=100, min_p=0.01, repetition_penalty=1.2,
                                   frequency_penalty=0.3, seed=1234)),
        # a flat distribution at the real vocabulary size: the nucleus needs the full sort
        (49152, 0.1, SamplingParams(top_p=0.97, seed=99)),
    ],
)
def test_same_seed_same_tokens_in_any_batch(vocab, scale, target):
    others = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_p=0.5),
              SamplingParams(top_k=7, presence_penalty=1.0), SamplingParams(min_p=0.3, temperature=2.0)]
    batch_size, history = 24, [5, 7, 5, 900]
    for step in range(3):
        logits = random_logits(batch_size, vocab, seed=step, scale=scale)
        output = history + list(range(step))
        alone = sample(logits[:1], [target], [target.seed], [[1, 2]], [output])
        for row in (0, 9, batch_size - 1):
            batch = logits[torch.randperm(batch_size, generator=torch.Generator().manual_seed(row))]
            batch[row] = logits[0]
            params = [others[i % len(others)] for i in range(batch_size)]
            params[row] = target
            seeds = list(range(1000, 1000 + batch_size))
            seeds[row] = target.seed
            outputs = [[i % 50] * 3 for i in range(batch_size)]
            outputs[row] = output
            out = sample(batch, params, seeds, [[1, 2]] * batch_size, outputs)
            assert out.token_ids[row] == alone.token_ids[0]
            assert out.logprobs[row] == alone.logprobs[0]


def test_step_changes_the_draw_and_seeds_differ():
    row = torch.zeros(1, 1000)
    params = SamplingParams()
    by_seed = {int(sample(row, [params], [seed]).token_ids[0]) for seed in range(50)}
    by_step = {int(sample(row, [params], [7], outputs=[[0] * step]).token_ids[0]) for step in range(50)}
    assert len(by_seed) > 40 and len(by_step) > 40
    assert all(0 < uniform_for(seed, step) < 1 for seed in (-1, 0, 2**70) for step in (0, 1, 10**6))
    assert uniform_for(5, 3) == uniform_for(5 + 2**64, 3)  # seeds count modulo 2**64


def reference_penalties(row: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]):
    row = row.clone()
    for token in set(prompt) | set(output):
        penalty = params.repetition_penalty
        row[token] = row[token] / penalty if row[token] > 0 else row[token] * penalty
    for token in set(output):
        row[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return row


def test_penalties_match_a_per_row_reference():
    logits = random_logits(4, 20)
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(frequency_penalty=0.5, presence_penalty=-1.0),
        SamplingParams(),
        SamplingParams(repetition_penalty=0.7, frequency_penalty=-0.3, presence_penalty=2.0),
    ]
    prompts = [[1, 2, 3], [4], [5, 6], [0, 19]]
    outputs = [[3, 3, 7], [4, 4, 4, 8], [9], [19, 19, 10, 0]]
    got = apply_penalties(logits, params, prompts, outputs)
    for i in range(4):
        torch.testing.assert_close(got[i], reference_penalties(logits[i], params[i], prompts[i], outputs[i]))
    assert not torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])


def test_no_penalty_returns_the_logits_untouched():
    logits = random_logits(3, 10)
    assert apply_penalties(logits, [SamplingParams()] * 3, [[1]] * 3, [[2]] * 3) is logits


def test_penalties_steer_greedy_choice_and_logits_are_not_modified():
    logits = torch.tensor([[0.0, 5.0, 4.9, 1.0]])
    before = logits.clone()
    params = SamplingParams(temperature=0, frequency_penalty=0.2)
    assert sample(logits, [params], outputs=[[1]]).token_ids.item() == 2
    assert sample(logits, [SamplingParams(temperature=0, repetition_penalty=1.1)], prompts=[[1]]).token_ids.item() == 2
    assert torch.equal(logits, before)


def test_logprob_is_log_softmax_of_penalised_logits_at_temperature_1():
    logits = random_logits(3, 40)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.3, top_k=3),
              SamplingParams(temperature=1.7, presence_penalty=1.0)]
    outputs = [[], [], [1, 2, 3]]
    out = sample(logits, params, outputs=outputs)
    reference = torch.log_softmax(apply_penalties(logits, params, [[]] * 3, outputs), -1)
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, reference.gather(1, out.token_ids[:, None]).squeeze(1))


def test_an_all_greedy_batch_reports_the_logprobs_a_mixed_batch_reports():
    """All-greedy steps take the row maximum for the chosen token's logit (no gather): the same
    log-probabilities, bit for bit, as when a sampled row shares the step."""
    logits = random_logits(3, 3000)
    greedy = sample(logits, [SamplingParams(temperature=0)] * 3)
    mixed = sample(logits, [SamplingParams(temperature=0)] * 2 + [SamplingParams(temperature=1.0)])
    assert torch.equal(greedy.token_ids[:2], mixed.token_ids[:2])
    assert torch.equal(greedy.logprobs[:2], mixed.logprobs[:2])
    reference = torch.log_softmax(logits, -1).amax(-1)
    torch.testing.assert_close(greedy.logprobs, reference)


def test_half_precision_logits():
    logits = random_logits(4, 100).to(torch.bfloat16)
    out = sample(logits, [SamplingParams(temperature=0), SamplingParams()] * 2)
    assert out.token_ids[0] == logits[0].float().argmax() and out.logprobs.dtype == torch.float32


def test_inputs_must_match_the_batch():
    with pytest.raises(ValueError, match="output_ids must be in"):
        SAMPLER.sample(torch.zeros(1, 5), [SamplingParams(presence_penalty=1)], [1], [[]], [[5]])
    with pytest.raises(ValueError, match="seeds"):
        SAMPLER.sample(torch.zeros(2, 5), [SamplingParams()] * 2, [1], [[]] * 2, [[]] * 2)
    with pytest.raises(ValueError, match="logits"):
        SAMPLER.sample(torch.zeros(5), [SamplingParams()], [1], [[]], [[]])


def reference_token(row: torch.Tensor, params: SamplingParams, u: float) -> tuple[int, bool]:
    """The sampler's rule in float64 (docs/sampling.md), and whether a rounding could change the
    answer: the nucleus's mass within 3e-7 of top_p, or u * total within 3e-7 of the total from a
    boundary (the C pass's exponential errs by ~2e-7 a weight)."""
    scaled = row.double() / params.temperature
    probs = torch.softmax(scaled, -1)
    keep = torch.ones_like(scaled, dtype=torch.bool)
    close = False
    if 1 < params.top_k < len(row):
        keep &= scaled >= scaled.topk(params.top_k).values[-1]
    if params.top_p < 1:
        order = scaled.argsort(descending=True)
        before = probs[order].cumsum(0) - probs[order]
        last = int((before < params.top_p).sum()) - 1
        keep &= scaled >= scaled[order[last]]
        neighbours = before[last : last + 2]  # the last kept token's mass before it, and the next one's
        close = bool(((neighbours - params.top_p).abs() < 3e-7).any())
    if params.min_p:
        keep &= probs >= params.min_p * probs.max()
    cdf = torch.where(keep, (scaled - scaled.max()).exp(), 0.0).cumsum(0)
    target = u * float(cdf[-1])
    token = int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64), right=True))
    gaps = (cdf - target).abs()
    return token, close or bool((gaps < 3e-7 * float(cdf[-1])).any())


@pytest.mark.skipif(cpu.row_sampler() is None, reason="no C compiler: torch samples every row")
@pytest.mark.parametrize("vocab, scale", [(49152, 3.0), (49152, 0.3), (1001, 3.0), (65, 1.0)])
def test_sampled_rows_draw_the_token_of_the_rule(vocab, scale):
    """radixrt's C passes (every sampled row on the CPU) and torch's ops (GPU rows) against the
    rule computed in float64, wherever a rounding cannot change the answer; filters alone and
    together, narrow and flat rows, ties at a threshold."""
    kinds = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_p=0.9),
             SamplingParams(top_k=40), SamplingParams(temperature=0.5, min_p=0.05),
             SamplingParams(temperature=0.9, top_p=0.95, top_k=100, min_p=0.01), SamplingParams(top_p=0.3),
             SamplingParams(temperature=2.0, top_k=3)]
    logits = random_logits(56, vocab, seed=vocab, scale=scale)
    logits[5, :10] = logits[5].max() + 1  # 10 tokens tied on top: top_k=40 keeps all, top_k=3 too
    logits[6, :] = -math.inf  # a row masked to one token
    logits[6, vocab // 2] = 0.0
    logits[9, :] = 0.5  # all tied: top_k=40 keeps every token
    params = [kinds[i % len(kinds)] for i in range(56)]
    seeds = list(range(700, 756))
    out = sample(logits, params, seeds)
    on_torch = sampler_module._sample_rows(logits, params, [uniform_for(seed, 0) for seed in seeds])
    compared = 0
    for row in range(56):
        expected, close = reference_token(logits[row], params[row], uniform_for(seeds[row], 0))
        if not close:
            compared += 1
            assert int(out.token_ids[row]) == expected, f"row {row}, C"
            assert int(on_torch[row]) == expected, f"row {row}, torch"
    assert compared >= 45


@settings(max_examples=150, deadline=None)
@given(values=st.lists(st.integers(-3, 3), min_size=1, max_size=3000), k=st.integers(1, 20), shift=st.floats(-5, 5))
def test_top_tokens_break_ties_by_token_in_torch_and_in_a_decode_run(values, k, shift):
    """Rows full of equal values: the k largest, largest first, equal values in token order and
    the lowest tokens among those equal to the last one kept, the same from `top_tokens` (the
    sampler) and from `radixrt_top_row` (a decode run's C pass), bit for bit."""
    row = torch.tensor(values, dtype=torch.float32)
    k = min(k, row.numel())
    got_values, got_tokens = sampler_module.top_tokens(row[None], k)
    order = sorted(range(row.numel()), key=lambda j: (-values[j], j))[:k]
    assert got_tokens[0].tolist() == order
    assert got_values[0].tolist() == [float(values[j]) for j in order]
    if cpu.decode_run() is None:
        return  # no whole-step kernels on this CPU: runs never report top log-probs
    library = cpu.load_library()
    tokens, logprobs = torch.empty(k, dtype=torch.int64), torch.empty(k, dtype=torch.float32)
    library.radixrt_top_row.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float,
                                        ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip
    library.radixrt_top_row(row.data_ptr(), row.numel(), k, shift, tokens.data_ptr(), logprobs.data_ptr())
    assert tokens.tolist() == order
    assert torch.equal(logprobs, got_values[0] - torch.tensor(shift, dtype=torch.float32))


@settings(max_examples=50, deadline=None)
@given(values=st.lists(st.floats(-30, 30, width=32), min_size=1, max_size=500, unique=True), k=st.integers(1, 20))
def test_top_tokens_of_distinct_values_are_torch_topk(values, k):
    row = torch.tensor(values, dtype=torch.float32)
    k = min(k, row.numel())
    got_values, got_tokens = sampler_module.top_tokens(row[None], k)
    want_values, want_tokens = row.topk(k)
    assert torch.equal(got_tokens[0], want_tokens) and torch.equal(got_values[0], want_values)
