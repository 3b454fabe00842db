"""The CPU decode-attention C kernel against an fp32 softmax reference, and its use by the torch backend."""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.kernels import cpu
from radixrt.kernels.registry import create_backend
from radixrt.kernels.torch_backend import _PagedDecode
from tests.test_quantized_matmul import rounding_bound
from tests.test_torch_backend import BATCHES, make_case, make_shared_case, reference

needs_kernel = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the CPU kernel"
)


def kernel() -> cpu.DecodeAttention:
    built = cpu.decode_attention()
    assert built is not None, "a C compiler is on this machine, so the kernel must build"
    return built


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(1, 700), min_size=1, max_size=5),
    heads=st.sampled_from([(4, 4, 64), (9, 3, 64), (8, 1, 128), (12, 2, 96), (16, 1, 32)]),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_softmax_reference(lens, heads, seed):
    """Any lengths (several 256-key chunks merged), GQA groups, head sizes, scattered slots."""
    num_q_heads, num_kv_heads, head_dim = heads
    generator = torch.Generator().manual_seed(seed)
    num_slots = sum(lens) + 7
    k_pool = torch.randn(num_slots, num_kv_heads, head_dim, generator=generator).bfloat16()
    v_pool = torch.randn(num_slots, num_kv_heads, head_dim, generator=generator).bfloat16()
    kv_indices = torch.randperm(num_slots, generator=generator)[: sum(lens)]
    kv_lens = torch.tensor(lens)
    kv_starts = torch.cumsum(kv_lens, 0) - kv_lens
    # q rows are strided (a view into a wider qkv row); sequences take their rows in a permuted order
    qkv = torch.randn(len(lens), num_q_heads + 2 * num_kv_heads, head_dim, generator=generator).bfloat16()
    q = qkv[:, :num_q_heads]
    rows = torch.randperm(len(lens), generator=generator)
    out = torch.zeros(len(lens), num_q_heads, head_dim, dtype=torch.bfloat16)
    lse = torch.zeros(len(lens), num_q_heads)
    scale = head_dim**-0.5
    kernel()(q, k_pool, v_pool, kv_indices, kv_starts, kv_lens, rows, out, lse, scale)
    group = num_q_heads // num_kv_heads
    for i, (start, length) in enumerate(zip(kv_starts.tolist(), lens)):
        slots = kv_indices[start : start + length]
        keys = k_pool[slots].float().repeat_interleave(group, dim=1)
        values = v_pool[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,shd->hs", q[rows[i]].float(), keys) * scale
        expected = torch.einsum("hs,shd->hd", scores.softmax(-1), values)
        torch.testing.assert_close(out[rows[i]].float(), expected, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse[rows[i]], scores.logsumexp(-1), atol=1e-4, rtol=1e-5)


@needs_kernel
def test_a_sequence_gets_the_same_bits_alone_and_among_many():
    """Alone, a sequence's keys are split by KV head over the threads; among many, one item takes
    all the heads of a piece of keys. Each head computes alone either way: the same bits."""
    num_q_heads, num_kv_heads, head_dim, lens = 9, 3, 64, [300, 700, 40, 513, 256, 90, 5, 611]
    generator = torch.Generator().manual_seed(7)
    num_slots = sum(lens)
    k_pool = torch.randn(num_slots, num_kv_heads, head_dim, generator=generator).bfloat16()
    v_pool = torch.randn(num_slots, num_kv_heads, head_dim, generator=generator).bfloat16()
    kv_indices = torch.randperm(num_slots, generator=generator)
    kv_lens = torch.tensor(lens)
    kv_starts = torch.cumsum(kv_lens, 0) - kv_lens
    q = torch.randn(len(lens), num_q_heads, head_dim, generator=generator).bfloat16()
    together = torch.zeros_like(q)
    kernel()(q, k_pool, v_pool, kv_indices, kv_starts, kv_lens, torch.arange(len(lens)), together, None, 0.125)
    for i in range(len(lens)):
        alone = torch.zeros_like(q)
        kernel()(q, k_pool, v_pool, kv_indices, kv_starts[i : i + 1], kv_lens[i : i + 1], torch.tensor([i]), alone,
                 None, 0.125)  # fmt: skip
        assert torch.equal(alone[i], together[i]), f"sequence {i}"


def test_kernel_shapes_and_dtypes_it_does_not_take_stay_on_torch():
    assert not cpu.supports(8, 8, 64, torch.float32)
    assert not cpu.supports(32, 1, 64, torch.bfloat16)  # more query heads per KV head than it holds
    assert not cpu.supports(4, 4, 512, torch.bfloat16)
    cache, batch, *_ = make_case(BATCHES["decode-ragged"], 1, 4, 2, 64)
    backend = create_backend("torch", cache, 4, 2, 64)
    assert not any(isinstance(group, _PagedDecode) for group in backend.plan(batch).groups)


@needs_kernel
@pytest.mark.parametrize("layout", ["decode-equal", "decode-ragged", "mixed"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_backend_decodes_bfloat16_through_the_kernel(layout, page_size):
    cache, batch, q, k, v = make_case(BATCHES[layout], page_size, 6, 2, 64, dtype=torch.bfloat16)
    backend = create_backend("torch", cache, 6, 2, 64)
    plan = backend.plan(batch)
    assert any(isinstance(group, _PagedDecode) for group in plan.groups)
    out = backend.forward(q, k, v, 1, batch, plan)
    torch.testing.assert_close(out.float(), reference(cache, batch, q, k, v, 1), atol=2e-2, rtol=2e-2)


@needs_kernel
def test_shared_prefix_tails_use_the_kernel_with_log_sum_exps():
    """Decodes after a shared prefix: the kernel attends the tails and returns their LSEs for the merge."""
    specs = [(80, 1), (95, 1), (120, 1)]
    cache, batch, q, k, v = make_shared_case(64, specs, 1, 6, 2, 64, dtype=torch.bfloat16)
    backend = create_backend("torch", cache, 6, 2, 64, shared_prefix_min_tokens=32)
    plan = backend.plan(batch)
    assert plan.cascades and any(isinstance(g, _PagedDecode) and g.with_lse for g in plan.groups)
    out = backend.forward(q, k, v, 0, batch, plan)
    torch.testing.assert_close(out.float(), reference(cache, batch, q, k, v, 0), atol=2e-2, rtol=2e-2)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_rms_norm_is_transformers_rms_norm_up_to_summation_order(rows):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = cpu.rms_norm()
    assert norm is not None
    generator = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, 576, generator=generator).bfloat16()
    residual = torch.randn(rows, 576, generator=generator).bfloat16()
    reference = LlamaRMSNorm(576, eps=1e-5).bfloat16()
    with torch.no_grad():
        reference.weight.copy_(torch.randn(576, generator=generator))
        total = hidden + residual
        expected = reference(total)
        summed = hidden.clone()
        for got, want in ((norm(hidden.clone(), reference.weight, 1e-5), reference(hidden)),
                          (norm(summed, reference.weight, 1e-5, residual), expected)):
            # the same arithmetic; only the sum of squares runs in another order, which moves
            # a rare element by one bf16 step
            assert (got != want).float().mean() < 0.01
            torch.testing.assert_close(got, want, atol=0, rtol=2**-7)
        assert torch.equal(summed, total), "the residual is added into hidden in place"
        # each row is reduced alone: a row's result does not depend on the batch around it
        assert torch.equal(norm(total[-1:].clone(), reference.weight, 1e-5), expected[-1:])
    with pytest.raises(ValueError, match="contiguous"):
        norm(torch.cat([hidden, hidden], dim=1)[:, ::2], reference.weight, 1e-5)


@needs_kernel
def test_kv_store_writes_rows_into_their_slots_like_indexed_assignment():
    store = cpu.kv_store()
    assert store is not None
    k_pool, v_pool = torch.zeros(40, 3, 16).bfloat16(), torch.zeros(40, 3, 16).bfloat16()
    qkv = torch.randn(5, 9, 16).bfloat16()  # k and v are strided head slices of a fused row, as in the model
    k, v = qkv[:, 3:6], qkv[:, 6:9]
    slots = torch.tensor([7, 0, 39, 12, 13])
    assert store.takes(k, slots) and store.takes(v, slots)
    store(k, v, slots, k_pool, v_pool)
    expected_k, expected_v = torch.zeros_like(k_pool), torch.zeros_like(v_pool)
    expected_k[slots], expected_v[slots] = k, v
    assert torch.equal(k_pool, expected_k) and torch.equal(v_pool, expected_v)
    with pytest.raises(IndexError, match="outside the pool"):
        store(k[:2], v[:2], torch.tensor([3, 40]), k_pool, v_pool)
    assert not k_pool[3].any(), "a bad slot writes nothing"
    assert not store.takes(k.float(), slots) and not store.takes(k, slots.int())


@needs_kernel
def test_backend_stores_bfloat16_rows_through_the_c_copy():
    from radixrt.kernels.forward_batch import ForwardBatch
    from radixrt.memory import KVCache
    from radixrt.memory.kv_cache import KVShape

    cache = KVCache(KVShape(1, 2, 16, torch.bfloat16), 32)
    backend = create_backend("torch", cache, 4, 2, 16)
    assert backend._store_rows is not None
    batch = ForwardBatch.build([[1, 2, 3]], [0], [torch.tensor([9, 4, 20])])
    q, k, v = (torch.randn(3, heads, 16).bfloat16() for heads in (4, 2, 2))
    assert backend._store_rows.takes(k, batch.out_slots), "these rows take the C copy, not the fallback"
    backend.forward(q, k, v, 0, batch, backend.plan(batch))
    assert torch.equal(cache.k[0][[9, 4, 20]], k) and torch.equal(cache.v[0][[9, 4, 20]], v)


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 3000), ties=st.booleans(), seed=st.integers(0, 2**16))
def test_row_stats_are_torchs_argmax_max_and_logsumexp(rows, cols, ties, seed):
    """The first index of the largest value (ties included, across the kernel's 1024-value
    blocks), that value and the log-sum-exp, on rows read with a stride."""
    kernel = cpu.row_stats()
    assert kernel is not None
    generator = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, cols + 5, generator=generator) * 8
    if ties:  # the largest value again, later in the row
        wide[:, -6] = wide[:, :cols].amax(dim=1)
    logits = wide[:, :cols]
    assert kernel.takes(logits)
    argmax, maximum, lse = kernel(logits)
    assert torch.equal(argmax, logits.argmax(dim=1))
    assert torch.equal(maximum, logits.amax(dim=1))
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=1), atol=1e-5, rtol=1e-6)


