"""Reference attention over the paged KV pool with `scaled_dot_product_attention`.

The correctness reference for the GPU backends and the CPU path. `plan()`
sorts the batch's sequences into a few padded groups and builds every index
and mask once; each layer then does, per group, one gather of K/V from the
pool and one SDPA call:

    decode group   all sequences with one new token: q [B, Hkv, G, D] (the G
                   query heads sharing a KV head stand in for G query rows, so
                   K/V are never repeated), K/V [B, Hkv, Lmax, D], mask: key < len
    extend groups  sequences with several new tokens, packed while padding
                   wastes at most half the work: q [B, Hq, Lq, D], K/V
                   [B, Hkv, Lkv, D] (SDPA's enable_gqa), mask: key <= prefix + row;
                   a lone sequence without a prefix uses is_causal instead

Padding slots point at the sequence's first slot and are masked out; padded
query rows are computed and dropped. Slots are whatever `kv_indices` says, so
any `page_size` works.

With a bf16 pool on a CPU where `radixrt.kernels.cpu` could build its C
kernel, decode sequences skip the gather, the padding and SDPA: the kernel
reads each sequence's keys in place (a `_PagedDecode` instead of a decode
group). fp32 keeps SDPA: it is the dtype our exactness tests compare.

Deterministic steps (`plan_segments`) send every row to the C kernel as
segments cut at whole chunks (`kernels.segments.aligned_attention_segments`):
no padding, no SDPA, each row's keys reduced in the same pieces whatever the
batch holds.

Sequences that share a cached prefix of at least `shared_prefix_min_tokens` slots
(a few-shot batch, the branches of a fork) are split in two (see
`shared_prefix`): all their queries attend the shared prefix in one call, the
groups above attend only the keys after it and also return log-sum-exps, and
the two halves are merged.

A sliding window (`LayerAttention.sliding_window`) drops each sequence's keys
older than its first new token's window before grouping (a decode then reads
exactly its last `window` keys, through SDPA or the C kernel alike) and adds
`key > query - window` to the extend masks. A shared prefix is split out only
when every member's queries see all of it; otherwise its members attend alone.
Soft-capped scores (Gemma 2) have no SDPA: every group of `plan` then takes
the explicit-scores path of `attention_with_lse`, with its masks made explicit;
deterministic steps' segments go to the C kernel, which caps each chunk's
scores before its softmax.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from radixrt.kernels import cpu
from radixrt.kernels.base import FULL_ATTENTION, AttentionBackend, LayerAttention
from radixrt.kernels.forward_batch import ForwardBatch
from radixrt.kernels.segments import AttentionSegments
from radixrt.kernels.shared_prefix import (
    SharedPrefix,
    attention_with_lse,
    find_shared_prefixes,
    fold_heads,
    merge,
    prefix_keys,
    repeat_mask_rows,
    unfold_heads,
)

# An extend group grows while its padded size stays within this factor of its real size.
_MAX_PADDING_FACTOR = 2.0


@dataclass(frozen=True)
class _Group:
    """One padded SDPA call: `num_seqs` sequences, `q_len` x `kv_len` after padding."""

    num_seqs: int
    q_len: int
    kv_len: int
    with_lse: bool  # the keys after a shared prefix: the result is merged later
    kv_slots: torch.Tensor  # [num_seqs * kv_len] pool slots, padded
    mask: torch.Tensor | None  # additive, broadcastable to the scores (rows folded when with_lse); None: causal
    q_rows: torch.Tensor | None  # [num_seqs * q_len] rows of the batch's new tokens; None: all, in order
    valid: torch.Tensor | None  # [num real tokens] positions in the padded rows; None: no padding
    out_rows: torch.Tensor | None  # [num real tokens] where the group's output rows go; None: all, in order

    @property
    def is_decode(self) -> bool:
        return self.q_len == 1  # an extend group's sequences have two or more new tokens


@dataclass(frozen=True)
class _PagedDecode:
    """Decode sequences for the C kernel: each one's keys are kv_indices[kv_starts[i]:][:kv_lens[i]]."""

    with_lse: bool
    kv_starts: torch.Tensor  # [num_seqs] int64
    kv_lens: torch.Tensor  # [num_seqs] int64
    q_rows: torch.Tensor  # [num_seqs] int64, each sequence's row in the batch's new tokens (and in the output)
    whole_batch: bool  # the batch's only sequences, in row order

    @property
    def out_rows(self) -> torch.Tensor:
        return self.q_rows


