"""The whole-step 4-bit kernel (kernels/cpu/decode_stack.c) against the per-layer path it replaces."""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.kernels import cpu
from radixrt.kernels.forward_batch import ForwardBatch
from radixrt.kernels.registry import create_backend
from radixrt.kernels.segments import attention_segments
from radixrt.memory import KVCache, huge_pages
from radixrt.memory.kv_cache import KVShape
from radixrt.model.gguf_int4 import NativeWeights
from radixrt.model.linear import PackedLMHead
from radixrt.model.executors import STACK_MAX_ROWS, WholeStep
from radixrt.model.int4_layer import Int4DecodeStack
from radixrt.model.llama import INT4_MAX_ROWS, LlamaForCausalLM
from radixrt.model.runner import ModelRunner
from tests.conftest import randomize_weights
from tests.test_model import prepacked
from tests.test_native_weights import random_int4, random_int8
from tests.test_torch_backend import reference

VOCAB = 256
SHARED_MIN = 8  # shared_prefix_min_tokens of the backends here: small prefixes are shared too


def native_llama(vocab_size: int = VOCAB, quantized_head: bool = False) -> LlamaForCausalLM:
    """A tiny bf16 Llama on random 4-bit projections (and, if asked, a random 8-bit LM head)."""
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=192, intermediate_size=256, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    hf_model = transformers.LlamaForCausalLM(config)
    randomize_weights(hf_model, seed=0)
    ours = prepacked(hf_model, torch.bfloat16)
    config = ours.config
    shapes = {
        "qkv": ((config.num_heads + 2 * config.num_kv_heads) * config.head_dim, config.hidden_size),
        "o": (config.hidden_size, config.num_heads * config.head_dim),
        "gate_up": (2 * config.intermediate_size, config.hidden_size),
        "down": (config.hidden_size, config.intermediate_size),
    }
    layers = [{name: random_int4(*shape, seed=10 * i + j) for j, (name, shape) in enumerate(shapes.items())}
              for i in range(config.num_layers)]  # fmt: skip
    head = random_int8(config.vocab_size, config.hidden_size, seed=99) if quantized_head else None
    ours.use_int4_projections(NativeWeights(layers, head))
    assert WholeStep.stack_for(ours) is not None, "a plain Llama on 4-bit weights runs as one stack"
    return ours


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    if cpu.decode_stack() is None:
        pytest.skip("no C compiler or no AVX512-BF16 on this CPU: layers run one at a time")
    return native_llama()


def filled_runner(model: LlamaForCausalLM, num_slots: int, seed: int, whole_steps: bool = True) -> ModelRunner:
    """A runner over a pool of random K/V (stand-ins for cached tokens)."""
    config = model.config
    cache = KVCache(config.kv_shape(torch.bfloat16), num_slots)
    generator = torch.Generator().manual_seed(seed)
    for pool in (*cache.k, *cache.v):
        pool.copy_(torch.randn(pool.shape, generator=generator))
    backend = create_backend("torch", cache, config.num_heads, config.num_kv_heads, config.head_dim,
                             shared_prefix_min_tokens=SHARED_MIN)  # fmt: skip
    return ModelRunner(model, cache, backend, whole_steps=whole_steps)


