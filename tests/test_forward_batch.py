"""ForwardBatch.build against a per-sequence reference, and the inputs it refuses."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.kernels.forward_batch import ForwardBatch


@settings(max_examples=50, deadline=None)
@given(specs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 6)), min_size=1, max_size=6),
       seed=st.integers(0, 1000))  # fmt: skip
def test_a_batch_lays_out_every_sequence_in_order(specs, seed):
    generator = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 100, (e,), generator=generator).tolist() for _, e in specs]
    slots = [torch.randperm(200, generator=generator)[: p + e] for p, e in specs]
    batch = ForwardBatch.build(ids, [p for p, _ in specs], slots)
    assert batch.input_ids.tolist() == [t for seq in ids for t in seq]
    assert batch.positions.tolist() == [q for p, e in specs for q in range(p, p + e)]
    assert batch.out_slots.tolist() == [s for (p, _), seq in zip(specs, slots) for s in seq[p:].tolist()]
    assert batch.kv_indices.tolist() == [s for seq in slots for s in seq.tolist()]
    qo, kv = [0], [0]
    for p, e in specs:
        qo.append(qo[-1] + e)
        kv.append(kv[-1] + p + e)
    assert batch.qo_offsets == tuple(qo) and batch.kv_offsets == tuple(kv)
    assert all(t.dtype == torch.int64 for t in (batch.input_ids, batch.positions, batch.last_token_rows))
    assert batch.last_token_rows.tolist() == [q - 1 for q in qo[1:]]


def test_malformed_batches_are_refused_by_name():
    with pytest.raises(ValueError, match="one entry per sequence"):
        ForwardBatch.build([[1]], [0, 0], [torch.arange(1)])
    with pytest.raises(ValueError, match="sequence 0 has no new tokens"):
        ForwardBatch.build([[]], [0], [torch.arange(0)])
    with pytest.raises(ValueError, match=r"sequence 1: kv_slots has 2 entries, expected prefix 2 \+ new 1"):
        ForwardBatch.build([[1], [2]], [0, 2], [torch.arange(1), torch.arange(2)])


def test_a_pool_on_cuda_matches_a_model_on_the_current_cuda_device(monkeypatch):
    from radixrt.model.runner import _same_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert _same_device(torch.device("cuda"), torch.device("cuda:0"))
    assert not _same_device(torch.device("cuda"), torch.device("cuda:1"))
    assert not _same_device(torch.device("cpu"), torch.device("cuda:0"))
    assert _same_device(torch.device("cpu"), torch.device("cpu"))