@needs_kernel
@pytest.mark.parametrize("masked", ["first half", "second half", "all but one"])
def test_row_stats_of_rows_with_masked_values(masked):
    """Masked logits (-inf, as grammar or bad-word masks leave them) add nothing, wherever they are."""
    logits = torch.randn(3, 1001, generator=torch.Generator().manual_seed(1)) * 4
    if masked == "first half":
        logits[:, :500] = -torch.inf
    elif masked == "second half":
        logits[:, 500:] = -torch.inf
    else:
        logits[:, torch.arange(1001) != 700] = -torch.inf
    argmax, maximum, lse = cpu.row_stats()(logits)
    assert torch.equal(argmax, logits.argmax(dim=1)) and torch.equal(maximum, logits.amax(dim=1))
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=1), atol=1e-5, rtol=1e-6)


@needs_kernel
def test_row_stats_are_the_same_bits_for_a_row_alone_and_in_a_batch():
    logits = torch.randn(9, 49152, generator=torch.Generator().manual_seed(2)) * 3
    together = cpu.row_stats()(logits)
    for r in range(9):
        alone = cpu.row_stats()(logits[r : r + 1])
        assert all(torch.equal(a[0], t[r]) for a, t in zip(alone, together)), f"row {r}"


def rowwise() -> cpu.RowwiseMatmul:
    built = cpu.rowwise_matmul()
    if built is None:
        pytest.skip("no C compiler")
    return built


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 300), st.integers(1, 200)),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rowwise_matmul_gives_a_row_the_same_bits_in_any_batch(shape, dtype, bias, seed):
    """Any K (masked tails), N (tile tails), row counts, row offsets and thread counts: each row is
    bitwise what it is alone, and close to a float64 product."""
    num_out, num_in = shape
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_out, num_in, generator=generator).to(dtype)
    bias_values = torch.randn(num_out, generator=generator).to(dtype) if bias else None
    x = torch.randn(40, num_in, generator=generator).to(dtype)
    matmul = rowwise()
    full = matmul(x, weight, bias_values)
    alone = torch.cat([matmul(x[i : i + 1], weight, bias_values) for i in range(40)])
    assert torch.equal(full, alone)
    for start, rows in ((3, 5), (17, 23), (0, 4)):
        assert torch.equal(matmul(x[start : start + rows], weight, bias_values), full[start : start + rows])
    with cpu.kernel_threads(1):
        assert torch.equal(matmul(x, weight, bias_values), full)
    expected = x.double() @ weight.double().T + (0 if bias_values is None else bias_values.double())
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: the output's own rounding
    assert torch.allclose(full.double(), expected, rtol=tolerance, atol=tolerance * num_in**0.5)
    floats = matmul(x, weight, bias_values, float_out=True)
    assert floats.dtype == torch.float32 and torch.equal(floats.to(dtype), full)