@dataclass(frozen=True)
class _Cascade:
    """A shared prefix and the batch rows (its members' new tokens) that attend it."""

    prefix: SharedPrefix
    rows: torch.Tensor


@dataclass(frozen=True)
class TorchAttentionPlan:
    groups: tuple[_Group | _PagedDecode, ...]
    cascades: tuple[_Cascade, ...]
    attention: LayerAttention
    segments: AttentionSegments | None = None  # set by plan_segments: the C kernel attends every row


class TorchAttentionBackend(AttentionBackend[TorchAttentionPlan]):
    name = "torch"

    def _setup(self) -> None:
        shape = self.kv_cache.shape
        heads = (self.num_q_heads, self.num_kv_heads, self.head_dim, shape.dtype)
        on_cpu = self.kv_cache.device.type == "cpu"
        # deterministic steps' attention; the default path's decodes use it in bf16 only
        self._segment_kernel = cpu.decode_attention() if on_cpu and cpu.supports_segments(*heads) else None
        self._decode_kernel = self._segment_kernel if cpu.supports(*heads) else None

    # The C kernel reads the pool in bf16 (decodes of the default path, whole steps); segments
    # (deterministic steps) in bf16 or float32.
    @property
    def reads_pool_in_place(self) -> bool:
        return self._decode_kernel is not None

    @property
    def attends_segments(self) -> bool:
        return self._segment_kernel is not None

    @property
    def attention_chunk(self) -> int:
        if self._segment_kernel is None:
            return super().attention_chunk
        return self._segment_kernel.chunk

    def plan_segments(self, segments: AttentionSegments, attention: LayerAttention = FULL_ATTENTION) -> TorchAttentionPlan:
        """Every row through the C kernel (windows and score caps included)."""
        if self._segment_kernel is None:
            raise ValueError("segment plans need the C attention kernel (attends_segments)")
        return TorchAttentionPlan((), (), attention, segments)

    def plan(self, batch: ForwardBatch, attention: LayerAttention = FULL_ATTENTION) -> TorchAttentionPlan:
        device = self.kv_cache.device
        kv_starts = batch.kv_offsets[:-1]
        q_starts = batch.qo_offsets[:-1]
        seqs = list(zip(range(batch.num_seqs), batch.prefix_lens, batch.extend_lens, kv_starts, q_starts))
        shared = []
        if len(seqs) > 1:
            shared = find_shared_prefixes(batch.kv_indices, kv_starts, batch.prefix_lens, self.shared_prefix_min_tokens)
        window = attention.sliding_window
        if window is not None:  # split only where no member's window cuts into the shared keys
            seq_lens = batch.seq_lens
            shared = [prefix for prefix in shared if all(seq_lens[i] <= window for i in prefix.members)]
        skip = {i: prefix.length for prefix in shared for i in prefix.members}
        plain = [_in_window(s, attention) for s in seqs if s[0] not in skip]
        # After a shared prefix of length L, a sequence is a shorter one: prefix p - L, slots from L on.
        tails = [(i, p - skip[i], e, kv + skip[i], q) for i, p, e, kv, q in seqs if i in skip]
        groups = self._groups(plain, batch, False, attention) + self._groups(tails, batch, True, attention)
        cascades = tuple(_Cascade(prefix, batch.token_rows(prefix.members, device)) for prefix in shared)
        return TorchAttentionPlan(tuple(groups), cascades, attention)

    def _groups(
        self, seqs: list["_Seq"], batch: ForwardBatch, with_lse: bool, attention: LayerAttention
    ) -> list[_Group | _PagedDecode]:
        device, dtype = self.kv_cache.device, self.kv_cache.shape.dtype
        window = attention.sliding_window
        # Explicit masks and rows, for `_partial`: merged later, or scores soft-capped.
        explicit = with_lse or attention.logit_softcap is not None
        decode_kernel = None if attention.logit_softcap is not None else self._decode_kernel
        decode = [s for s in seqs if s[2] == 1]
        extend = sorted((s for s in seqs if s[2] > 1), key=lambda s: (s[1] + s[2], s[2]), reverse=True)
        groups = [_extend_group(members, batch, device, dtype, with_lse, explicit, window)
                  for members in _pack(extend)]  # fmt: skip
        if decode and decode_kernel is None:
            groups.insert(0, _decode_group(decode, batch, device, dtype, with_lse, explicit))
        if explicit:  # their queries are folded (see _partial): fold the masks' rows once, here
            group_size = self.num_q_heads // self.num_kv_heads
            groups = [_fold_mask_rows(g, group_size) for g in groups]
        if decode and decode_kernel is not None:
            whole_batch = len(decode) == batch.num_seqs and not with_lse
            return [_paged_decode(decode, with_lse, whole_batch), *groups]
        return list(groups)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        plan: TorchAttentionPlan,
    ) -> torch.Tensor:
        k_pool, v_pool = self.kv_cache.k[layer], self.kv_cache.v[layer]
        scale, softcap = self.softmax_scale(plan.attention), plan.attention.logit_softcap
        if plan.segments is not None:
            return self._attend_segments(q, k_pool, v_pool, batch, plan.segments, scale, softcap)
        first = plan.groups[0]
        out = None if first.out_rows is None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if plan.cascades:
            tail_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            tail_lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        for group in plan.groups:
            if isinstance(group, _PagedDecode):
                assert self._decode_kernel is not None
                if q.stride(2) != 1 or q.stride(1) != self.head_dim:
                    q = q.contiguous()
                target, lse = (tail_out, tail_lse) if group.with_lse else (out, None)
                assert target is not None
                self._decode_kernel(q, k_pool, v_pool, batch.kv_indices, group.kv_starts, group.kv_lens,
                                    group.q_rows, target, lse, scale)
                if group.whole_batch:
                    return target
                continue
            k_group = k_pool.index_select(0, group.kv_slots).view(group.num_seqs, group.kv_len, self.num_kv_heads, -1)
            v_group = v_pool.index_select(0, group.kv_slots).view(group.num_seqs, group.kv_len, self.num_kv_heads, -1)
            k_group, v_group = k_group.transpose(1, 2), v_group.transpose(1, 2)
            if group.with_lse or softcap is not None:
                assert group.out_rows is not None and out is not None
                rows, lse = self._partial(q, k_group, v_group, group, scale, softcap)
                if group.with_lse:
                    tail_out.index_copy_(0, group.out_rows, rows)
                    tail_lse.index_copy_(0, group.out_rows, lse)
                else:
                    out.index_copy_(0, group.out_rows, rows)
                continue
            attend = self._decode if group.is_decode else self._extend
            rows = attend(q, k_group, v_group, group, scale)
            if out is None or group.out_rows is None:  # the only group, covering every row in order
                return rows
            out.index_copy_(0, group.out_rows, rows)
        assert out is not None
        for cascade in plan.cascades:
            prefix_out, prefix_lse = self._shared_prefix(q, k_pool, v_pool, cascade, scale, softcap)
            rows = cascade.rows
            out.index_copy_(0, rows, merge(prefix_out, prefix_lse, tail_out[rows], tail_lse[rows]))
        return out

    def _attend_segments(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: ForwardBatch,
        segments: AttentionSegments, scale: float, softcap: float | None,
    ) -> torch.Tensor:
        """Every row through the C kernel, its keys as `segments` list them, scores capped by `softcap`."""
        assert self._segment_kernel is not None
        if q.stride(2) != 1 or q.stride(1) != self.head_dim:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        tensors = (segments.starts, segments.lens, segments.row_ptr, segments.rows)
        self._segment_kernel.segments(q, k_pool, v_pool, batch.kv_indices, tensors, out, None, scale, softcap)
        return out

    def _shared_prefix(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        cascade: _Cascade,
        scale: float,
        softcap: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All of a cascade's query rows against its shared prefix, in one call: [R, Hq, D], [R, Hq]."""
        q_rows = fold_heads(q.index_select(0, cascade.rows).unsqueeze(0), self.num_kv_heads)
        keys, values = prefix_keys(k_pool, cascade.prefix), prefix_keys(v_pool, cascade.prefix)
        out, lse = attention_with_lse(q_rows, keys, values, None, scale, softcap)
        return unfold_heads(out, lse, q_len=cascade.rows.numel())

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: _Group, scale: float) -> torch.Tensor:
        q_group = q if group.q_rows is None else q.index_select(0, group.q_rows)
        num_seqs = group.num_seqs
        q_group = q_group.view(num_seqs, self.num_kv_heads, -1, self.head_dim)
        out = F.scaled_dot_product_attention(q_group, k, v, attn_mask=group.mask, scale=scale)
        return out.reshape(num_seqs, self.num_q_heads, self.head_dim)

    def _extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: _Group, scale: float) -> torch.Tensor:
        q_group = q if group.q_rows is None else q.index_select(0, group.q_rows)
        q_group = q_group.view(group.num_seqs, group.q_len, self.num_q_heads, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q_group, k, v, attn_mask=group.mask, is_causal=group.mask is None, scale=scale, enable_gqa=True
        )
        out = out.transpose(1, 2).reshape(-1, self.num_q_heads, self.head_dim)
        return out if group.valid is None else out.index_select(0, group.valid)

    def _partial(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: _Group, scale: float, softcap: float | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over a group's keys with each row's log-sum-exp: [T, Hq, D], [T, Hq]."""
        assert group.q_rows is not None and group.mask is not None
        q_group = q.index_select(0, group.q_rows).view(group.num_seqs, group.q_len, self.num_q_heads, self.head_dim)
        out, lse = attention_with_lse(fold_heads(q_group, self.num_kv_heads), k, v, group.mask, scale, softcap)
        out, lse = unfold_heads(out, lse, group.q_len)
        if group.valid is None:
            return out, lse
        return out.index_select(0, group.valid), lse.index_select(0, group.valid)


_Seq = tuple[int, int, int, int, int]  # (index, prefix_len, extend_len, kv_start, q_start)


def _in_window(seq: _Seq, attention: LayerAttention) -> _Seq:
    """The sequence without the keys older than its first new token's window (none dropped
    without a window): a prefix shortened by d, slots from d on."""
    index, prefix, extend, kv_start, q_start = seq
    dropped = attention.first_visible_key(prefix)
    return index, prefix - dropped, extend, kv_start + dropped, q_start


def _pack(extend: list[_Seq]) -> list[list[_Seq]]:
    """Greedy packing of extend sequences (sorted longest first) into padded groups."""
    groups: list[list[_Seq]] = []
    for seq in extend:
        if groups:
            members = groups[-1] + [seq]
            q_len = max(s[2] for s in members)
            kv_len = max(s[1] + s[2] for s in members)
            real = sum(s[2] * (s[1] + s[2]) for s in members)
            if len(members) * q_len * kv_len <= _MAX_PADDING_FACTOR * real:
                groups[-1] = members
                continue
        groups.append([seq])
    return groups


def _padded_slots(members: list[_Seq], kv_len: int, batch: ForwardBatch, device: torch.device) -> torch.Tensor:
    """[len(members) * kv_len] slots; past a sequence's end, its first slot (masked anyway)."""
    starts = torch.tensor([s[3] for s in members], device=device)
    lens = torch.tensor([s[1] + s[2] for s in members], device=device)
    offsets = torch.arange(kv_len, device=device)
    offsets = torch.where(offsets[None, :] < lens[:, None], offsets[None, :], 0)
    return batch.kv_indices.to(device)[(starts[:, None] + offsets).reshape(-1)]


