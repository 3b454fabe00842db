"""Sliding-window attention and soft-capped scores in the torch backend, against explicit attention.

Every path of `TorchAttentionBackend` with a `LayerAttention`: a lone prefill
(SDPA's causal flag is no longer enough past the window), padded extend and
decode groups, the C decode kernel (bf16), and the shared-prefix split, which
is kept only where no member's window cuts into the shared keys. The
reference is a per-sequence loop over fp32 scores with transformers' window
rule (a query at position i sees keys i - window + 1 .. i). Tolerances: 1e-4
(fp32), 2e-2 (bf16) absolute on outputs of unit-scale values.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from radixrt.kernels import cpu
from radixrt.kernels.base import LayerAttention
from radixrt.kernels.forward_batch import ForwardBatch
from radixrt.kernels.torch_backend import TorchAttentionBackend, _PagedDecode
from radixrt.memory.kv_cache import KVCache, KVShape
from radixrt.model.config import ModelConfig

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 64
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
ATTENTIONS = {
    "full": LayerAttention(),
    "window-8": LayerAttention(sliding_window=8),
    "window-1": LayerAttention(sliding_window=1),
    "window-13-scale-softcap": LayerAttention(sliding_window=13, scale=0.2, logit_softcap=5.0),
    "softcap": LayerAttention(logit_softcap=3.0),
}
# (prefix_len, extend_len) per sequence, and how many leading cached slots all sequences share
BATCHES = {
    "prefill": ([(0, 30)], 0),
    "short-prefill": ([(0, 5)], 0),
    "decode": ([(20, 1)], 0),
    "decodes": ([(20, 1), (3, 1), (40, 1)], 0),
    "mixed": ([(20, 1), (3, 7), (40, 12), (0, 20), (0, 3)], 0),
    "shared-past-window": ([(10, 2), (10, 1), (12, 3)], 10),
    "shared-within-window": ([(6, 2), (6, 1), (6, 1)], 6),
    "shared-long": ([(30, 2), (30, 1)], 30),
}


def reference(q: torch.Tensor, cache: KVCache, batch: ForwardBatch, attention: LayerAttention) -> torch.Tensor:
    outs = []
    scale = attention.scale or HEAD_DIM**-0.5
    group = NUM_Q_HEADS // NUM_KV_HEADS
    for i in range(batch.num_seqs):
        prefix, extend = batch.prefix_lens[i], batch.extend_lens[i]
        slots = batch.kv_indices[batch.kv_offsets[i] : batch.kv_offsets[i + 1]]
        keys = cache.k[0][slots].float().repeat_interleave(group, 1)
        values = cache.v[0][slots].float().repeat_interleave(group, 1)
        queries = q[batch.qo_offsets[i] : batch.qo_offsets[i + 1]].float()
        scores = torch.einsum("thd,lhd->htl", queries, keys) * scale
        if attention.logit_softcap is not None:
            scores = torch.tanh(scores / attention.logit_softcap) * attention.logit_softcap
        position = torch.arange(prefix, prefix + extend)[:, None]
        key = torch.arange(prefix + extend)[None]
        visible = key <= position
        if attention.sliding_window is not None:
            visible &= key > position - attention.sliding_window
        outs.append(torch.einsum("htl,lhd->thd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values))
    return torch.cat(outs)


def run(dtype: torch.dtype, specs: list[tuple[int, int]], shared: int, attention: LayerAttention):
    generator = torch.Generator().manual_seed(0)
    num_slots = 1024
    cache = KVCache(KVShape(1, NUM_KV_HEADS, HEAD_DIM, dtype), num_slots, "cpu")
    cache.k[0].copy_(torch.randn(num_slots, NUM_KV_HEADS, HEAD_DIM, generator=generator))
    cache.v[0].copy_(torch.randn(num_slots, NUM_KV_HEADS, HEAD_DIM, generator=generator))
    free = torch.randperm(num_slots, generator=generator)  # scattered slots, as pages of 1
    common, used, slots = free[:shared], shared, []
    for prefix, extend in specs:
        own = free[used : used + prefix + extend - shared]
        used += own.numel()
        slots.append(torch.cat([common, own]))
    batch = ForwardBatch.build([[1] * extend for _, extend in specs], [p for p, _ in specs], slots)
    q, k, v = (torch.randn(batch.num_tokens, heads, HEAD_DIM, generator=generator).to(dtype)
               for heads in (NUM_Q_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))  # fmt: skip
    backend = TorchAttentionBackend(cache, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, shared_prefix_min_tokens=4)
    plan = backend.plan(batch, attention)
    out = backend.forward(q, k, v, 0, batch, plan)
    return out, reference(q, cache, batch, attention), plan


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attention", list(ATTENTIONS))
@pytest.mark.parametrize("batch", list(BATCHES))
def test_torch_backend_matches_explicit_attention(dtype, attention, batch):
    specs, shared = BATCHES[batch]
    out, expected, _ = run(dtype, specs, shared, ATTENTIONS[attention])
    assert (out.float() - expected).abs().max().item() <= TOLERANCE[dtype]


def test_shared_prefix_is_split_only_where_every_window_covers_it():
    window = LayerAttention(sliding_window=8)
    assert len(run(torch.float32, *BATCHES["shared-within-window"], window)[2].cascades) == 1
    assert run(torch.float32, *BATCHES["shared-past-window"], window)[2].cascades == ()
    assert len(run(torch.float32, *BATCHES["shared-past-window"], LayerAttention())[2].cascades) == 1


@pytest.mark.skipif(cpu.decode_attention() is None, reason="no C compiler for the CPU kernels")
def test_c_decode_kernel_reads_only_the_window():
    """A bf16 decode goes through the C kernel, given each sequence's last `window` keys."""
    plan = run(torch.bfloat16, *BATCHES["decodes"], LayerAttention(sliding_window=8))[2]
    (paged,) = [group for group in plan.groups if isinstance(group, _PagedDecode)]
    assert paged.kv_lens.tolist() == [8, 4, 8]
    # soft-capped scores have no C kernel: SDPA-free explicit attention instead
    capped = run(torch.bfloat16, *BATCHES["decodes"], LayerAttention(logit_softcap=5.0))[2]
    assert not any(isinstance(group, _PagedDecode) for group in capped.groups)


def test_per_layer_windows_from_layer_types():
    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    qwen2 = transformers.Qwen2Config(**shape, num_hidden_layers=4, use_sliding_window=True, sliding_window=16,
                                     max_window_layers=2)  # fmt: skip
    config = ModelConfig.from_hf(qwen2)
    assert [config.layer_window(i) for i in range(4)] == [None, None, 16, 16]
    assert config.context_len == qwen2.max_position_embeddings  # a window no longer caps the context
    mistral = ModelConfig.from_hf(transformers.MistralConfig(**shape, num_hidden_layers=2, sliding_window=16))
    assert [mistral.layer_window(i) for i in range(2)] == [16, 16]
    without = ModelConfig.from_hf(transformers.Qwen2Config(**shape, num_hidden_layers=2, sliding_window=16))
    assert without.sliding_window is None and without.layer_window(1) is None
