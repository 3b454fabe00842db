"""Triton kernels for attention over the slot-addressed KV pool.

Three kernels, all reading K/V through explicit slot indices (`kv_indices`), so
the page size never enters them: a page of P slots is just P consecutive
entries of a sequence's slot list.

- `_decode_partial_kernel` (split-K, pass 1): one program per
  (decode sequence, kv head, block of that kv head's q heads, KV split). It
  loads K/V of its kv head once for the whole group of q heads (GQA) and
  writes a partial output normalised within its split plus the split's
  log-sum-exp (base 2).
- `_decode_merge_kernel` (split-K, pass 2): merges the splits of one
  (sequence, q head) by their log-sum-exp and writes the final row.
- `_extend_kernel`: one program per (extend sequence, q head, block of new
  tokens). Phase 1 attends the cached prefix, gathered from the pool by slot,
  with no mask; phase 2 attends the sequence's new tokens, read contiguously
  from this step's K/V, under the causal mask `new key n <= new query j`
  (that is, absolute position n <= prefix_len + j).

A sliding window (extend: `window`; decode: the plan passes only the window's
keys) hides from query j every key more than window - 1 positions before it,
and the loops skip the tiles no row of the block sees. With SOFTCAP, scores
are soft-capped, cap * tanh(score / cap), before the mask (Gemma 2).

Everything accumulates in fp32; inputs may be fp16, bf16 or fp32. Softmax uses
exp2 with the scale pre-multiplied by log2(e), the usual flash-attention trick.
This module imports triton at the top: it is only imported once the triton
backend has been chosen.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
# The merge kernel reads the split axis as one block of this many entries, so
# it compiles once however many splits a step uses.
MAX_KV_SPLITS = 16
# The decode kernels tile the KV length by this many tokens; a split is whole tiles.
DECODE_BLOCK_N = 64
# The extend kernel's window when a layer has none: longer than any sequence.
NO_WINDOW = 1 << 30


@triton.jit
def _online_softmax_step(
    q, k, v, visible, m_i, l_i, acc, qk_scale, cap_log2, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Fold one tile of keys `k` ([D, N]) and values `v` ([N, D]) into the online
    softmax (m_i, l_i, acc) of the query rows `q`; `visible` ([rows or 1, N]) masks
    the scores. The one copy of the flash-attention update, so that the pool tiles
    and the extend kernel's causal new-token tiles cannot drift apart.

    Scores in base 2: dot * qk_scale (sm_scale * log2 e), or with SOFTCAP
    tanh(dot * qk_scale) * cap_log2 (qk_scale = sm_scale / cap, cap_log2 = cap * log2 e).
    A row that has seen no visible key yet (windows) keeps m_i = -inf and adds nothing."""
    qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP:
        qk = (2.0 * tl.sigmoid(2.0 * qk) - 1.0) * cap_log2  # tanh, from the sigmoid triton has everywhere
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_pool_tile(
    q, m_i, l_i, acc, n0, end, first_key,
    K_cache, V_cache, kv_indices, kv_start, kv_head,
    stride_ks, stride_kh, stride_vs, stride_vh,
    offs_d, mask_d, qk_scale, cap_log2,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Fold the pool keys at slot-list positions [n0, min(n0 + BLOCK_N, end)) into
    the online softmax (m_i, l_i, acc) of the query rows `q`; row r sees the keys
    from `first_key[r]` on (decode: all of them; an extend's cached prefix: those
    within the row's window)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    slots = tl.load(kv_indices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
    k = tl.load(
        K_cache + slots[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None],
        mask=mask_n[None, :] & mask_d[:, None],
        other=0.0,
    )
    v = tl.load(
        V_cache + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
        mask=mask_n[:, None] & mask_d[None, :],
        other=0.0,
    )
    visible = mask_n[None, :] & (offs_n[None, :] >= first_key[:, None])
    return _online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, cap_log2, DOT_PRECISION, SOFTCAP)


@triton.jit
def _decode_partial_kernel(
    Q, K_cache, V_cache, kv_indices,
    q_rows, kv_starts, seq_lens,
    Mid_O, Mid_LSE,
    num_splits, qk_scale, cap_log2,
    stride_qt, stride_qh,
    stride_ks, stride_kh, stride_vs, stride_vh,
    stride_mo_n, stride_mo_h, stride_mo_s,
    stride_ml_n, stride_ml_h,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    head_block = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)

    offs_g = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # index inside the group
    mask_h = offs_g < GROUP
    q_heads = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    q_row = tl.load(q_rows + seq).to(tl.int64)  # row * stride can pass 2**31
    kv_start = tl.load(kv_starts + seq)
    seq_len = tl.load(seq_lens + seq)
    # Splits are whole BLOCK_N tiles; trailing splits of a short sequence are
    # empty, write nothing, and the merge kernel skips them by the same formula.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)

    if split_end > split_start:
        q = tl.load(
            Q + q_row * stride_qt + q_heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_h[:, None] & mask_d[None, :],
            other=0.0,
        )
        # The first tile of a non-empty split has a valid key for every row, so
        # m_i is finite after it and exp2(m_i - m_new) never sees -inf - -inf.
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        every_key = tl.zeros([BLOCK_H], dtype=tl.int32)
        for n0 in range(split_start, split_end, BLOCK_N):
            m_i, l_i, acc = _attend_pool_tile(
                q, m_i, l_i, acc, n0, split_end, every_key, K_cache, V_cache, kv_indices, kv_start, kv_head,
                stride_ks, stride_kh, stride_vs, stride_vh, offs_d, mask_d, qk_scale, cap_log2,
                BLOCK_N, DOT_PRECISION, SOFTCAP,
            )
        tl.store(
            Mid_O + seq * stride_mo_n + q_heads[:, None] * stride_mo_h + split * stride_mo_s + offs_d[None, :],
            acc / l_i[:, None],
            mask=mask_h[:, None] & mask_d[None, :],
        )
        tl.store(
            Mid_LSE + seq * stride_ml_n + q_heads * stride_ml_h + split,
            m_i + tl.log2(l_i),
            mask=mask_h,
        )


@triton.jit
def _decode_merge_kernel(
    Mid_O, Mid_LSE, Out,
    q_rows, seq_lens,
    num_splits,
    stride_mo_n, stride_mo_h, stride_mo_s,
    stride_ml_n, stride_ml_h,
    stride_ot, stride_oh,
    BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(q_rows + seq).to(tl.int64)
    seq_len = tl.load(seq_lens + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N

    offs_s = tl.arange(0, BLOCK_S)
    # Empty splits were never written: mask them out instead of reading garbage.
    mask_s = (offs_s < num_splits) & (offs_s * split_len < seq_len)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    lse = tl.load(Mid_LSE + seq * stride_ml_n + head * stride_ml_h + offs_s, mask=mask_s, other=float("-inf"))
    weights = tl.where(mask_s, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    parts = tl.load(
        Mid_O + seq * stride_mo_n + head * stride_mo_h + offs_s[:, None] * stride_mo_s + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(weights[:, None] * parts, 0) / tl.sum(weights, 0)
    tl.store(Out + q_row * stride_ot + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


@triton.jit
def _extend_kernel(
    Q, K_new, V_new, K_cache, V_cache, kv_indices, Out,
    q_starts, extend_lens, prefix_lens, kv_starts,
    qk_scale, cap_log2, window,
    stride_qt, stride_qh,
    stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_ks, stride_kh, stride_vs, stride_vh,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    kv_head = head // GROUP

    extend_len = tl.load(extend_lens + seq)
    if m_block * BLOCK_M < extend_len:
        q_start = tl.load(q_starts + seq).to(tl.int64)  # row * stride can pass 2**31
        prefix_len = tl.load(prefix_lens + seq)
        kv_start = tl.load(kv_starts + seq)

        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < extend_len
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(
            Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # Row j (position prefix_len + j) sees keys from prefix_len + j - window + 1 on.
        first_key = prefix_len + offs_m - window + 1
        block_first_key = prefix_len + m_block * BLOCK_M - window + 1

        # Phase 1: the cached prefix, gathered from the pool, from the first tile the block's first row sees.
        pool_start = tl.maximum(block_first_key, 0) // BLOCK_N * BLOCK_N
        for n0 in range(pool_start, prefix_len, BLOCK_N):
            m_i, l_i, acc = _attend_pool_tile(
                q, m_i, l_i, acc, n0, prefix_len, first_key, K_cache, V_cache, kv_indices, kv_start, kv_head,
                stride_ks, stride_kh, stride_vs, stride_vh, offs_d, mask_d, qk_scale, cap_log2,
                BLOCK_N, DOT_PRECISION, SOFTCAP,
            )

        # Phase 2: this step's new tokens, causal and within the window; keys past
        # this block's last query are never visible, so the loop stops there.
        new_first_key = first_key - prefix_len
        new_start = tl.maximum(block_first_key - prefix_len, 0) // BLOCK_N * BLOCK_N
        new_end = tl.minimum(extend_len, (m_block + 1) * BLOCK_M)
        for n0 in range(new_start, new_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < extend_len
            k = tl.load(
                K_new + (q_start + offs_n)[None, :] * stride_knt + kv_head * stride_knh + offs_d[:, None],
                mask=mask_n[None, :] & mask_d[:, None],
                other=0.0,
            )
            v = tl.load(
                V_new + (q_start + offs_n)[:, None] * stride_vnt + kv_head * stride_vnh + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            )
            causal = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] >= new_first_key[:, None])
            visible = mask_n[None, :] & causal
            m_i, l_i, acc = _online_softmax_step(
                q, k, v, visible, m_i, l_i, acc, qk_scale, cap_log2, DOT_PRECISION, SOFTCAP
            )

        tl.store(
            Out + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
            (acc / l_i[:, None]).to(Out.dtype.element_ty),
            mask=mask_m[:, None] & mask_d[None, :],
        )


def decode_block_h(group: int) -> int:
    """q heads per decode program: tl.dot needs at least 16 rows, so a group
    smaller than that leaves rows idle. That costs compute only; decode is bound
    by reading each kv head's K/V once, which the grouping guarantees."""
    return max(16, min(64, triton.next_power_of_2(group)))


def decode_head_blocks(group: int) -> int:
    """Programs per kv head along the q-head axis (more than one only past 64 q heads per kv head)."""
    return triton.cdiv(group, decode_block_h(group))


# Launch configurations: each kernel's constexprs and launch options, in one place
# so that the ahead-of-time compile test builds exactly what is launched.


def _decode_partial_config(dtype: torch.dtype, head_dim: int, group: int, softcap: bool) -> dict[str, object]:
    return dict(
        GROUP=group, HEAD_BLOCKS=decode_head_blocks(group), BLOCK_H=decode_block_h(group),
        BLOCK_N=DECODE_BLOCK_N, BLOCK_D=triton.next_power_of_2(head_dim), HEAD_DIM=head_dim,
        DOT_PRECISION=_dot_precision(dtype), SOFTCAP=softcap, num_warps=4, num_stages=_num_stages(dtype),
    )


def _decode_merge_config(head_dim: int) -> dict[str, object]:
    return dict(
        BLOCK_N=DECODE_BLOCK_N, BLOCK_S=MAX_KV_SPLITS, BLOCK_D=triton.next_power_of_2(head_dim),
        HEAD_DIM=head_dim, num_warps=4, num_stages=1,
    )


def _extend_config(dtype: torch.dtype, head_dim: int, group: int, softcap: bool) -> dict[str, object]:
    block_d = triton.next_power_of_2(head_dim)
    return dict(
        GROUP=group, BLOCK_M=64, BLOCK_N=64, BLOCK_D=block_d, HEAD_DIM=head_dim, DOT_PRECISION=_dot_precision(dtype),
        SOFTCAP=softcap, num_warps=4 if block_d <= 64 else 8, num_stages=_num_stages(dtype),
    )


def launch_configs(
    dtype: torch.dtype, head_dim: int, group: int, softcap: bool = False
) -> list[tuple[object, dict[str, object]]]:
    """Every kernel launched for one model shape with its launch config, for ahead-of-time compiles."""
    return [
        (_decode_partial_kernel, _decode_partial_config(dtype, head_dim, group, softcap)),
        (_decode_merge_kernel, _decode_merge_config(head_dim)),
        (_extend_kernel, _extend_config(dtype, head_dim, group, softcap)),
    ]


def _score_scales(sm_scale: float, softcap: float | None) -> tuple[float, float]:
    """(qk_scale, cap_log2) of `_online_softmax_step`."""
    if softcap is None:
        return sm_scale * LOG2_E, 0.0
    return sm_scale / softcap, softcap * LOG2_E


def _dot_precision(dtype: torch.dtype) -> str | None:
    """fp32 inputs would silently drop to tf32 on tensor cores: keep them exact.
    Half types take Triton's default (the option only concerns fp32)."""
    return "ieee" if dtype == torch.float32 else None


def _num_stages(dtype: torch.dtype) -> int:
    """fp32 tiles are twice the size: one stage keeps them within the ~100 KB of
    shared memory of consumer GPUs (fp32 is the interpreter's dtype, not a GPU target)."""
    return 1 if dtype == torch.float32 else 2


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    q_rows: torch.Tensor,
    kv_starts: torch.Tensor,
    seq_lens: torch.Tensor,
    mid_out: torch.Tensor,
    mid_lse: torch.Tensor,
    out: torch.Tensor,
    sm_scale: float,
    softcap: float | None = None,
) -> None:
    """Attend one query row per decode sequence; writes rows `q_rows` of `out`.

    q/out: [T, Hq, D]; k_cache/v_cache: [num_slots, Hkv, D]; q_rows, kv_starts,
    seq_lens: [n] (row in q, offset of the sequence's slots in kv_indices, its
    length: with a sliding window, only the window's keys); mid_out [n, Hq, S, D]
    and mid_lse [n, Hq, S] are fp32 scratch whose split count S (<= MAX_KV_SPLITS)
    is the number of splits used. `softcap`: soft-cap the scores (None: no cap).
    """
    num_seqs = q_rows.numel()
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    num_splits = mid_out.shape[2]
    _decode_partial_kernel[(num_seqs, num_kv_heads * decode_head_blocks(group), num_splits)](
        q, k_cache, v_cache, kv_indices,
        q_rows, kv_starts, seq_lens,
        mid_out, mid_lse,
        num_splits, *_score_scales(sm_scale, softcap),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        **_decode_partial_config(q.dtype, head_dim, group, softcap is not None),
    )
    _decode_merge_kernel[(num_seqs, num_q_heads)](
        mid_out, mid_lse, out,
        q_rows, seq_lens,
        num_splits,
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        **_decode_merge_config(head_dim),
    )


def extend_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    q_starts: torch.Tensor,
    extend_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    kv_starts: torch.Tensor,
    max_extend_len: int,
    out: torch.Tensor,
    sm_scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Attend the new tokens of each extend sequence; writes their rows of `out`.

    q/out: [T, Hq, D] and k_new/v_new: [T, Hkv, D] share row numbering (this
    step's new tokens); q_starts, extend_lens, prefix_lens, kv_starts: [n].
    `window`: each query sees only its last `window` keys (None: all);
    `softcap`: soft-cap the scores (None: no cap).
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    config = _extend_config(q.dtype, head_dim, num_q_heads // k_cache.shape[1], softcap is not None)
    _extend_kernel[(q_starts.numel(), num_q_heads, triton.cdiv(max_extend_len, config["BLOCK_M"]))](
        q, k_new, v_new, k_cache, v_cache, kv_indices, out,
        q_starts, extend_lens, prefix_lens, kv_starts,
        *_score_scales(sm_scale, softcap), NO_WINDOW if window is None else window,
        q.stride(0), q.stride(1),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1),
        **config,
    )