def test_rowwise_matmul_refuses_mismatched_inputs_by_name():
    matmul = rowwise()
    with pytest.raises(ValueError, match="need \\[M, K\\] and \\[N, K\\] of one dtype"):
        matmul(torch.ones(2, 8), torch.ones(4, 9))
    with pytest.raises(ValueError, match="need \\[M, K\\] and \\[N, K\\] of one dtype"):
        matmul(torch.ones(2, 8), torch.ones(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="unit stride along K"):
        matmul(torch.ones(8, 2).t(), torch.ones(4, 8))


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("tiles", [1, 2, 3, 7, 15, 16, 17, 31, 33, 40])
def test_quantized_matmul_gives_a_row_the_same_bits_in_any_batch_and_blocking(bits, tiles):
    """A single row runs in blocks of up to 16 tiles (4-bit; 8-bit up to 8: 16, 8, 4, 2, 1,
    whatever is left of a thread's share), several rows in blocks of about 8 chains: a row's result
    is the same bits however it is blocked, and is the dense product of the file's weights (within
    `rounding_bound`)."""
    kernel = cpu.quantized_matmul()
    if kernel is None:
        pytest.skip("no AVX512-BF16 on this CPU")
    num_rows, num_cols = 16 * tiles, 96
    generator = torch.Generator().manual_seed(tiles * bits)
    groups = num_cols // 32
    scales = (torch.rand(num_rows, groups, generator=generator) * 0.02).half()
    if bits == 4:
        codes = torch.randint(0, 16, (num_rows, num_cols), generator=generator, dtype=torch.uint8)
        offsets = (torch.randn(num_rows, groups, generator=generator) * 0.05).half()
        packed = kernel.pack_int4(codes, scales, offsets)
        dense = codes.float() * scales.float().repeat_interleave(32, 1) + offsets.float().repeat_interleave(32, 1)
    else:
        codes = torch.randint(-128, 128, (num_rows, num_cols), generator=generator, dtype=torch.int8)
        packed = kernel.pack_int8(codes, scales)
        dense = codes.float() * scales.float().repeat_interleave(32, 1)
    x = torch.randn(9, num_cols, generator=generator).bfloat16()
    together = kernel(x, packed, out=torch.empty(9, num_rows))
    for i in (0, 4, 8):
        alone = kernel(x[i : i + 1], packed, out=torch.empty(1, num_rows))
        assert torch.equal(alone[0], together[i]), f"row {i}"
    error = (together.double() - x.double() @ dense.double().t()).abs()
    assert (error <= rounding_bound(x, dense, bits)).all()
