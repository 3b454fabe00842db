"""Attention backend on FlashInfer's paged wrappers: the fast GPU path.

API targeted: flashinfer-python 0.7.2.post1 (the newest on PyPI when written),
read from its wheel's `flashinfer/prefill.py` and `flashinfer/decode.py`:

- `BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout="NHD")`,
  `.plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
  num_qo_heads, num_kv_heads, head_dim_qk, page_size, *, causal, pos_encoding_mode,
  sm_scale, q_data_type, kv_data_type, ...)`, `.run(q, (k_cache, v_cache))`.
  With `causal=True` a query row j of a request with qo_len new and kv_len total
  tokens sees kv positions <= j + kv_len - qo_len (prefill.cuh aligns the mask
  bottom-right): exactly our causal mask offset by the prefix length.
- `BatchDecodeWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout="NHD",
  use_tensor_cores=...)`, `.plan(indptr, indices, last_page_len, num_qo_heads,
  num_kv_heads, head_dim, page_size, *, pos_encoding_mode, sm_scale,
  q_data_type, kv_data_type, ...)` (options after page_size are keyword-only in
  0.7: passing them positionally is deprecated), `.run(q, (k_cache, v_cache))`.

A sliding window and a score cap are the wrappers' `window_left` (the keys
before the query it also sees: window - 1) and `logits_soft_cap` plan options;
`sm_scale` takes the layer's scale. The wrappers keep their plan, so each
distinct `LayerAttention` of a model gets its own pair of wrappers (made on
first use); they share the workspace halves, which only hold scratch while a
wrapper runs, and the layers of a step run one after another.

The pool is FlashInfer's "NHD" paged layout already: `k[layer]` viewed as
[num_pages, page_size, H, D]. A sequence's page list is every page_size-th
entry of its slot list divided by page_size (the engine hands out whole pages
in order), and its last page holds seq_len - (num_pages - 1) * page_size tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from radixrt.kernels import DEFAULT_SHARED_PREFIX_MIN_TOKENS
from radixrt.kernels.base import FULL_ATTENTION, AttentionBackend, LayerAttention
from radixrt.kernels.forward_batch import ForwardBatch
from radixrt.memory.kv_cache import KVCache

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
DEFAULT_WORKSPACE_BYTES = 256 * 1024 * 1024
# The CUDA-core decode kernel is compiled for group sizes 1, 2, 3, 4, 6, 8, 16
# only (DISPATCH_GQA_GROUP_SIZE); the tensor-core path takes any group and is
# the faster one from a group of 4 on (SGLang uses the same threshold).
TENSOR_CORE_DECODE_MIN_GROUP = 4


@dataclass(frozen=True)
class PageTable:
    """FlashInfer's CSR page table for a subset of a batch's sequences.

    indptr and last_page_len stay on the host: plan() reads them there to
    schedule work and copies them to the device itself, so handing it device
    tensors would only add a device-to-host sync per step.
    """

    indptr: torch.Tensor  # [n + 1] int32, host
    indices: torch.Tensor  # [indptr[-1]] int32, device: page ids
    last_page_len: torch.Tensor  # [n] int32, host, in 1 .. page_size


def build_page_table(batch: ForwardBatch, seq_ids: Sequence[int], page_size: int) -> PageTable:
    """Page table of the sequences `seq_ids` of `batch` (their slots are whole pages in order)."""
    kv_indptr = batch.kv_offsets
    num_pages = [-(-batch.seq_lens[i] // page_size) for i in seq_ids]
    indptr = torch.zeros(len(seq_ids) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(num_pages, dtype=torch.int32).cumsum(0)
    last_page_len = torch.tensor(
        [batch.seq_lens[i] - (n - 1) * page_size for i, n in zip(seq_ids, num_pages)], dtype=torch.int32
    )
    # Position in kv_indices of the first slot of every page.
    first_slot = torch.cat(
        [kv_indptr[i] + torch.arange(n, dtype=torch.int64) * page_size for i, n in zip(seq_ids, num_pages)]
    )
    indices = (batch.kv_indices[first_slot.to(batch.kv_indices.device)] // page_size).to(torch.int32)
    return PageTable(indptr=indptr, indices=indices, last_page_len=last_page_len)


@dataclass(frozen=True)
class FlashInferPlan:
    """Which rows of q go to which wrapper; None when that wrapper takes every row
    (a pure prefill or pure decode step needs no gather). The wrappers themselves
    hold the rest of the plan."""

    extend_rows: torch.Tensor | None
    decode_rows: torch.Tensor | None
    has_extend: bool
    has_decode: bool
    attention: LayerAttention


class FlashInferAttentionBackend(AttentionBackend["FlashInferPlan"]):
    """Paged prefill wrapper for extend sequences, paged decode wrapper for decode ones.

    Ownership: the wrappers keep the latest plan internally, so a plan object is
    valid only until the next `plan()` call for the same `LayerAttention`; the
    runner plans once per step (per `LayerAttention`) and runs every layer of
    that step before planning the next.
    """

    name = "flashinfer"

    def __init__(
        self,
        kv_cache: KVCache,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int = 1,
        *,
        shared_prefix_min_tokens: int = DEFAULT_SHARED_PREFIX_MIN_TOKENS,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    ):
        super().__init__(
            kv_cache, num_q_heads, num_kv_heads, head_dim, page_size, shared_prefix_min_tokens=shared_prefix_min_tokens
        )
        self._require_kv_dtype(SUPPORTED_DTYPES)
        try:
            import flashinfer
        except ImportError as error:
            raise ImportError("the flashinfer attention backend needs the `flashinfer-python` package") from error
        if workspace_bytes < 2 * 1024 * 1024 or workspace_bytes % 32:
            raise ValueError(f"workspace_bytes must be >= 2 MiB and a multiple of 32, got {workspace_bytes}")
        self.dtype = kv_cache.shape.dtype
        self.num_pages = kv_cache.num_slots // page_size
        # One allocation, split in two: each wrapper keeps split-K partial results
        # in its own half, so the two never share scratch even within a step.
        # Zeroed because the decode wrapper asks for a zeroed buffer on first use.
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=kv_cache.device)
        self._flashinfer = flashinfer
        self._wrappers: dict[LayerAttention, tuple[Any, Any]] = {}

    def _wrappers_for(self, attention: LayerAttention) -> tuple[Any, Any]:
        """The (prefill, decode) wrappers that plan and run layers attending as `attention`."""
        if attention not in self._wrappers:
            half = self._workspace.numel() // 2
            prefill = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace[:half], "NHD")
            decode = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace[half:],
                "NHD",
                use_tensor_cores=self.num_q_heads // self.num_kv_heads >= TENSOR_CORE_DECODE_MIN_GROUP,
            )
            self._wrappers[attention] = (prefill, decode)
        return self._wrappers[attention]

    def plan(self, batch: ForwardBatch, attention: LayerAttention = FULL_ATTENTION) -> FlashInferPlan:
        decode_ids, extend_ids = batch.decode_and_extend_ids()
        mixed = bool(decode_ids) and bool(extend_ids)
        prefill, decode = self._wrappers_for(attention)
        window_left = -1 if attention.sliding_window is None else attention.sliding_window - 1
        options = {"pos_encoding_mode": "NONE", "sm_scale": self.softmax_scale(attention), "window_left": window_left,
                   "logits_soft_cap": attention.logit_softcap, "q_data_type": self.dtype, "kv_data_type": self.dtype}
        if extend_ids:
            table = build_page_table(batch, extend_ids, self.page_size)
            qo_indptr = torch.zeros(len(extend_ids) + 1, dtype=torch.int32)
            qo_indptr[1:] = torch.tensor([batch.extend_lens[i] for i in extend_ids], dtype=torch.int32).cumsum(0)
            prefill.plan(
                qo_indptr, table.indptr, table.indices, table.last_page_len,
                self.num_q_heads, self.num_kv_heads, self.head_dim, self.page_size, causal=True, **options,
            )
        if decode_ids:
            table = build_page_table(batch, decode_ids, self.page_size)
            decode.plan(
                table.indptr, table.indices, table.last_page_len,
                self.num_q_heads, self.num_kv_heads, self.head_dim, self.page_size, **options,
            )
        return FlashInferPlan(
            extend_rows=batch.token_rows(extend_ids, batch.kv_indices.device) if mixed else None,
            decode_rows=batch.token_rows(decode_ids, batch.kv_indices.device) if mixed else None,
            has_extend=bool(extend_ids),
            has_decode=bool(decode_ids),
            attention=attention,
        )

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch, plan: FlashInferPlan
    ) -> torch.Tensor:
        usable = self.num_pages * self.page_size
        paged_kv = (
            self.kv_cache.k[layer][:usable].view(self.num_pages, self.page_size, self.num_kv_heads, self.head_dim),
            self.kv_cache.v[layer][:usable].view(self.num_pages, self.page_size, self.num_kv_heads, self.head_dim),
        )
        q_in = q.to(self.dtype).contiguous()
        prefill, decode = self._wrappers[plan.attention]
        if not plan.has_decode:
            out = prefill.run(q_in, paged_kv)
        elif not plan.has_extend:
            out = decode.run(q_in, paged_kv)
        else:
            out = torch.empty_like(q_in)
            out[plan.extend_rows] = prefill.run(q_in[plan.extend_rows], paged_kv)
            out[plan.decode_rows] = decode.run(q_in[plan.decode_rows], paged_kv)
        return out if out.dtype == q.dtype else out.to(q.dtype)

