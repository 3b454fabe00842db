"""A step's attention as segments: runs of pool slots and the query rows that see all of each.

The C kernels (`kernels/cpu/kernels.h`) attend this form without masks or
padding: each new token's keys are the union of the segments that list its
row, merged by log-sum-exp. For a batch of few new tokens:

    shared prefix    the slots several sequences share (`find_shared_prefixes`),
                     once, for all their new tokens: read once, not per sequence
    own keys         each sequence's cached slots after that, for all its new
                     tokens; a decode's own new slot joins this run, so a plain
                     decode is one segment of its whole sequence
    new keys         an extend's new token j sees new tokens 0..j: one short
                     segment per extend row
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixrt.kernels.forward_batch import ForwardBatch
from radixrt.kernels.shared_prefix import find_shared_prefixes


@dataclass(frozen=True)
class AttentionSegments:
    """Segment s: slots `kv_indices[starts[s]:][:lens[s]]`, query rows `rows[row_ptr[s]:row_ptr[s + 1]]`."""

    starts: torch.Tensor  # [S] int64
    lens: torch.Tensor  # [S] int64, each >= 1
    row_ptr: torch.Tensor  # [S + 1] int64
    rows: torch.Tensor  # [row_ptr[-1]] int64

    @property
    def num_segments(self) -> int:
        return int(self.starts.numel())


def attention_segments(batch: ForwardBatch, shared_prefix_min_tokens: int) -> AttentionSegments:
    """Full causal attention of every new token of `batch` (no sliding window) as segments."""
    kv_starts = batch.kv_indptr[:-1].tolist()
    q_starts = batch.qo_indptr[:-1].tolist()
    shared = []
    if batch.num_seqs > 1:
        shared = find_shared_prefixes(batch.kv_indices, kv_starts, batch.prefix_lens, shared_prefix_min_tokens)
    starts: list[int] = []
    lens: list[int] = []
    rows: list[list[int]] = []

    def add(start: int, length: int, segment_rows: list[int]) -> None:
        if length > 0:
            starts.append(start)
            lens.append(length)
            rows.append(segment_rows)

    def new_rows(i: int) -> list[int]:
        return list(range(q_starts[i], q_starts[i] + batch.extend_lens[i]))

    skip = {}
    for prefix in shared:
        add(kv_starts[prefix.members[0]], prefix.length, [row for i in prefix.members for row in new_rows(i)])
        skip.update(dict.fromkeys(prefix.members, prefix.length))
    for i, (prefix_len, extend_len) in enumerate(zip(batch.prefix_lens, batch.extend_lens)):
        own = skip.get(i, 0)
        if extend_len == 1:
            add(kv_starts[i] + own, prefix_len - own + 1, new_rows(i))
            continue
        add(kv_starts[i] + own, prefix_len - own, new_rows(i))
        for j, row in enumerate(new_rows(i)):
            add(kv_starts[i] + prefix_len, j + 1, [row])
    row_ptr = [0]
    for segment_rows in rows:
        row_ptr.append(row_ptr[-1] + len(segment_rows))
    return AttentionSegments(
        starts=torch.tensor(starts, dtype=torch.int64),
        lens=torch.tensor(lens, dtype=torch.int64),
        row_ptr=torch.tensor(row_ptr, dtype=torch.int64),
        rows=torch.tensor([row for segment_rows in rows for row in segment_rows], dtype=torch.int64),
    )
