"""The CPU KV pool lives in fresh anonymous memory: zero, writable, one buffer per layer and tensor."""

from __future__ import annotations

import torch

from radixrt.memory.kv_cache import KVCache, KVShape


def test_cpu_pool_starts_zero_and_layers_are_independent():
    cache = KVCache(KVShape(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16), num_slots=1000)
    tensors = cache.k + cache.v
    assert all(t.shape == (1000, 2, 8) and t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors)
    assert all(not t.any() for t in tensors)
    slots = torch.tensor([3, 999])
    cache.store(1, slots, torch.ones(2, 2, 8), torch.full((2, 2, 8), 2.0))
    assert torch.equal(cache.k[1][slots], torch.ones(2, 2, 8, dtype=torch.bfloat16))
    assert torch.equal(cache.v[1][slots], torch.full((2, 2, 8), 2.0, dtype=torch.bfloat16))
    assert int(cache.k[1].count_nonzero()) == 32 and int(cache.v[1].count_nonzero()) == 32
    assert all(not t.any() for i, t in enumerate(tensors) if i not in (1, 4))
    other = KVCache(cache.shape, 1000)
    assert not other.k[1].any()
