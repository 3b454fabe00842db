"""Decode runs (kernels/cpu/decode_run.c): k decode steps in one call give what k single steps give."""

from __future__ import annotations

import asyncio
import ctypes
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixrt.engine.scheduler import Scheduler
from radixrt.kernels import cpu
from radixrt.kernels.forward_batch import ForwardBatch
from radixrt.model.loader import LoadedModel
from radixrt.model.llama import LlamaForCausalLM
from radixrt.model.runner import ModelRunner
from radixrt.runtime.api import Runtime
from radixrt.sampling.params import SamplingParams
from radixrt.model.row_kernels import cpu_row_kernels
from radixrt.sampling.sampler import Sampler, run_sampling
from tests.conftest import TINY_VOCAB
from tests.test_decode_stack import VOCAB, filled_runner, headed_model, native_llama  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def model(headed_model: LlamaForCausalLM) -> LlamaForCausalLM:
    """The whole-step kernel's tiny Llama with a quantized head of its own (runs need both)."""
    return headed_model


def deterministic_runner(model: LlamaForCausalLM, num_slots: int) -> ModelRunner:
    runner = filled_runner(model, num_slots, seed=3)
    runner = ModelRunner(model, runner.kv_cache, runner.backend, deterministic=True)
    assert runner.runs_decodes
    return runner


def sequences(contexts: list[int], shared: int, steps: int, seed: int) -> tuple[list[torch.Tensor], int]:
    """Each sequence's slots for its context and `steps` more tokens, scattered over a pool; the
    first `shared` slots common to all."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(contexts) + steps * len(contexts)
    order = torch.randperm(total + 7, generator=generator)
    common, taken, slots = order[:shared], shared, []
    for context in contexts:
        own = context + steps - shared
        slots.append(torch.cat([common, order[taken : taken + own]]))
        taken += own
    return slots, total + 7


def step_by_step(runner: ModelRunner, tokens, positions, slots, params, seeds, stops, steps, prompts=None,
                 earlier=None):
    """The reference: one `forward` and one `Sampler.sample` a step, stopping as a run does
    (`prompts`, `earlier`: the prompts and earlier outputs the penalties count and, for the
    outputs, the draws follow). Returns the new tokens and log-probabilities, [steps, rows], and
    each step's top log-probabilities (the sampler's lists, None when no row asks)."""
    sampler, logprobs, tops = Sampler(cpu_row_kernels()), [[] for _ in tokens], []
    outputs = [list(e) for e in earlier] if earlier else [[] for _ in tokens]
    done = [len(o) for o in outputs]
    prompts = prompts or [[] for _ in tokens]
    tokens, positions = list(tokens), list(positions)
    for _ in range(steps):
        batch = ForwardBatch.build([[t] for t in tokens], positions, [s[: p + 1] for s, p in zip(slots, positions)])
        logits = runner.forward(batch)
        out = sampler.sample(logits, params, seeds, prompts, outputs)
        tops.append(out.top_logprobs)
        tokens = out.token_ids.tolist()
        for i, (token, logprob) in enumerate(zip(tokens, out.logprobs.tolist())):
            outputs[i].append(token)
            logprobs[i].append(logprob)
        positions = [p + 1 for p in positions]
        if any(t in stop for t, stop in zip(tokens, stops)):
            break
    return torch.tensor([o[n:] for o, n in zip(outputs, done)]).T, torch.tensor(logprobs).T, tops


def run_tops(out: cpu.RunOutput, params: list[SamplingParams]) -> list[list[list[tuple[int, float]]] | None]:
    """A run's top log-probabilities as the sampler lists them: each row its own count."""
    steps = out.top_lists()
    if steps is None:
        return [None] * out.tokens.shape[0]
    return [[top[: p.top_logprobs_num] for top, p in zip(step, params)] for step in steps]


MIXED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8, top_p=0.9, seed=5),
    SamplingParams(temperature=1.3, top_k=5, seed=6),
    SamplingParams(temperature=0.7, min_p=0.1, seed=7),
    SamplingParams(temperature=0, repetition_penalty=1.4),
    SamplingParams(temperature=0.9, frequency_penalty=0.1, presence_penalty=0.35, seed=8),
    SamplingParams(temperature=0, frequency_penalty=-0.7, presence_penalty=0.15),
    SamplingParams(temperature=0, top_logprobs_num=4),
    SamplingParams(temperature=0.9, top_p=0.95, seed=9, presence_penalty=0.3, top_logprobs_num=20),
]


