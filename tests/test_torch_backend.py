"""The torch attention backend against a per-sequence fp32 softmax reference, and backend choice."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.kernels.forward_batch import ForwardBatch
from radixrt.kernels.registry import create_backend
from radixrt.kernels.torch_backend import TorchAttentionBackend
from radixrt.memory.kv_cache import KVCache, KVShape

# (prefix_len, extend_len) per sequence; each layout exercises a different plan:
BATCHES = {
    "single-prefill": [(0, 37)],  # one sequence, no prefix: is_causal, no gather padding
    "single-extend": [(50, 13)],  # offset causal mask
    "decode-equal": [(20, 1), (20, 1), (20, 1)],  # decode group without a mask
    "decode-ragged": [(5, 1), (64, 1), (0, 1), (257, 1)],  # masked decode group, a one-token prompt
    "extend-packed": [(10, 8), (12, 6), (9, 9)],  # similar extends share one padded call
    "extend-split": [(200, 2), (0, 40), (1, 3)],  # too ragged to pack all: two calls
    "mixed": [(0, 37), (45, 1), (100, 20), (0, 1), (300, 1), (17, 70), (33, 9)],
}


def make_case(specs, page_size, num_q_heads, num_kv_heads, head_dim, dtype=torch.float32, seed=0):
    """A pool of random values; each sequence gets shuffled pages (slots in order inside a page)."""
    generator = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-(p + e) // page_size) for p, e in specs]
    num_pages = sum(pages_per_seq) + 2
    order = torch.randperm(num_pages, generator=generator)
    kv_slots, taken = [], 0
    for (p, e), n in zip(specs, pages_per_seq):
        pages = order[taken : taken + n]
        taken += n
        kv_slots.append((pages[:, None] * page_size + torch.arange(page_size)).flatten()[: p + e])
    cache = KVCache(KVShape(2, num_kv_heads, head_dim, dtype), num_pages * page_size)
    for layer in range(2):
        cache.k[layer].copy_(torch.randn(cache.k[layer].shape, generator=generator))
        cache.v[layer].copy_(torch.randn(cache.v[layer].shape, generator=generator))
    batch = ForwardBatch.build([[0] * e for _, e in specs], [p for p, _ in specs], kv_slots)
    num_tokens = batch.num_tokens
    q, k, v = (
        torch.randn(num_tokens, h, head_dim, generator=generator).to(dtype)
        for h in (num_q_heads, num_kv_heads, num_kv_heads)
    )
    return cache, batch, q, k, v


def reference(cache, batch, q, k, v, layer):
    """Softmax attention one sequence at a time, in fp32, over a copy of the pool with the new K/V."""
    pool_k, pool_v = cache.k[layer].float().clone(), cache.v[layer].float().clone()
    pool_k[batch.out_slots], pool_v[batch.out_slots] = k.float(), v.float()
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape)
    for i, (prefix, extend) in enumerate(zip(batch.prefix_lens, batch.extend_lens)):
        slots = batch.kv_indices[batch.kv_offsets[i] : batch.kv_offsets[i + 1]]
        keys = pool_k[slots].repeat_interleave(group, dim=1)
        values = pool_v[slots].repeat_interleave(group, dim=1)
        rows = slice(batch.qo_offsets[i], batch.qo_offsets[i + 1])
        scores = torch.einsum("ehd,shd->hes", q[rows].float(), keys) * q.shape[-1] ** -0.5
        visible = torch.arange(prefix + extend)[None, :] <= prefix + torch.arange(extend)[:, None]
        out[rows] = torch.einsum("hes,shd->ehd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values)
    return out


@pytest.mark.parametrize("layout", list(BATCHES))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(4, 4, 64), (6, 2, 64), (8, 2, 128)])
def test_matches_reference(layout, page_size, num_q_heads, num_kv_heads, head_dim):
    cache, batch, q, k, v = make_case(BATCHES[layout], page_size, num_q_heads, num_kv_heads, head_dim)
    expected = reference(cache, batch, q, k, v, layer=1)
    backend = TorchAttentionBackend(cache, num_q_heads, num_kv_heads, head_dim, page_size)
    out = backend.forward(q, k, v, 1, batch, backend.plan(batch))
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.equal(cache.k[1][batch.out_slots], k) and torch.equal(cache.v[1][batch.out_slots], v)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_bfloat16_and_strided_inputs():
    """bf16 pool; q/k/v given as strided views of one q|k|v buffer, as the model passes them."""
    cache, batch, q, k, v = make_case(BATCHES["mixed"], 4, 6, 2, 64, dtype=torch.bfloat16)
    fused = torch.cat([q, k, v], dim=1)
    q_view, k_view, v_view = fused[:, :6], fused[:, 6:8], fused[:, 8:]
    backend = TorchAttentionBackend(cache, 6, 2, 64, 4)
    out = backend.forward(q_view, k_view, v_view, 0, batch, backend.plan(batch))
    torch.testing.assert_close(out.float(), reference(cache, batch, q, k, v, layer=0), atol=2e-2, rtol=2e-2)


def test_plan_is_reused_by_every_layer():
    cache, batch, q, k, v = make_case(BATCHES["mixed"], 1, 6, 2, 64)
    backend = TorchAttentionBackend(cache, 6, 2, 64)
    plan = backend.plan(batch)
    for layer in (0, 1):
        out = backend.forward(q, k, v, layer, batch, plan)
        torch.testing.assert_close(out, reference(cache, batch, q, k, v, layer), atol=1e-5, rtol=1e-5)


def test_constructor_validates_shapes():
    cache = KVCache(KVShape(1, 2, 64, torch.float32), 16)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        TorchAttentionBackend(cache, 5, 2, 64)
    with pytest.raises(ValueError, match="must match the KV cache"):
        TorchAttentionBackend(cache, 4, 2, 128)


def test_registry_auto_picks_torch_on_cpu():
    cache = KVCache(KVShape(1, 2, 64, torch.float32), 16)
    for name in (None, "auto", "torch"):
        backend = create_backend(name, cache, 4, 2, 64, page_size=1)
        assert isinstance(backend, TorchAttentionBackend) and backend.name == "torch"


def test_registry_rejects_unknown_and_gpu_backends_on_cpu():
    cache = KVCache(KVShape(1, 2, 64, torch.float32), 16)
    with pytest.raises(ValueError, match="one of auto, flashinfer, triton, torch; got 'cuda'"):
        create_backend("cuda", cache, 4, 2, 64)
    for name in ("triton", "flashinfer"):
        with pytest.raises(ValueError, match="needs a CUDA KV cache"):
            create_backend(name, cache, 4, 2, 64)


def make_shared_case(shared_len, specs, page_size, num_q_heads, num_kv_heads, head_dim, dtype=torch.float32, seed=0):
    """Sequences whose slot lists start with the same `shared_len` slots (tree-owned pages),
    then pages of their own. specs: (prefix_len, extend_len) with prefix_len >= shared_len,
    or (None, prefix_len, extend_len) for a sequence that shares nothing."""
    generator = torch.Generator().manual_seed(seed)
    shared_pages = -(-shared_len // page_size)
    own = [-(-(s[-2] + s[-1] - (0 if len(s) == 3 else shared_len)) // page_size) for s in specs]
    num_pages = shared_pages + sum(own) + 2
    order = torch.randperm(num_pages, generator=generator)
    pages_to_slots = lambda pages: (pages[:, None] * page_size + torch.arange(page_size)).flatten()
    shared = pages_to_slots(order[:shared_pages])[:shared_len]
    taken, kv_slots = shared_pages, []
    for spec, n in zip(specs, own):
        mine = pages_to_slots(order[taken : taken + n])
        taken += n
        prefix, extend = spec[-2], spec[-1]
        if len(spec) == 3:
            kv_slots.append(mine[: prefix + extend])
        else:
            kv_slots.append(torch.cat([shared, mine])[: prefix + extend])
    cache = KVCache(KVShape(2, num_kv_heads, head_dim, dtype), num_pages * page_size)
    for layer in range(2):
        cache.k[layer].copy_(torch.randn(cache.k[layer].shape, generator=generator))
        cache.v[layer].copy_(torch.randn(cache.v[layer].shape, generator=generator))
    batch = ForwardBatch.build([[0] * s[-1] for s in specs], [s[-2] for s in specs], kv_slots)
    q, k, v = (
        torch.randn(batch.num_tokens, h, head_dim, generator=generator).to(dtype)
        for h in (num_q_heads, num_kv_heads, num_kv_heads)
    )
    return cache, batch, q, k, v


SHARED = {
    "fork-decode": (64, [(64, 1), (70, 1), (64, 1), (90, 1)]),  # k samples after one prompt
    "few-shot-extend": (64, [(64, 9), (64, 3), (64, 17)]),  # questions after one cached prefix
    "whole-prefix": (48, [(48, 1), (48, 5)]),  # a tail with no private prefix
    "mixed-with-strangers": (64, [(64, 12), (None, 30, 1), (80, 1), (None, 0, 20), (100, 1)]),
}


@pytest.mark.parametrize("layout", list(SHARED))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(4, 4, 64), (6, 2, 64)])
def test_shared_prefix_attention_matches_reference(layout, page_size, num_q_heads, num_kv_heads, head_dim):
    shared_len, specs = SHARED[layout]
    cache, batch, q, k, v = make_shared_case(shared_len, specs, page_size, num_q_heads, num_kv_heads, head_dim)
    backend = TorchAttentionBackend(cache, num_q_heads, num_kv_heads, head_dim, page_size, shared_prefix_min_tokens=32)
    plan = backend.plan(batch)
    members = [i for i, s in enumerate(specs) if len(s) == 2]
    assert [c.prefix.members for c in plan.cascades] == [tuple(members)]
    assert plan.cascades[0].prefix.length == shared_len  # no partial page is ever shared by the tree
    expected = reference(cache, batch, q, k, v, layer=0)
    out = backend.forward(q, k, v, 0, batch, plan)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_shared_prefix_in_bfloat16_reads_consecutive_slots_in_place():
    specs = [(64, 1), (64, 7), (75, 1)]
    cache, _, q, k, v = make_shared_case(64, specs, 1, 6, 2, 64, dtype=torch.bfloat16)
    # Rebuild the batch with the shared prefix in slots 0..63, as a fresh pool allocates them.
    own = iter(range(64, cache.num_slots))
    kv_slots = [torch.cat([torch.arange(64), torch.tensor([next(own) for _ in range(p + e - 64)])]) for p, e in specs]
    batch = ForwardBatch.build([[0] * e for _, e in specs], [p for p, _ in specs], kv_slots)
    backend = TorchAttentionBackend(cache, 6, 2, 64, 1, shared_prefix_min_tokens=32)
    plan = backend.plan(batch)
    assert plan.cascades[0].prefix.contiguous_start == 0
    expected = reference(cache, batch, q, k, v, layer=1)
    out = backend.forward(q, k, v, 1, batch, plan)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_short_shared_prefixes_are_attended_per_sequence():
    cache, batch, q, k, v = make_shared_case(16, [(16, 1), (20, 1)], 1, 4, 4, 64)
    backend = TorchAttentionBackend(cache, 4, 4, 64, 1)
    assert backend.plan(batch).cascades == ()


def make_multi_shared_case(groups, page_size, num_q_heads, num_kv_heads, head_dim, seed):
    """groups: [(shared_len, [(private_prefix_len, extend_len), ...]), ...]; each group's
    sequences start with the same shared slots (whole pages), then pages of their own."""
    generator = torch.Generator().manual_seed(seed)
    pages = lambda n: -(-n // page_size)
    num_pages = sum(pages(shared) + sum(pages(p + e) for p, e in members) for shared, members in groups) + 1
    order = iter(torch.randperm(num_pages, generator=generator).tolist())
    take = lambda n: torch.cat([torch.arange(page_size) + next(order) * page_size for _ in range(pages(n))])[:n]
    kv_slots, specs = [], []
    for shared_len, members in groups:
        shared = take(shared_len)
        for private, extend in members:
            kv_slots.append(torch.cat([shared, take(private + extend)]))
            specs.append((shared_len + private, extend))
    cache = KVCache(KVShape(1, num_kv_heads, head_dim, torch.float32), num_pages * page_size)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=generator))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=generator))
    batch = ForwardBatch.build([[0] * e for _, e in specs], [p for p, _ in specs], kv_slots)
    q, k, v = (
        torch.randn(batch.num_tokens, h, head_dim, generator=generator)
        for h in (num_q_heads, num_kv_heads, num_kv_heads)
    )
    return cache, batch, q, k, v


member = st.tuples(st.integers(0, 40), st.one_of(st.just(1), st.integers(1, 24)))
group = st.tuples(st.integers(1, 6), st.lists(member, min_size=1, max_size=4))


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(group, min_size=1, max_size=3),
    page_size=st.sampled_from([1, 4]),
    heads=st.sampled_from([(4, 4), (6, 2), (8, 1)]),
    seed=st.integers(0, 2**16),
)
def test_any_mix_of_shared_prefixes_matches_reference(groups, page_size, heads, seed):
    """Several shared prefixes in one batch, of any size, mixed decodes and extends."""
    groups = [(pages * page_size * 4, members) for pages, members in groups]
    num_q_heads, num_kv_heads = heads
    cache, batch, q, k, v = make_multi_shared_case(groups, page_size, num_q_heads, num_kv_heads, 64, seed)
    backend = TorchAttentionBackend(cache, num_q_heads, num_kv_heads, 64, page_size, shared_prefix_min_tokens=4)
    plan = backend.plan(batch)
    assert len(plan.cascades) == sum(len(members) > 1 for _, members in groups)
    expected = reference(cache, batch, q, k, v, layer=0)
    torch.testing.assert_close(backend.forward(q, k, v, 0, batch, plan), expected, atol=1e-5, rtol=1e-5)
