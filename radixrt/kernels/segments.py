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

The kernel reduces a segment's keys in chunks of `ATTENTION_CHUNK` from the
segment's start and merges a row's partial results in segment order, so
where the segments start decides the order of a row's float additions. Here
that order depends on the batch: the shared prefix's length, how much of a
prompt was cached or came in an earlier chunk. `aligned_attention_segments`
plans the same attention so that it does not: every row's keys in the same
pieces, in the same order, whatever else the step holds (`docs/determinism.md`).
"""

from __future__ import annotations

from collections.abc import Sequence
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
    kv_starts = batch.kv_offsets[:-1]
    q_starts = batch.qo_offsets[:-1]
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
    return _as_tensors(starts, lens, rows)


def aligned_attention_segments(
    batch: ForwardBatch, shared_prefix_min_tokens: int, chunk: int, sliding_window: int | None = None
) -> AttentionSegments:
    """Causal attention of every new token of `batch`, each row's keys cut at whole `chunk`s.

    A token at position p attends keys [lo, p], lo = 0 (or p - sliding_window + 1
    with a window): cut at the multiples of `chunk`, that is a partial first
    piece up to the next multiple when lo is not one, whole chunks
    [k * chunk, (k + 1) * chunk), and the rest up to p. Each piece is a segment
    no longer than the kernel's chunk (so it is reduced as one piece), listed in
    key order (so it is merged in that order), and its arithmetic depends on
    the row's own position and keys alone. A whole chunk inside a prefix
    several sequences share is one segment for all their rows that see it,
    read once, as in `attention_segments`.
    """
    kv_starts = batch.kv_offsets[:-1]
    q_starts = batch.qo_offsets[:-1]
    shared_chunks = shared_chunk_owners(batch.kv_indices, kv_starts, batch.prefix_lens, shared_prefix_min_tokens,
                                        chunk)
    # (chunk index, start in kv_indices, length) -> rows; dicts keep the order segments were first met
    segments: dict[tuple[int, int, int], list[int]] = {}
    for i, (prefix_len, extend_len) in enumerate(zip(batch.prefix_lens, batch.extend_lens)):
        owner, num_shared = shared_chunks[i]
        row0 = q_starts[i] - prefix_len  # the row of position p is row0 + p
        for k in range((prefix_len + extend_len) // chunk):
            # positions that see all of chunk k: from its last key on, and (window) while its first is in sight
            first = max(prefix_len, (k + 1) * chunk - 1)
            last = prefix_len + extend_len
            if sliding_window is not None:
                last = min(last, k * chunk + sliding_window)
            if first < last:
                start = kv_starts[owner if k < num_shared else i] + k * chunk
                segments.setdefault((k, start, chunk), []).extend(range(row0 + first, row0 + last))
        for p in range(prefix_len, prefix_len + extend_len):
            lo = 0 if sliding_window is None else max(0, p + 1 - sliding_window)
            head_end = min(p + 1, -(-lo // chunk) * chunk)  # lo up to the next whole chunk (or p)
            if lo < head_end:
                segments.setdefault((lo // chunk, kv_starts[i] + lo, head_end - lo), []).append(row0 + p)
            tail = (p + 1) // chunk * chunk
            if tail >= head_end and tail < p + 1:
                segments.setdefault((tail // chunk, kv_starts[i] + tail, p + 1 - tail), []).append(row0 + p)
    ordered = sorted(segments.items(), key=lambda item: item[0][0])  # stable: key order within every row
    return _as_tensors([start for (_, start, _), _ in ordered], [length for (_, _, length), _ in ordered],
                       [segment_rows for _, segment_rows in ordered])


def shared_chunk_owners(kv_indices: torch.Tensor, kv_starts: Sequence[int], prefix_lens: Sequence[int],
                        shared_prefix_min_tokens: int, chunk: int) -> list[tuple[int, int]]:
    """Per sequence, the first member of its group sharing a prefix of slots (itself if none) and
    how many whole `chunk`s of keys that prefix holds (0 if none): whose rows read a shared
    chunk once for the whole group."""
    owners = [(i, 0) for i in range(len(prefix_lens))]
    if len(prefix_lens) > 1:
        for prefix in find_shared_prefixes(kv_indices, kv_starts, prefix_lens, shared_prefix_min_tokens):
            for member in prefix.members:
                owners[member] = (prefix.members[0], prefix.length // chunk)
    return owners


def _as_tensors(starts: list[int], lens: list[int], rows: list[list[int]]) -> AttentionSegments:
    """Segments from Python lists, as views of one int64 tensor (one allocation a step, not four)."""
    row_ptr = [0]
    for segment_rows in rows:
        row_ptr.append(row_ptr[-1] + len(segment_rows))
    flat = torch.tensor(starts + lens + row_ptr + [row for segment_rows in rows for row in segment_rows],
                        dtype=torch.int64)
    count = len(starts)  # slices, not Tensor.split: its Python wrapper costs several microseconds a step
    return AttentionSegments(starts=flat[:count], lens=flat[count : 2 * count],
                             row_ptr=flat[2 * count : 3 * count + 1], rows=flat[3 * count + 1 :])