def histories(count: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """A prompt and earlier outputs per sequence for the penalties to count (the pool holds random
    K/V anyway); the outputs repeat tokens, up to 7 times, so that frequency x count rounds."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (20,), generator=generator).tolist() for _ in range(count)]
    earlier = [torch.randint(0, 6, (24,), generator=generator).tolist() for _ in range(count)]
    return prompts, earlier


@pytest.mark.parametrize(
    "contexts, shared, first",
    [([37], 0, 0), ([300, 5, 1, 700], 0, 0), ([600, 300, 290, 500], 280, 2), ([256, 511, 512, 513], 256, 4),
     ([90, 91, 92, 93, 94, 95], 64, 0)],
)
def test_a_run_gives_the_tokens_and_logprobs_of_single_steps(model, contexts, shared, first):
    """Contexts crossing the 256-key chunks during the run, shared prefixes of whole chunks, greedy,
    every filter and every penalty: tokens and log-probabilities equal bit for bit, and the same
    K/V written."""
    steps = 6
    slots, num_slots = sequences(contexts, shared, steps, seed=len(contexts))
    params = [MIXED[(first + i) % len(MIXED)] for i in range(len(contexts))]
    seeds = [11 * i + 1 for i in range(len(contexts))]
    tokens = [(7 * i + 3) % VOCAB for i in range(len(contexts))]
    stops = [[] for _ in contexts]
    prompts, earlier = histories(len(contexts), seed=first)
    reference = deterministic_runner(model, num_slots)
    want_tokens, want_logprobs, want_tops = step_by_step(reference, tokens, contexts, slots, params, seeds, stops,
                                                         steps, prompts, earlier)  # fmt: skip

    runner = deterministic_runner(model, num_slots)
    sampling = run_sampling(params, seeds, prompts, earlier, stops, steps, VOCAB)
    out = runner.decode_run(tokens, contexts, slots, sampling, steps)
    assert torch.equal(out.tokens, want_tokens)
    assert torch.equal(out.logprobs, want_logprobs)
    assert run_tops(out, params) == want_tops
    assert all(torch.equal(a, b) for a, b in zip(runner.kv_cache.k, reference.kv_cache.k))
    assert all(torch.equal(a, b) for a, b in zip(runner.kv_cache.v, reference.kv_cache.v))


@st.composite
def run_cases(draw: Any) -> tuple[list[int], int, list[SamplingParams], int, int]:
    """Contexts (some crossing 256-key chunks during the run), a shared prefix, each row's
    settings from MIXED, the run's length, and a seed for the prompts and earlier outputs."""
    rows = draw(st.integers(1, 5))
    shared = draw(st.sampled_from([0, 0, 64, 256, 300]))
    contexts = [draw(st.integers(max(shared, 1), 560)) for _ in range(rows)]
    params = [draw(st.sampled_from(MIXED)) for _ in range(rows)]
    return contexts, shared, params, draw(st.integers(1, 7)), draw(st.integers(0, 2**16))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(run_cases())
def test_any_run_gives_what_single_steps_give(model, case):
    """Property: for random batches (sizes, contexts, shared prefixes, settings, earlier outputs,
    a stop token drawn from the reference), a run's tokens, log-probabilities and K/V are those
    of single steps up to the step that drew the stop token."""
    contexts, shared, params, steps, seed = case
    slots, num_slots = sequences(contexts, shared, steps, seed=seed)
    seeds = [seed + i for i in range(len(contexts))]
    tokens = [(seed + 5 * i) % VOCAB for i in range(len(contexts))]
    prompts, earlier = histories(len(contexts), seed=seed)
    free, *_ = step_by_step(deterministic_runner(model, num_slots), tokens, contexts, slots, params, seeds,
                           [[] for _ in contexts], steps, prompts, earlier)  # fmt: skip
    stop = int(free[(seed // 7) % steps, (seed // 3) % len(contexts)])  # a token some row draws
    stops = [[stop] if i == (seed // 3) % len(contexts) else [] for i in range(len(contexts))]
    reference = deterministic_runner(model, num_slots)
    want_tokens, want_logprobs, want_tops = step_by_step(reference, tokens, contexts, slots, params, seeds, stops,
                                                         steps, prompts, earlier)  # fmt: skip
    runner = deterministic_runner(model, num_slots)
    out = runner.decode_run(
        tokens, contexts, slots, run_sampling(params, seeds, prompts, earlier, stops, steps, VOCAB), steps
    )
    assert torch.equal(out.tokens, want_tokens) and torch.equal(out.logprobs, want_logprobs)
    assert run_tops(out, params) == want_tops
    assert all(torch.equal(a, b) for a, b in zip(runner.kv_cache.k, reference.kv_cache.k))


def test_a_run_stops_after_the_step_that_drew_a_stop_token(model):
    contexts, steps = [40, 90], 8
    slots, num_slots = sequences(contexts, 0, steps, seed=1)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=2)]
    tokens, seeds = [5, 6], [1, 2]
    free_tokens, *_ = step_by_step(deterministic_runner(model, num_slots), tokens, contexts, slots, params, seeds,
                                  [[], []], steps)  # fmt: skip
    stop = int(free_tokens[3, 1])  # row 1's fourth token (unless an earlier one is the same)
    first = next(s for s in range(steps) if int(free_tokens[s, 1]) == stop)
    runner = deterministic_runner(model, num_slots)
    got, *_ = runner.decode_run(tokens, contexts, slots, run_sampling(params, seeds, [[], []], [[], []], [[], [stop]], steps,
                                                                                VOCAB),
                               steps)  # fmt: skip
    assert torch.equal(got, free_tokens[: first + 1])


def test_an_interrupt_ends_a_run_after_its_current_step(model):
    """The engine sets the flag when a caller posts something; a run seeing it stops, its step done."""
    contexts, steps = [30], 6
    slots, num_slots = sequences(contexts, 0, steps, seed=4)
    params, seeds = [SamplingParams(temperature=0)], [0]
    want, *_ = step_by_step(deterministic_runner(model, num_slots), [9], contexts, slots, params, seeds, [[]], steps)
    runner = deterministic_runner(model, num_slots)
    sampling = run_sampling(params, seeds, [[]], [[]], [[]], steps, VOCAB)
    got, *_ = runner.decode_run([9], contexts, slots, sampling, steps, ctypes.c_int32(1))
    assert torch.equal(got, want[:1])
    rest, *_ = runner.decode_run([int(got[0, 0])], [contexts[0] + 1], slots,
                                run_sampling(params, seeds, [[]], [[int(got[0, 0])]], [[]], steps - 1, VOCAB), steps - 1,
                                ctypes.c_int32(0))  # fmt: skip
    assert torch.equal(torch.cat([got, rest]), want)


def test_a_run_continues_a_request_from_its_output_count(model):
    """Step s of a run draws output token `num_outputs + s`: a run after three tokens draws what
    steps 3.. of a longer run do."""
    contexts, steps = [64], 5
    slots, num_slots = sequences(contexts, 0, steps, seed=2)
    params, seeds = [SamplingParams(temperature=1.0, seed=9, frequency_penalty=0.4)], [9]
    want, *_ = step_by_step(deterministic_runner(model, num_slots), [4], contexts, slots, params, seeds, [[]], steps)
    runner = deterministic_runner(model, num_slots)
    first, *_ = runner.decode_run([4], contexts, slots, run_sampling(params, seeds, [[]], [[]], [[]], 3, VOCAB), 3)
    rest, *_ = runner.decode_run([int(first[-1, 0])], [contexts[0] + 3], slots,
                                run_sampling(params, seeds, [[]], [first[:, 0].tolist()], [[]], 2, VOCAB), 2)
    assert torch.equal(torch.cat([first, rest]), want)


def test_a_run_refuses_slots_tokens_and_penalty_counts_that_do_not_fit(model):
    slots, num_slots = sequences([10], 0, 4, seed=3)
    runner = deterministic_runner(model, num_slots)
    sampling = run_sampling([SamplingParams(temperature=0)], [0], [[]], [[]], [[]], 4, VOCAB)
    before = [pool.clone() for pool in runner.kv_cache.k]
    with pytest.raises(IndexError, match="slot"):
        runner.decode_run([1], [10], [torch.cat([slots[0][:-1], torch.tensor([num_slots])])], sampling, 4)
    with pytest.raises(IndexError, match="token id"):
        runner.decode_run([VOCAB], [10], slots, sampling, 4)
    penalised = run_sampling([SamplingParams(temperature=0, repetition_penalty=1.2)], [0], [[]], [[]], [[]], 4,
                             VOCAB - 1)  # counts one token short of the head's rows
    with pytest.raises(ValueError, match="penalty counts must be"):
        runner.decode_run([1], [10], slots, penalised, 4)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_cache.k)), "nothing computed"


# --- through the runtime ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def loaded(model: LlamaForCausalLM, tiny_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny native Llama as a runtime serves it (vocabulary of the tiny tokenizer)."""
    ours = native_llama(TINY_VOCAB, quantized_head=True)
    return LoadedModel(model=ours, config=ours.config, tokenizer=tiny_tokenizer, name="tiny-native",
                       path=Path(tmp_path_factory.mktemp("tiny-native")), weights="native",
                       read_hf_config=lambda: None)  # fmt: skip


class RunSpy:
    """Counts the decode runs and the steps they ran (the real `ModelRunner.decode_run` does the work)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.runs, self.steps = 0, 0
        real = ModelRunner.decode_run

        def counted(runner: ModelRunner, *args: Any) -> cpu.RunOutput:
            out = real(runner, *args)
            self.runs += 1
            self.steps += out.tokens.shape[0]
            return out

        monkeypatch.setattr(ModelRunner, "decode_run", counted)


REQUESTS = [
    # SGLang's parameters (issue 38): min_new_tokens masks stop tokens inside runs too; stop_regex is
    # judged on the text like stop strings; logit_bias and token_ids_logprob keep a batch out of runs.
    ("the quick brown fox", {"temperature": 0.7, "seed": 8, "max_new_tokens": 30, "min_new_tokens": 12,
                             "stop_token_ids": [100, 200, 300], "return_logprob": True}),
    ("a story about", {"temperature": 0, "max_new_tokens": 30, "stop_regex": [r"\bth\w", "ing"], "no_stop_trim": True}),
    ("the quick brown fox", {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}),
    ("the quick brown fox", {"temperature": 0.9, "top_p": 0.8, "seed": 3, "max_new_tokens": 25}),
    ("a story about", {"temperature": 1.2, "top_k": 7, "min_p": 0.05, "seed": 4, "max_new_tokens": 2}),
    ("a story about", {"temperature": 0, "max_new_tokens": 40, "stop": [" the", "ing"]}),
    ("once upon a time", {"temperature": 0.7, "seed": 5, "max_new_tokens": 33, "stop_token_ids": [100, 200, 300],
                          "return_logprob": True}),
    ("once upon a time", {"temperature": 0, "max_new_tokens": 30, "repetition_penalty": 1.5, "ignore_eos": True}),
    ("the quick brown fox", {"temperature": 0.8, "seed": 6, "max_new_tokens": 30, "frequency_penalty": 0.7,
                             "presence_penalty": 0.5, "return_logprob": True}),
    ("a story about", {"temperature": 0, "max_new_tokens": 20, "top_logprobs_num": 3, "return_logprob": True,
                       "ignore_eos": True}),
    ("once upon a time", {"temperature": 1.1, "seed": 7, "max_new_tokens": 24, "top_logprobs_num": 7,
                          "return_logprob": True, "repetition_penalty": 1.2}),
]


def serve(loaded: LoadedModel, requests: list[tuple[str, dict[str, Any]]], stream: bool = False,
          **options: Any) -> list[Any]:
    with Runtime(loaded, check_invariants=True, max_total_tokens=2048, **options) as runtime:
        assert runtime.deterministic

        async def all_together() -> list[Any]:
            async def one(prompt: str, params: dict[str, Any]) -> Any:
                answer = await runtime.async_generate(prompt, params, stream=stream)
                if not stream:
                    return answer
                return [chunk async for chunk in answer]

            return await asyncio.gather(*(one(prompt, params) for prompt, params in requests))

        return asyncio.run(all_together())


def test_the_runtime_gives_the_same_outputs_with_and_without_decode_runs(loaded, monkeypatch):
    """Greedy and sampled requests, filters, stop strings, stop tokens, short limits, log-probs:
    the same results (and invariants checked after every step or run) with runs of 8 and 3 as
    step by step; and runs did happen."""
    step_by_step = serve(loaded, REQUESTS, decode_steps=1)
    spy = RunSpy(monkeypatch)
    for steps in (8, 3):
        runs_before = spy.runs
        results = serve(loaded, REQUESTS, decode_steps=steps)
        assert spy.runs > runs_before
        for got, want in zip(results, step_by_step):
            assert got["output_ids"] == want["output_ids"]
            assert got["text"] == want["text"]
            assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
            assert got["meta_info"].get("output_token_logprobs") == want["meta_info"].get("output_token_logprobs")
            assert got["meta_info"].get("output_top_logprobs") == want["meta_info"].get("output_top_logprobs")
    assert spy.steps > 2 * spy.runs, "runs of several steps"
    assert all(len(top) == 7 for top in results[-1]["meta_info"]["output_top_logprobs"]), "each row its own count"


def test_requests_waiting_for_a_running_place_change_no_output(loaded, monkeypatch):
    """With two running places for nine requests, runs go on while the others wait (each ends at
    a request's stop token or limit, and the next is admitted): the outputs of step by step."""
    want = serve(loaded, REQUESTS, decode_steps=1, max_running_requests=2)
    real, waited = Scheduler.run_length, []

    def noting_waits(scheduler: Scheduler, *args: Any) -> int:
        steps = real(scheduler, *args)
        if steps > 1 and scheduler.waiting:
            waited.append(steps)
        return steps

    monkeypatch.setattr(Scheduler, "run_length", noting_waits)
    got = serve(loaded, REQUESTS, decode_steps=8, max_running_requests=2)
    assert waited, "runs while requests waited"
    for result, reference in zip(got, want):
        assert result["output_ids"] == reference["output_ids"]
        assert result["meta_info"]["finish_reason"] == reference["meta_info"]["finish_reason"]
        assert result["meta_info"].get("output_top_logprobs") == reference["meta_info"].get("output_top_logprobs")


def test_streams_carry_the_same_text_a_run_at_a_time(loaded, monkeypatch):
    want = serve(loaded, REQUESTS, stream=True, decode_steps=1)
    spy = RunSpy(monkeypatch)
    got = serve(loaded, REQUESTS, stream=True, decode_steps=8)
    assert spy.runs
    for chunks, reference in zip(got, want):
        assert "".join(c["text"] for c in chunks) == "".join(c["text"] for c in reference)
        assert [i for c in chunks for i in c["output_ids"]] == [i for c in reference for i in c["output_ids"]]
    assert sum(map(len, got)) < sum(map(len, want)), "the tokens of a run arrive together"


def test_decode_steps_must_be_a_positive_integer(loaded):
    for bad in (0, -1, 2.5, "8"):
        with pytest.raises(ValueError, match="decode_steps"):
            Runtime(loaded, decode_steps=bad)


def test_a_post_during_a_run_ends_it_after_its_step_and_changes_nothing(loaded, monkeypatch):
    """Anything a caller posts while a run computes (here an abort of an unknown id, posted as
    the first run starts) ends that run after its current step; the outputs stay those of
    step-by-step decoding."""
    want = serve(loaded, REQUESTS, decode_steps=1)
    real = ModelRunner.decode_run
    runs: list[int] = []
    with Runtime(loaded, check_invariants=True, max_total_tokens=2048, decode_steps=8) as runtime:

        def posting_first(runner: ModelRunner, *args: Any) -> cpu.RunOutput:
            if not runs:
                runtime.abort("no-such-request")
            out = real(runner, *args)
            runs.append(out.tokens.shape[0])
            return out

        monkeypatch.setattr(ModelRunner, "decode_run", posting_first)

        async def all_together() -> list[Any]:
            return await asyncio.gather(*(runtime.async_generate(p, params) for p, params in REQUESTS))

        got = asyncio.run(all_together())
    assert runs[0] == 1 and len(runs) > 1 and max(runs) > 1
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in want]


def test_logit_bias_and_asked_token_logprobs_take_single_steps(loaded, monkeypatch):
    """A batch with a logit bias or token_ids_logprob decodes step by step (Sampler.sample adds
    them), with the outputs of a batch of its own."""
    biased = ("once upon a time", {"temperature": 0.9, "seed": 9, "max_new_tokens": 12, "logit_bias": {"5": 3.0},
                                   "token_ids_logprob": [4, 7], "return_logprob": True})
    alone = serve(loaded, [biased], decode_steps=1)[0]
    spy = RunSpy(monkeypatch)
    other = ("the quick brown fox", {"temperature": 0, "max_new_tokens": 12, "logit_bias": {"9": -2.0},
                                     "ignore_eos": True})
    together = serve(loaded, [biased, other], decode_steps=8)[0]
    assert spy.runs == 0
    assert together["output_ids"] == alone["output_ids"]
    assert together["meta_info"]["output_token_ids_logprobs"] == alone["meta_info"]["output_token_ids_logprobs"]
    assert [[e[1] for e in step] for step in alone["meta_info"]["output_token_ids_logprobs"]] == [[4, 7]] * 12