def make_batch(specs: list[tuple[int, int]], shared: int, seed: int) -> tuple[ForwardBatch, int]:
    """Sequences (prefix, extend) on scattered slots; the first `shared` cached slots common to all
    (every prefix must be at least `shared` long)."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(p + e for p, e in specs)
    order = torch.randperm(total + 5, generator=generator)
    common, taken, slots = order[:shared], shared, []
    for prefix, extend in specs:
        own = prefix + extend - min(shared, prefix)
        slots.append(torch.cat([common[: min(shared, prefix)], order[taken : taken + own]]))
        taken += own
    ids = [torch.randint(0, VOCAB, (e,), generator=generator).tolist() for _, e in specs]
    return ForwardBatch.build(ids, [p for p, _ in specs], slots), total + 5


@pytest.fixture(scope="module")
def headed_model() -> LlamaForCausalLM:
    """`model` with an 8-bit LM head of its own, as GGUF files store it: the whole-step kernel runs it."""
    if cpu.decode_stack() is None:
        pytest.skip("no C compiler or no AVX512-BF16 on this CPU: layers run one at a time")
    ours = native_llama(quantized_head=True)
    assert isinstance(ours._invariant_lm_head, PackedLMHead)
    return ours


def both_paths(
    model: LlamaForCausalLM, batch: ForwardBatch, num_slots: int, seed: int, logit_rows: torch.Tensor | None = None
):
    """(logits, K pools) through the stack and through the layers one at a time, same start pool;
    logits of `logit_rows` (default: every new token)."""
    if logit_rows is None:
        logit_rows = torch.arange(batch.num_tokens)
    results = []
    for use_stack in (True, False):
        runner = filled_runner(model, num_slots, seed, whole_steps=use_stack)
        assert isinstance(runner.executor(batch), WholeStep) == use_stack
        logits = runner.forward(batch, logit_rows)
        results.append((logits, [pool.clone() for pool in runner.kv_cache.k]))
    return results


# The layer path runs the 4-bit weights up to INT4_MAX_ROWS tokens (beyond, the dense ones)
@pytest.mark.parametrize("specs", [[(0, 1)], [(40, 1)], [(300, 1), (5, 1), (0, 1), (700, 1)], [(20, 1)] * 16])
def test_decode_steps_are_bit_identical_to_the_layer_path(model, specs):
    batch, num_slots = make_batch(specs, shared=0, seed=len(specs))
    (stacked, stacked_k), (layered, layered_k) = both_paths(model, batch, num_slots, seed=1)
    assert torch.equal(stacked, layered)
    assert all(torch.equal(a, b) for a, b in zip(stacked_k, layered_k)), "the same K written to the same slots"


@pytest.mark.parametrize("specs, rows", [([(0, 1)], None), ([(300, 1), (5, 1), (0, 1), (700, 1)], [3, 0, 3, 1]),
                                         ([(20, 1)] * 16, None), ([(40, 1), (7, 1), (90, 1)], [2, 2, 0])])
def test_the_whole_step_through_the_files_head_is_bit_identical_to_the_layer_path(headed_model, specs, rows,
                                                                                  monkeypatch):
    """Embedding lookup, RoPE table rows, final norm and the 8-bit head inside the kernel's call:
    the logits of any rows (repeats, any order) as the layers, the model's norm and the head's own
    call give. (Decodes: the layer path attends an extend through SDPA, in another order.)"""
    batch, num_slots = make_batch(specs, shared=0, seed=len(specs))
    logit_rows = None if rows is None else torch.tensor(rows)
    calls = []
    stack_logits = Int4DecodeStack.logits
    monkeypatch.setattr(Int4DecodeStack, "logits", lambda *args: calls.append(args) or stack_logits(*args))
    (stacked, stacked_k), (layered, layered_k) = both_paths(headed_model, batch, num_slots, 1, logit_rows)
    assert len(calls) == 1, "the stacked step ran its head in the kernel"
    assert torch.equal(stacked, layered)
    assert all(torch.equal(a, b) for a, b in zip(stacked_k, layered_k))


def test_the_packed_weights_lie_side_by_side_in_the_order_a_step_reads_them(headed_model):
    """One buffer on huge pages (memory/huge_pages.py), so that a step streams one run of memory;
    the layer path and the whole-step kernel read the same copies."""
    layers = headed_model.decoder_layers()
    packed = [weight for layer in layers for weight in layer.int4_steps.packed_weights()]
    packed.append(headed_model._invariant_lm_head.packed)
    at = packed[0].data.data_ptr()
    assert at % huge_pages.HUGE_PAGE == 0
    for weight in packed:
        assert weight.data.data_ptr() == at
        at += -(-weight.data.numel() // huge_pages.ALIGNMENT) * huge_pages.ALIGNMENT
    stack = WholeStep.stack_for(headed_model)
    assert stack is not None
    handle = stack.weights(headed_model.embedding_table())
    for i, layer in enumerate(layers):
        steps = layer.int4_steps
        assert [handle.layer_addresses(i)[j] for j in (1, 2, 4, 5)] == [w.data.data_ptr() for w in steps.packed_weights()]


def test_a_token_id_or_logit_row_out_of_range_is_refused_before_anything_is_written(headed_model):
    batch, num_slots = make_batch([(30, 1)], shared=0, seed=3)
    runner = filled_runner(headed_model, num_slots, seed=3)
    before = [pool.clone() for pool in runner.kv_cache.k]
    slots = batch.kv_indices
    with pytest.raises(IndexError, match="token id outside the embedding"):
        runner.forward(ForwardBatch.build([[VOCAB]], [30], [slots]))
    with pytest.raises(IndexError, match="logit row outside the step"):
        runner.forward(batch, torch.tensor([1]))
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_cache.k))


@settings(max_examples=30, deadline=None)
@given(
    specs=st.lists(st.tuples(st.integers(0, 600), st.integers(1, 12)), min_size=1, max_size=5),
    shared=st.integers(0, 300),
    heads=st.sampled_from([(6, 2, 64), (9, 3, 64), (8, 1, 128), (4, 4, 32)]),
    seed=st.integers(0, 1000),
)
def test_segment_attention_is_causal_softmax_attention(specs, shared, heads, seed):
    """The segments of any batch (shared prefixes, own keys over several 256-key chunks,
    extends' new keys) through the C kernel: each new token attends exactly its causal keys
    (against an fp32 per-sequence reference)."""
    kernel = cpu.decode_attention()
    if kernel is None:
        pytest.skip("no C compiler for the CPU kernels")
    num_q_heads, num_kv_heads, head_dim = heads
    specs = [(p + shared, e) for p, e in specs]
    batch, num_slots = make_batch(specs, shared=shared, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    cache = KVCache(KVShape(1, num_kv_heads, head_dim, torch.bfloat16), num_slots)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=generator))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=generator))
    q, k, v = (torch.randn(batch.num_tokens, h, head_dim, generator=generator).bfloat16()
               for h in (num_q_heads, num_kv_heads, num_kv_heads))  # fmt: skip
    expected = reference(cache, batch, q, k, v, 0)
    cache.k[0][batch.out_slots], cache.v[0][batch.out_slots] = k, v
    segments = attention_segments(batch, SHARED_MIN)
    out = torch.zeros_like(q)
    kernel.segments(q, cache.k[0], cache.v[0], batch.kv_indices,
                    (segments.starts, segments.lens, segments.row_ptr, segments.rows), out, None, head_dim**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("specs, shared", [([(128, 6)], 0), ([(40, 3), (300, 5), (7, 1)], 0),
                                           ([(90, 4), (150, 1), (260, 7)], 80)])
def test_an_extend_gives_the_logits_of_decoding_its_tokens_one_at_a_time(model, specs, shared):
    """The stack's extends (causality as segments) and shared prefixes (read once, merged by
    log-sum-exp) against the same tokens decoded one at a time, each over its whole sequence:
    the same softmax merged in another order. (Against the layer path's SDPA for extends, a
    one-ulp difference in one attention output can grow through this random model's layers
    into a logit off by ~1: measured, hence the comparison within the stack.)"""
    assert sum(e for _, e in specs) <= INT4_MAX_ROWS
    batch, num_slots = make_batch(specs, shared=shared, seed=len(specs))
    runner = filled_runner(model, num_slots, seed=2)
    together = runner.forward(batch, torch.arange(batch.num_tokens))
    one_by_one = filled_runner(model, num_slots, seed=2)
    starts, rows = batch.kv_offsets, batch.qo_offsets
    ids = batch.input_ids.tolist()
    expected = torch.empty_like(together)
    for j in range(max(e for _, e in specs)):  # every sequence's j-th new token, in one decode step
        members = [i for i, (_, e) in enumerate(specs) if j < e]
        step = ForwardBatch.build(
            [[ids[rows[i] + j]] for i in members], [specs[i][0] + j for i in members],
            [batch.kv_indices[starts[i] : starts[i] + specs[i][0] + j + 1] for i in members],
        )  # fmt: skip
        expected[[rows[i] + j for i in members]] = one_by_one.forward(step)
    torch.testing.assert_close(together, expected, atol=0.05, rtol=0.02)


def test_a_decode_row_does_not_depend_on_the_batch_it_is_in(model):
    """Up to STACK_MAX_ROWS rows a step: each row's logits and K/V, bit for bit, as when it runs alone."""
    specs = [(17 * i % 300, 1) for i in range(STACK_MAX_ROWS)]
    batch, num_slots = make_batch(specs, shared=0, seed=5)
    runner = filled_runner(model, num_slots, seed=5)
    together = runner.forward(batch)
    k_together = [pool.clone() for pool in runner.kv_cache.k]
    starts = batch.kv_offsets
    for i, (prefix, _) in enumerate(specs):
        alone = filled_runner(model, num_slots, seed=5)
        slots = batch.kv_indices[starts[i] : starts[i + 1]]
        logits = alone.forward(ForwardBatch.build([[int(batch.input_ids[i])]], [prefix], [slots]))
        assert torch.equal(logits[0], together[i]), f"row {i}"
        new_slot = slots[-1]
        assert all(torch.equal(a[new_slot], b[new_slot]) for a, b in zip(alone.kv_cache.k, k_together))


