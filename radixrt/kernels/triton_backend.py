"""Attention backend on our own Triton kernels: the GPU path when FlashInfer is missing.

`plan()` splits the step's sequences into decode sequences (one new token) and
extend sequences (more than one) and uploads a few int32 arrays per kind once;
every layer's `forward()` then stores the new K/V and launches the split-K
decode kernels and the extend kernel over the same output tensor (each writes
only its own rows). The kernels live in `triton_attention`, imported when this
backend is constructed, so importing this module needs no triton.

A layer's `LayerAttention` shapes the plan: with a sliding window each
sequence's slot list starts at its first new token's window (a decode reads
only its last `window` keys; the extend kernel masks the rest per row), and
the scale and score cap go to the kernels.

Under `TRITON_INTERPRET=1` the same code runs on CPU tensors (fp32/fp16; the
interpreter mishandles bf16), which is how the kernels are tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from radixrt.kernels.base import FULL_ATTENTION, AttentionBackend, LayerAttention
from radixrt.kernels.forward_batch import ForwardBatch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class DecodePlan:
    """Decode sequences of one step and the split-K scratch shared by every layer."""

    q_rows: torch.Tensor  # [n] int32, row of the sequence's token in q
    kv_starts: torch.Tensor  # [n] int32, offset of its slots in batch.kv_indices
    seq_lens: torch.Tensor  # [n] int32
    mid_out: torch.Tensor  # [n, Hq, num_splits, D] fp32
    mid_lse: torch.Tensor  # [n, Hq, num_splits] fp32


@dataclass(frozen=True)
class ExtendPlan:
    """Extend sequences of one step; rows of a sequence are q_starts .. q_starts + extend_lens."""

    q_starts: torch.Tensor  # [n] int32
    extend_lens: torch.Tensor  # [n] int32
    prefix_lens: torch.Tensor  # [n] int32
    kv_starts: torch.Tensor  # [n] int32
    max_extend_len: int


@dataclass(frozen=True)
class TritonPlan:
    decode: DecodePlan | None
    extend: ExtendPlan | None
    attention: LayerAttention


class TritonAttentionBackend(AttentionBackend["TritonPlan"]):
    """Split-K paged decode and prefix-aware extend, in Triton.

    Ownership: a plan is valid for the batch it was built from and only while
    that batch's slots stay allocated; its scratch buffers are reused by every
    layer of the step, so layers must run one after another on one stream.
    """

    name = "triton"

    def _setup(self) -> None:
        if not 16 <= self.head_dim <= 256:
            raise ValueError(f"head_dim must be in [16, 256] (tl.dot needs 16), got {self.head_dim}")
        self._require_kv_dtype(SUPPORTED_DTYPES)
        try:
            from radixrt.kernels import triton_attention
        except ImportError as error:
            raise ImportError("the triton attention backend needs the `triton` package") from error
        self._kernels = triton_attention
        self._target_programs = 2 * _num_compute_units(self.kv_cache.device)

    def plan(self, batch: ForwardBatch, attention: LayerAttention = FULL_ATTENTION) -> TritonPlan:
        decode_ids, extend_ids = batch.decode_and_extend_ids()
        # keys older than each sequence's first new token's window are skipped: slot lists start later
        dropped = [attention.first_visible_key(prefix) for prefix in batch.prefix_lens]
        return TritonPlan(
            decode=self._plan_decode(batch, decode_ids, dropped) if decode_ids else None,
            extend=self._plan_extend(batch, extend_ids, dropped) if extend_ids else None,
            attention=attention,
        )

    def _plan_decode(self, batch: ForwardBatch, ids: Sequence[int], dropped: Sequence[int]) -> DecodePlan:
        qo_indptr, kv_indptr = batch.qo_offsets, batch.kv_offsets
        seq_lens = [batch.seq_lens[i] - dropped[i] for i in ids]
        kv_starts = [kv_indptr[i] + dropped[i] for i in ids]
        rows = _int32_rows([[qo_indptr[i] for i in ids], kv_starts, seq_lens], self.kv_cache.device)
        num_splits = self._num_splits(len(ids), max(seq_lens))
        device = self.kv_cache.device
        return DecodePlan(
            q_rows=rows[0],
            kv_starts=rows[1],
            seq_lens=rows[2],
            mid_out=torch.empty(
                (len(ids), self.num_q_heads, num_splits, self.head_dim), dtype=torch.float32, device=device
            ),
            mid_lse=torch.empty((len(ids), self.num_q_heads, num_splits), dtype=torch.float32, device=device),
        )

    def _num_splits(self, num_seqs: int, max_seq_len: int) -> int:
        """Split the KV length until the GPU has about two programs per SM.

        Few long sequences need many splits to fill the machine; a large batch
        needs none. Never more splits than tiles, nor than the merge kernel reads.
        """
        group = self.num_q_heads // self.num_kv_heads
        programs = num_seqs * self.num_kv_heads * self._kernels.decode_head_blocks(group)
        wanted = -(-self._target_programs // programs)
        tiles = -(-max_seq_len // self._kernels.DECODE_BLOCK_N)
        return max(1, min(wanted, tiles, self._kernels.MAX_KV_SPLITS))

    def _plan_extend(self, batch: ForwardBatch, ids: Sequence[int], dropped: Sequence[int]) -> ExtendPlan:
        qo_indptr, kv_indptr = batch.qo_offsets, batch.kv_offsets
        extend_lens = [batch.extend_lens[i] for i in ids]
        prefix_lens = [batch.prefix_lens[i] - dropped[i] for i in ids]
        rows = _int32_rows(
            [[qo_indptr[i] for i in ids], extend_lens, prefix_lens, [kv_indptr[i] + dropped[i] for i in ids]],
            self.kv_cache.device,
        )
        return ExtendPlan(
            q_starts=rows[0],
            extend_lens=rows[1],
            prefix_lens=rows[2],
            kv_starts=rows[3],
            max_extend_len=max(extend_lens),
        )

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch, plan: TritonPlan
    ) -> torch.Tensor:
        dtype = self.kv_cache.shape.dtype
        # The kernels read the new tokens' K/V straight from k/v (phase 2 of the
        # extend kernel): cast as the pool stored them, they hold the same values.
        k = _last_dim_contiguous(k.to(dtype))
        v = _last_dim_contiguous(v.to(dtype))
        q_in = _last_dim_contiguous(q.to(dtype))
        k_cache, v_cache = self.kv_cache.k[layer], self.kv_cache.v[layer]
        out = torch.empty(q_in.shape, dtype=dtype, device=q_in.device)
        scale, softcap = self.softmax_scale(plan.attention), plan.attention.logit_softcap
        if plan.decode is not None:
            d = plan.decode
            self._kernels.decode_attention(
                q_in, k_cache, v_cache, batch.kv_indices,
                d.q_rows, d.kv_starts, d.seq_lens, d.mid_out, d.mid_lse,
                out, scale, softcap,
            )
        if plan.extend is not None:
            e = plan.extend
            self._kernels.extend_attention(
                q_in, k, v, k_cache, v_cache, batch.kv_indices,
                e.q_starts, e.extend_lens, e.prefix_lens, e.kv_starts, e.max_extend_len,
                out, scale, plan.attention.sliding_window, softcap,
            )
        return out if out.dtype == q.dtype else out.to(q.dtype)


def _int32_rows(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """One host-to-device copy for all of a plan's small index arrays."""
    return torch.tensor(rows, dtype=torch.int32).to(device, non_blocking=True)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels take row and head strides but assume the head_dim stride is 1."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _num_compute_units(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: few splits keep it quick while still exercising the merge
