"""Deterministic mode: every output bitwise the same however the requests were batched and cached.

Tiny models, one per deterministic path: a bf16 Llama on random 4-bit
projections and a random 8-bit head (the whole-step kernel); a dense
Qwen2-style model with q/k/v biases and 32-wide heads (the rowwise matmul
and the C attention, layer by layer) in bf16 and in float32; a Gemma 3 with
a 300-key window on one layer of two (windowed attention, Gemma's norms) and
a float32 Mistral with a 100-key window. Each runs the same prompts under
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
from radixrt.model.executors import WholeStep
from radixrt.model.llama import LlamaForCausalLM
from radixrt.model.loader import LoadedModel
from radixrt.model.runner import ModelRunner
from radixrt.runtime import Runtime
from tests.conftest import TINY_VOCAB, randomize_weights
from tests.test_decode_stack import native_llama
from tests.test_model import ours_from, prepacked
from tests.test_model_families import FAMILIES

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
    return prepacked(hf_model, dtype)


def windowed(architecture: str, dtype: torch.dtype) -> LlamaForCausalLM:
    """A tiny dense model with sliding-window layers: Gemma 3 (a 300-key window on its first
    layer of two, across a 256-key chunk) or Mistral (a 100-key window on every layer)."""
    common = dict(vocab_size=TINY_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    if architecture == "gemma3":
        rope = {"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                "full_attention": dict(rope_type="linear", rope_theta=1e6, factor=2.0)}  # fmt: skip
        config = transformers.Gemma3TextConfig(**common, query_pre_attn_scalar=24, sliding_window=300,
                                               layer_types=["sliding_attention", "full_attention"],
                                               rope_parameters=rope)  # fmt: skip
        hf_model = transformers.Gemma3ForCausalLM(config)
    else:
        hf_model = transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=100))
    randomize_weights(hf_model, seed=5)
    return prepacked(hf_model, dtype)


@pytest.fixture(scope="module",
                params=["native", "dense-bf16", "dense-float32", "gemma3-window-bf16", "mistral-window-float32"])
def model(request: pytest.FixtureRequest) -> LlamaForCausalLM:
    if cpu.rowwise_matmul() is None:
        pytest.skip("no C compiler: deterministic mode needs radixrt's kernels")
    dtype = torch.float32 if request.param.endswith("float32") else torch.bfloat16
    if request.param == "native":
        if cpu.decode_stack() is None:
            pytest.skip("no AVX512-BF16 on this CPU: the whole-step 4-bit kernel is not built")
        return native_llama(TINY_VOCAB, quantized_head=True)
    if "window" in request.param:
        return windowed(request.param.split("-")[0], dtype)
    return dense_llama(dtype)


@pytest.fixture(scope="module")
def loaded(model: LlamaForCausalLM, tiny_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    weights = "dense" if WholeStep.stack_for(model) is None else "native"
    name = f"tiny-{model.config.architecture}-{weights}-{str(model.dtype).removeprefix('torch.')}"
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "float32"])
@pytest.mark.parametrize("family", ["qwen3-bias-tied", "qwen2-window", "phi3-window", "phi3-longrope-partial",
                                    "llama-llama3"])
def test_each_family_gets_the_logits_it_gets_alone(family, dtype, make_tiny_hf_model):
    """The other families' extras (q/k norms, per-layer windows, fused projections, partial and
    scaled RoPE) at the model step: a prompt in chunks, then two sequences sharing it."""
    if cpu.rowwise_matmul() is None:
        pytest.skip("no C compiler: deterministic mode needs radixrt's kernels")
    architecture, overrides = FAMILIES[family]
    model = prepacked(make_tiny_hf_model(architecture, **overrides), dtype)
    length = 100 if family == "phi3-longrope-partial" else 300  # within its trained positions
    rng = random.Random(0)
    shared = [rng.randrange(TINY_VOCAB) for _ in range(length)]
    own_slots = torch.arange(length + 3, length + 5)
    sequences = [Sequence(shared + [5, 6, 7], torch.arange(length + 3), length, True),
                 Sequence(shared + [8, 9], torch.cat([torch.arange(length), own_slots]), length, False)]
    steps = [[(0, 0, 37)], [(0, 37, length)], [(0, length, length + 3), (1, length, length + 2)]]
    assert differences(model, sequences, steps, deterministic=True) == 0


def test_aligned_segments_cut_every_row_at_whole_chunks_in_key_order():
    # two sequences sharing 600 cached slots, one decoding, one extending by 3
    slots = [torch.arange(601), torch.cat([torch.arange(600), torch.arange(601, 604)])]
    batch = ForwardBatch.build([[1], [2, 3, 4]], [600, 600], slots)
    segments = aligned_attention_segments(batch, shared_prefix_min_tokens=64, chunk=CHUNK)
    starts, lens = segments.starts.tolist(), segments.lens.tolist()
    rows = [segments.rows[a:b].tolist() for a, b in zip(segments.row_ptr[:-1].tolist(), segments.row_ptr[1:].tolist())]
    keys = {}  # row -> its key ranges, as positions in its own sequence, in the order listed
    kv_starts = list(batch.kv_offsets[:-1])
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


@settings(max_examples=40, deadline=None)
@given(prefix_len=st.integers(0, 700), extend_len=st.integers(1, 300), window=st.sampled_from([None, 1, 100, 256, 300]),
       chunk=st.sampled_from([16, 256]))
def test_aligned_segments_give_each_row_its_window_in_chunk_pieces(prefix_len, extend_len, window, chunk):
    """Each row's keys, windowed or not, are its positions lo..p exactly once, in key order, cut at
    multiples of the chunk; a second sequence sharing the prefix reads the same pieces."""
    slots = [torch.arange(prefix_len + extend_len),
             torch.cat([torch.arange(prefix_len), torch.arange(5000, 5000 + extend_len)])]
    tokens = [list(range(extend_len))] * 2
    batch = ForwardBatch.build(tokens, [prefix_len, prefix_len], slots)
    segments = aligned_attention_segments(batch, shared_prefix_min_tokens=8, chunk=chunk, sliding_window=window)
    kv_indices = batch.kv_indices.tolist()
    pieces: dict[int, list[list[int]]] = {}
    for start, length, a, b in zip(segments.starts.tolist(), segments.lens.tolist(),
                                   segments.row_ptr[:-1].tolist(), segments.row_ptr[1:].tolist()):
        for row in segments.rows[a:b].tolist():
            pieces.setdefault(row, []).append(kv_indices[start:start + length])
    for s in range(2):
        for j in range(extend_len):
            p = prefix_len + j
            lo = 0 if window is None else max(0, p + 1 - window)
            row_pieces = pieces[s * extend_len + j]
            assert [slot for piece in row_pieces for slot in piece] == slots[s][lo:p + 1].tolist()
            cuts = [lo + sum(len(piece) for piece in row_pieces[:n]) for n in range(1, len(row_pieces))]
            assert all(cut % chunk == 0 for cut in cuts) and all(len(piece) <= chunk for piece in row_pieces)


# --- the whole runtime ------------------------------------------------------------------------------
# Each a way of running the same requests that changes how they meet the model: (name, Runtime
# options, how they are submitted).
CONFIGURATIONS: list[tuple[str, dict[str, Any], str]] = [
    ("one batch", {}, "together"),
    ("one step a call (no decode runs)", {"decode_steps": 1}, "together"),
    ("decode runs of 3", {"decode_steps": 3}, "together"),
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
            max_new_tokens = draw(st.integers(1, 12))
            params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": True,
                      "return_logprob": True, "seed": rng.randrange(2**31), "n": draw(st.sampled_from([1, 1, 2])),
                      # SGLang's parameters (issue 38): each row alone, so batch-invariant too.
                      "min_new_tokens": min(draw(st.sampled_from([0, 0, 4])), max_new_tokens),
                      "logit_bias": draw(st.sampled_from([None, None, {"5": 2.5, "9": -1.0}])),
                      "top_logprobs_num": draw(st.sampled_from([0, 0, 3])),
                      "token_ids_logprob": draw(st.sampled_from([None, None, [4, 7]]))}
            logprob_start = draw(st.sampled_from([None, None, 0, len(shared)]))
            result.append(Job(shared + own, params, logprob_start))
    return result


def outputs(loaded: LoadedModel, jobs: list[Job], options: dict[str, Any], submit: str,
            deterministic: bool = True) -> list[tuple[list[int], list, dict]]:
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
    return [(out["output_ids"], out["meta_info"]["output_token_logprobs"],
             {k: v for k, v in out["meta_info"].items() if "logprobs" in k and k != "output_token_logprobs"})
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