def test_segments_read_a_shared_prefix_once_and_an_extend_row_its_new_keys():
    slots = [torch.arange(0, 12), torch.cat([torch.arange(0, 10), torch.arange(20, 24)])]
    batch = ForwardBatch.build([[1], [1, 2, 3]], [11, 11], slots)
    segments = attention_segments(batch, shared_prefix_min_tokens=4)
    rows = segments.rows.tolist()
    runs = [(int(s), int(n), rows[a:b]) for s, n, a, b in
            zip(segments.starts, segments.lens, segments.row_ptr[:-1], segments.row_ptr[1:])]  # fmt: skip
    kv_start = batch.kv_offsets
    assert runs == [
        (kv_start[0], 10, [0, 1, 2, 3]),  # the shared 10 slots, for all four new tokens
        (kv_start[0] + 10, 2, [0]),  # the decode's own cached slot and its new one
        (kv_start[1] + 10, 1, [1, 2, 3]),  # the extend's own cached slot
        (kv_start[1] + 11, 1, [1]),  # its new tokens, causally
        (kv_start[1] + 11, 2, [2]),
        (kv_start[1] + 11, 3, [3]),
    ]


def test_large_steps_and_other_backends_stay_on_the_layer_path(model):
    batch, num_slots = make_batch([(10, STACK_MAX_ROWS + 1)], shared=0, seed=0)
    runner = filled_runner(model, num_slots, seed=0)
    assert not isinstance(runner.executor(batch), WholeStep)
    fp32_pool = KVCache(model.config.kv_shape(torch.float32), num_slots)
    config = model.config
    backend = create_backend("torch", fp32_pool, config.num_heads, config.num_kv_heads, config.head_dim)
    assert not backend.reads_pool_in_place
    assert WholeStep.create(model, backend, deterministic=False) is None


def test_a_slot_outside_the_pool_is_refused_before_anything_is_written(model):
    batch, num_slots = make_batch([(30, 1)], shared=0, seed=3)
    runner = filled_runner(model, num_slots, seed=3)
    before = [pool.clone() for pool in runner.kv_cache.k]
    bad = ForwardBatch.build([[5]], [30], [torch.cat([batch.kv_indices[:30], torch.tensor([num_slots + 3])])])
    with pytest.raises(IndexError, match="outside the pool"):
        runner.forward(bad)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_cache.k))
