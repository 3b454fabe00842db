"""Deterministic mode: every output bitwise the same however the requests were batched and cached.

Three tiny models, one per deterministic path: a bf16 Llama on random 4-bit
projections and a random 8-bit head (the whole-step kernel), and a dense
Qwen2-style model with q/k/v biases and 32-wide heads (the rowwise matmul
and the C attention, layer by layer) in bf16 and in float32. Each runs the same prompts under
configurations that change batch composition, chunk boundaries, the
shared-prefix split, page size, memory pressure and the cache; tokens and
log-probabilities must be equal bit for bit. The same checks without
`deterministic` find differences, so they can fail.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixrt.kernels import cpu
from radixrt.kernels.forward_batch import ForwardBatch
from radixrt.kernels.registry import create_backend
from radixrt.kernels.segments import aligned_attention_segments
from radixrt.memory import KVCache
from radixrt.model.llama import LlamaForCausalLM
from radixrt.model.loader import LoadedModel
from radixrt.model.runner import ModelRunner
from radixrt.runtime import Runtime
from tests.conftest import TINY_VOCAB, randomize_weights
from tests.test_decode_stack import native_llama
from tests.test_model import ours_from

CHUNK = 256  # kernels/cpu/decode_attention.c's CHUNK: prompts here cross it


def dense_llama(dtype: torch.dtype) -> LlamaForCausalLM:
    """A tiny dense model with q/k/v biases and 32-wide heads (Qwen2's layout)."""
    config = transformers.Qwen2Config(
        vocab_size=TINY_VOCAB, hidden_size=160, intermediate_size=320, num_hidden_layers=2, num_attention_heads=5,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    hf_model = transformers.Qwen2ForCausalLM(config)
    randomize_weights(hf_model, seed=3)
    ours = ours_from(hf_model).to(dtype)
    ours.prepack()
    return ours


@pytest.fixture(scope="module", params=["native", "dense-bf16", "dense-float32"])
def model(request: pytest.FixtureRequest) -> LlamaForCausalLM:
    if cpu.decode_stack() is None or cpu.rowwise_matmul() is None:
        pytest.skip("no C compiler or no AVX512-BF16 on this CPU: deterministic mode needs radixrt's kernels")
    if request.param == "native":
        return native_llama(TINY_VOCAB, quantized_head=True)
    return dense_llama(torch.float32 if request.param == "dense-float32" else torch.bfloat16)


@pytest.fixture(scope="module")
def loaded(model: LlamaForCausalLM, tiny_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    weights = "dense" if model._stack is None else "native"
    name = f"tiny-{weights}-{str(model.dtype).removeprefix('torch.')}"
    return LoadedModel(model=model, config=model.config, tokenizer=tiny_tokenizer, name=name,
                       path=Path(tmp_path_factory.mktemp(name)), weights=weights,
                       read_hf_config=lambda: None)  # fmt: skip


# --- the model step ---------------------------------------------------------------------------------
def runner_for(model: LlamaForCausalLM, num_slots: int, deterministic: bool) -> ModelRunner:
    config = model.config
    cache = KVCache(config.kv_shape(model.dtype), num_slots)
    backend = create_backend("torch", cache, config.num_heads, config.num_kv_heads, config.head_dim,
                             shared_prefix_min_tokens=8)  # fmt: skip
    return ModelRunner(model, cache, backend, deterministic=deterministic)


@dataclass
class Sequence:
    tokens: list[int]
    slots: torch.Tensor  # one slot per token; sequences sharing a prefix share its slots
    shared: int  # leading tokens shared with the group's other sequences (computed once, by the first)
    first_of_group: bool


@st.composite
def schedules(draw: Any) -> tuple[list[Sequence], list[list[tuple[int, int, int]]]]:
    """Prompts in groups that share a prefix, and a random way to compute them: each shared prefix
    once, then every sequence's own tokens, in chunks of random size (single tokens too), the
    pieces of different sequences batched at random. A step is a list of (sequence, start, end)."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    sequences: list[Sequence] = []
    next_slot = 0
    for _ in range(draw(st.integers(1, 3))):
        shared = [rng.randrange(TINY_VOCAB) for _ in range(draw(st.integers(0, 2 * CHUNK + 40)))]
        shared_slots = torch.arange(next_slot, next_slot + len(shared))
        next_slot += len(shared)
        for member in range(draw(st.integers(1, 3))):
            own = [rng.randrange(TINY_VOCAB) for _ in range(draw(st.integers(1, 40)))]
            slots = torch.cat([shared_slots, torch.arange(next_slot, next_slot + len(own))])
            sequences.append(Sequence(shared + own, slots, len(shared), member == 0))
            next_slot += len(own)
    pieces: list[list[tuple[int, int, int]]] = [[], []]  # shared prefixes first, then own tokens
    for s, sequence in enumerate(sequences):
        for phase, (begin, end) in enumerate(((0, sequence.shared if sequence.first_of_group else 0),
                                              (sequence.shared, len(sequence.tokens)))):
            while begin < end:
                size = rng.choice([1, 5, 64, CHUNK, 300, 1000])
                pieces[phase].append((s, begin, min(end, begin + size)))
                begin += size
    steps = []
    for phase_pieces in pieces:
        queues = {s: [p for p in phase_pieces if p[0] == s] for s in range(len(sequences))}
        while any(queues.values()):
            ready = [s for s, queue in queues.items() if queue]
            chosen = rng.sample(ready, rng.randint(1, len(ready)))
            steps.append([queues[s].pop(0) for s in chosen])
    return sequences, steps


def logits_of_every_token(runner: ModelRunner, sequences: list[Sequence],
                          steps: list[list[tuple[int, int, int]]]) -> dict[tuple[int, int], torch.Tensor]:
    """Run `steps`; the logits of every token computed, by (sequence, position)."""
    logits = {}
    for step in steps:
        batch = ForwardBatch.build([sequences[s].tokens[a:b] for s, a, b in step], [a for _, a, _ in step],
                                   [sequences[s].slots[:b] for s, _, b in step])  # fmt: skip
        rows = iter(runner.forward(batch, torch.arange(batch.num_tokens)))
        for s, a, b in step:
            for position in range(a, b):
                logits[(s, position)] = next(rows)
    return logits


def alone(sequences: list[Sequence]) -> list[list[tuple[int, int, int]]]:
    """Each sequence on its own, its whole prompt in one step (each in a fresh pool region)."""
    return [[(s, 0, len(sequence.tokens))] for s, sequence in enumerate(sequences)]


def differences(model: LlamaForCausalLM, sequences: list[Sequence], steps: list[list[tuple[int, int, int]]],
                deterministic: bool) -> int:
    """Tokens whose logits under `steps` differ from those of their prompt computed alone."""
    num_slots = max(int(s.slots.max()) for s in sequences) + 1
    scheduled = logits_of_every_token(runner_for(model, num_slots, deterministic), sequences, steps)
    reference = {}
    for step in alone(sequences):  # a fresh pool each: nothing shared, nothing cached
        reference.update(logits_of_every_token(runner_for(model, num_slots, deterministic), sequences, [step]))
    return sum(not torch.equal(logits, reference[key]) for key, logits in scheduled.items())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedules())
def test_every_token_gets_the_logits_it_gets_alone_however_it_is_scheduled(model, schedule):
    sequences, steps = schedule
    assert differences(model, sequences, steps, deterministic=True) == 0


def test_without_deterministic_the_schedule_shows_in_the_logits(model):
    """The check above can fail: chunk boundaries and the shared-prefix split change roundings."""
    rng = random.Random(0)
    shared = [rng.randrange(TINY_VOCAB) for _ in range(300)]
    sequences = [Sequence(shared + [5, 6, 7], torch.arange(303), 300, True),
                 Sequence(shared + [8, 9], torch.cat([torch.arange(300), torch.arange(303, 305)]), 300, False)]
    steps = [[(0, 0, 100)], [(0, 100, 300)], [(0, 300, 303), (1, 300, 302)]]
    assert differences(model, sequences, steps, deterministic=False) > 0
    assert differences(model, sequences, steps, deterministic=True) == 0


def test_aligned_segments_cut_every_row_at_whole_chunks_in_key_order():
    # two sequences sharing 600 cached slots, one decoding, one extending by 3
    slots = [torch.arange(601), torch.cat([torch.arange(600), torch.arange(601, 604)])]
    batch = ForwardBatch.build([[1], [2, 3, 4]], [600, 600], slots)
    segments = aligned_attention_segments(batch, shared_prefix_min_tokens=64, chunk=CHUNK)
    starts, lens = segments.starts.tolist(), segments.lens.tolist()
    rows = [segments.rows[a:b].tolist() for a, b in zip(segments.row_ptr[:-1].tolist(), segments.row_ptr[1:].tolist())]
    keys = {}  # row -> its key ranges, as positions in its own sequence, in the order listed
    kv_starts = batch.kv_indptr[:-1].tolist()
    seq_of_row = [0, 1, 1, 1]
    for start, length, segment_rows in zip(starts, lens, rows):
        for row in segment_rows:
            s = seq_of_row[row]
            first = start - kv_starts[s] if start >= kv_starts[s] else start - kv_starts[0]  # shared: sequence 0's
            keys.setdefault(row, []).append((first, first + length))
    for row, position in enumerate([600, 600, 601, 602]):
        expected = [(k * CHUNK, min((k + 1) * CHUNK, position + 1)) for k in range(position // CHUNK + 1)]
        assert keys[row] == expected, row
    # the two whole chunks of the shared prefix are read once for all four rows
    assert sum(length == CHUNK for length in lens) == 2 and all(len(r) == 4 for r, n in zip(rows, lens) if n == CHUNK)


# --- the whole runtime ------------------------------------------------------------------------------
# Each a way of running the same requests that changes how they meet the model: (name, Runtime
# options, how they are submitted).
CONFIGURATIONS: list[tuple[str, dict[str, Any], str]] = [
    ("one batch", {}, "together"),
    ("one at a time", {}, "one by one"),
    ("shuffled", {}, "shuffled"),
    ("two running at most", {"max_running_requests": 2}, "together"),
    ("chunked prefill of 48", {"chunked_prefill_size": 48}, "together"),
    ("pages of 16", {"page_size": 16}, "together"),
    ("tight pool (evicts, retracts)", {"max_total_tokens": 900}, "together"),
    ("cache off", {"disable_radix_cache": True}, "together"),
    ("cache warm", {}, "twice"),
]


@dataclass(frozen=True)
class Job:
    input_ids: list[int]
    params: dict[str, Any]
    logprob_start_len: int | None  # the prompt's log-probabilities from there on


@st.composite
def jobs(draw: Any) -> list[Job]:
    """Prompts sharing prefixes (a few-shot preamble, a fork), greedy or seeded samples, log-probs of
    the outputs and, for some, of the prompt."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    result = []
    for _ in range(draw(st.integers(1, 2))):
        shared = [rng.randrange(3, TINY_VOCAB) for _ in range(draw(st.integers(0, CHUNK + 60)))]
        for _ in range(draw(st.integers(1, 3))):
            own = [rng.randrange(3, TINY_VOCAB) for _ in range(draw(st.integers(1, 30)))]
            temperature = draw(st.sampled_from([0.0, 0.9]))
            params = {"max_new_tokens": draw(st.integers(1, 12)), "temperature": temperature, "ignore_eos": True,
                      "return_logprob": True, "seed": rng.randrange(2**31), "n": draw(st.sampled_from([1, 1, 2]))}
            logprob_start = draw(st.sampled_from([None, None, 0, len(shared)]))
            result.append(Job(shared + own, params, logprob_start))
    return result


def outputs(loaded: LoadedModel, jobs: list[Job], options: dict[str, Any], submit: str,
            deterministic: bool = True) -> list[tuple[list[int], list, list | None]]:
    """(output ids, output log-probs, prompt log-probs) of every sample, in job order."""
    order = list(range(len(jobs)))
    if submit == "shuffled":
        random.Random(1).shuffle(order)
    results: dict[int, list[dict]] = {}
    with Runtime(loaded, dtype=str(loaded.model.dtype).removeprefix("torch."), deterministic=deterministic,
                 check_invariants=True,
                 **{"max_total_tokens": 4096, **options}) as runtime:  # fmt: skip

        async def submit_all() -> list[Any]:
            return await asyncio.gather(*(
                runtime.async_generate(input_ids=jobs[i].input_ids, sampling_params=jobs[i].params,
                                       logprob_start_len=jobs[i].logprob_start_len)
                for i in order
            ))  # fmt: skip

        for _ in range(2 if submit == "twice" else 1):
            if submit == "one by one":
                answers = [runtime.generate(input_ids=jobs[i].input_ids, sampling_params=jobs[i].params,
                                            logprob_start_len=jobs[i].logprob_start_len) for i in order]
            else:
                answers = asyncio.run(submit_all())
            results = {i: answer if isinstance(answer, list) else [answer] for i, answer in zip(order, answers)}
    return [(out["output_ids"], out["meta_info"]["output_token_logprobs"], out["meta_info"].get("input_token_logprobs"))
            for i in range(len(jobs)) for out in results[i]]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(jobs())
def test_outputs_do_not_depend_on_batching_chunking_paging_memory_or_the_cache(loaded, jobs):
    reference = outputs(loaded, jobs, *CONFIGURATIONS[0][1:])
    for name, options, submit in CONFIGURATIONS[1:]:
        assert outputs(loaded, jobs, options, submit) == reference, name


def runner_over(model: LlamaForCausalLM, deterministic: bool | str) -> ModelRunner:
    config = model.config
    cache = KVCache(config.kv_shape(model.dtype), 64)
    backend = create_backend("torch", cache, config.num_heads, config.num_kv_heads, config.head_dim)
    return ModelRunner(model, cache, backend, deterministic=deterministic)


def test_deterministic_refuses_what_its_kernels_cannot_serve(tiny_llama_dir, make_tiny_hf_model):
    with pytest.raises(ValueError, match="deterministic must be True, False or 'auto'"):
        Runtime(tiny_llama_dir, deterministic="yes", max_total_tokens=256)
    sliding = ours_from(make_tiny_hf_model("mistral", sliding_window=16)).to(torch.bfloat16)
    with pytest.raises(ValueError, match="deterministic=True: .*full causal attention only"):
        runner_over(sliding, deterministic=True)
    wide_groups = ours_from(make_tiny_hf_model(hidden_size=34 * 4, num_attention_heads=34, num_key_value_heads=2, head_dim=16))
    with pytest.raises(ValueError, match="deterministic=True: .*at most 16 query heads per KV head"):
        runner_over(wide_groups, deterministic=True)
    assert runner_over(wide_groups, deterministic="auto").deterministic is False, "auto: off where it cannot be"


def test_auto_is_deterministic_where_the_kernels_serve_the_model(loaded):
    with Runtime(loaded, max_total_tokens=512) as runtime:
        assert runtime.deterministic is True


def test_a_backend_that_cannot_honour_it_is_refused_by_name(model):
    config = model.config
    cache = KVCache(config.kv_shape(model.dtype), 64)
    triton_backend = pytest.importorskip("radixrt.kernels.triton_backend")  # the class only: no GPU runs here
    backend = triton_backend.TritonAttentionBackend(cache, config.num_heads, config.num_kv_heads, config.head_dim)
    with pytest.raises(ValueError, match="deterministic=True: the triton attention backend is not batch-invariant"):
        ModelRunner(model, cache, backend, deterministic=True)
    ModelRunner(model, cache, backend)  # without it, the backend is fine