def _paged_decode(members: list[_Seq], with_lse: bool, whole_batch: bool) -> _PagedDecode:
    columns = list(zip(*members))  # index, prefix_len, extend_len, kv_start, q_start
    return _PagedDecode(
        with_lse=with_lse,
        kv_starts=torch.tensor(columns[3], dtype=torch.int64),
        kv_lens=torch.tensor(columns[1], dtype=torch.int64) + 1,
        q_rows=torch.tensor(columns[4], dtype=torch.int64),
        whole_batch=whole_batch,
    )


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _visible(keys: torch.Tensor, limit: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (key <= limit, the query's own position) and, with a window, key > limit - window."""
    allowed = keys <= limit
    return allowed if window is None else allowed & (keys > limit - window)


def _fold_mask_rows(group: _Group, group_size: int) -> _Group:
    """The group with its mask as [B, 1, q_len * G, kv_len], for queries folded by `fold_heads`."""
    assert group.mask is not None
    mask = group.mask.reshape(group.num_seqs, 1, group.q_len, group.kv_len)
    return replace(group, mask=repeat_mask_rows(mask, group_size))


def _decode_group(
    members: list[_Seq], batch: ForwardBatch, device: torch.device, dtype: torch.dtype, with_lse: bool, explicit: bool
) -> _Group:
    """Decodes (their window, if any, already applied by `_in_window`); `explicit`: a mask and
    rows even where SDPA would need none."""
    seq_lens = [s[1] + 1 for s in members]
    kv_len = max(seq_lens)
    mask = None
    if explicit or min(seq_lens) < kv_len:
        allowed = torch.arange(kv_len, device=device)[None, :] < torch.tensor(seq_lens, device=device)[:, None]
        mask = _additive(allowed[:, None, None, :], dtype)
    # With only decodes in the batch, its rows are exactly the group's rows, in order.
    whole_batch = len(members) == batch.num_seqs and not explicit
    rows = None if whole_batch else torch.tensor([s[4] for s in members], device=device)
    slots = _padded_slots(members, kv_len, batch, device)
    return _Group(len(members), 1, kv_len, with_lse, slots, mask, rows, None, rows)


def _extend_group(
    members: list[_Seq],
    batch: ForwardBatch,
    device: torch.device,
    dtype: torch.dtype,
    with_lse: bool,
    explicit: bool,
    window: int | None,
) -> _Group:
    """Extends (their keys before the window dropped by `_in_window`); `explicit`: a mask and
    rows even where SDPA would need none."""
    q_len = max(s[2] for s in members)
    kv_len = max(s[1] + s[2] for s in members)
    slots = _padded_slots(members, kv_len, batch, device)
    if len(members) == 1:
        index, prefix, extend, _, q_start = members[0]
        whole_batch = batch.num_seqs == 1 and not explicit
        rows = None if whole_batch else torch.arange(q_start, q_start + extend, device=device)
        if prefix == 0 and not explicit and (window is None or extend <= window):
            mask = None
        else:
            limit = torch.arange(extend, device=device)[:, None] + prefix  # [extend, 1]: last visible key
            mask = _additive(_visible(torch.arange(kv_len, device=device)[None, :], limit, window), dtype)
        return _Group(1, q_len, kv_len, with_lse, slots, mask, rows, None, rows)
    prefix_lens = torch.tensor([s[1] for s in members], device=device)
    extend_lens = torch.tensor([s[2] for s in members], device=device)
    q_starts = torch.tensor([s[4] for s in members], device=device)
    row_offsets = torch.arange(q_len, device=device)
    is_real_row = row_offsets[None, :] < extend_lens[:, None]  # [B, q_len]
    # Padded query rows read the sequence's first new token and are dropped afterwards.
    q_rows = q_starts[:, None] + torch.where(is_real_row, row_offsets[None, :], 0)
    key_positions = torch.arange(kv_len, device=device)
    limit = prefix_lens[:, None] + row_offsets[None, :]  # [B, q_len]: last visible key
    allowed = _visible(key_positions[None, None, :], limit[:, :, None], window) & (
        key_positions[None, None, :] < (prefix_lens + extend_lens)[:, None, None]
    )
    q_rows = q_rows.reshape(-1)
    valid = is_real_row.reshape(-1).nonzero().squeeze(1)
    return _Group(
        num_seqs=len(members),
        q_len=q_len,
        kv_len=kv_len,
        with_lse=with_lse,
        kv_slots=slots,
        mask=_additive(allowed[:, None], dtype),
        q_rows=q_rows,
        valid=valid,
        out_rows=q_rows.index_select(0, valid),
    )
