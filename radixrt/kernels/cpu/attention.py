"""Attention over the paged KV pool (decode_attention.c) and the store of a step's new K/V rows (kv_store.c)."""

from __future__ import annotations

import ctypes

import torch

from radixrt.kernels.cpu.library import MAX_GROUP, MAX_HEAD_DIM, bind, call_threads


class DecodeAttention:
    """`radixrt_decode_attention_bf16` with its argument types, over torch tensors."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = library.radixrt_decode_attention_bf16
        pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._fn.argtypes = [
            pointer, i64, pointer,  # q, q_row_stride, rows
            pointer, pointer,  # k_pool, v_pool
            pointer, pointer, pointer,  # kv_indices, kv_starts, kv_lens
            i32, i32, i32, i32, ctypes.c_float, i32,  # num_seqs, Hq, Hkv, D, scale, num_threads
            pointer, pointer,  # out, lse
        ]
        self._fn.restype = i32
        self._segments_fn = library.radixrt_segment_attention
        self._segments_fn.argtypes = [
            pointer, i64, pointer, pointer, pointer,  # q, q_row_stride, k_pool, v_pool, kv_indices
            i32, pointer, pointer, pointer, pointer,  # segments: count, starts, lens, row_ptr, rows
            i32, i32, i32, ctypes.c_float, ctypes.c_float,  # Hq, Hkv, D, scale, softcap (0: none)
            i32, pointer, pointer,  # num_threads, out, lse
            i32,  # 1: q, pools and out float32; 0: bf16
        ]
        self._segments_fn.restype = i32
        # Keys per piece of a segment's reduction (`kernels.segments.aligned_attention_segments`)
        self.chunk = int(library.radixrt_attention_chunk())

    def segments(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_indices: torch.Tensor,
        segments: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], out: torch.Tensor,
        lse: torch.Tensor | None, scale: float, softcap: float | None = None,
    ) -> None:
        """Attention of query rows over segments (starts, lens, row_ptr, rows: `kernels.segments`),
        layouts as in `__call__`: each listed row of `out` (and `lse`) written once. q, the pools
        and out may also all be float32 (`supports_segments`). `softcap`: scores become
        softcap * tanh(score / softcap) before the softmax (None: not capped)."""
        starts, lens, row_ptr, rows = segments
        status = self._segments_fn(
            q.data_ptr(), q.stride(0), k_pool.data_ptr(), v_pool.data_ptr(), kv_indices.data_ptr(),
            starts.numel(), starts.data_ptr(), lens.data_ptr(), row_ptr.data_ptr(), rows.data_ptr(),
            q.shape[1], k_pool.shape[1], q.shape[2], scale, softcap or 0.0, call_threads(), out.data_ptr(),
            0 if lse is None else lse.data_ptr(), int(q.dtype == torch.float32),
        )  # fmt: skip
        self._check(status, q, k_pool)

    def _check(self, status: int, q: torch.Tensor, k_pool: torch.Tensor) -> None:
        if status == -1:
            raise ValueError(f"decode attention kernel refused shapes q {tuple(q.shape)}, pool {tuple(k_pool.shape)}")
        if status:
            raise MemoryError("decode attention kernel could not allocate its partial results")

    def __call__(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_starts: torch.Tensor,
        kv_lens: torch.Tensor,
        rows: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        scale: float,
    ) -> None:
        """Attention of the query rows `q[rows[s]]` ([*, Hq, D] bf16, head stride D) over the
        pool slots `kv_indices[kv_starts[s]:][:kv_lens[s]]`, written to `out[rows[s]]`
        ([*, Hq, D] bf16, contiguous) and, if given, natural-log `lse[rows[s]]` ([*, Hq] fp32).

        Index tensors are int64 and contiguous; the caller keeps every tensor alive and checks
        shapes (`supports`): the kernel trusts them.
        """
        num_q_heads, head_dim = q.shape[1], q.shape[2]
        status = self._fn(
            q.data_ptr(), q.stride(0), rows.data_ptr(),
            k_pool.data_ptr(), v_pool.data_ptr(),
            kv_indices.data_ptr(), kv_starts.data_ptr(), kv_lens.data_ptr(),
            kv_starts.numel(), num_q_heads, k_pool.shape[1], head_dim, scale, call_threads(),
            out.data_ptr(), 0 if lse is None else lse.data_ptr(),
        )  # fmt: skip
        self._check(status, q, k_pool)


def supports(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel handles this attention shape and KV dtype."""
    return dtype == torch.bfloat16 and supports_segments(num_q_heads, num_kv_heads, head_dim, dtype)


def supports_segments(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether `DecodeAttention.segments` handles this shape and dtype: bf16, or float32 too
    (deterministic mode's; float32 attention stays on SDPA otherwise)."""
    group = num_q_heads // num_kv_heads
    return dtype in (torch.bfloat16, torch.float32) and group <= MAX_GROUP and head_dim <= MAX_HEAD_DIM


class KVStore:
    """`radixrt_store_kv_bf16`: K and V rows ([T, H, D] bf16, each row's heads contiguous) into
    pool slots ([slots, H, D] bf16, contiguous)."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = library.radixrt_store_kv_bf16
        pointer, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn.argtypes = [pointer, i64, pointer, i64, i64, i64, pointer, i64, pointer, pointer]
        self._fn.restype = ctypes.c_int

    @staticmethod
    def takes(rows: torch.Tensor, slots: torch.Tensor) -> bool:
        """Whether these K or V rows and slots are laid out as the kernel reads them."""
        return (rows.dtype == torch.bfloat16 and rows.stride(2) == 1 and rows.stride(1) == rows.shape[2]
                and slots.dtype == torch.int64 and slots.is_contiguous())

    def __call__(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_pool: torch.Tensor,
                 v_pool: torch.Tensor) -> None:
        """Pools [num_slots, H, D], contiguous; raises IndexError (nothing written) for a slot outside them."""
        status = self._fn(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k.shape[0], k.shape[1] * k.shape[2],
                          slots.data_ptr(), k_pool.shape[0], k_pool.data_ptr(), v_pool.data_ptr())
        if status:
            raise IndexError(f"a K/V slot is outside the pool of {k_pool.shape[0]} slots")


def kv_store() -> KVStore | None:
    """The compiled K/V store; None where the kernels cannot be built."""
    return bind(KVStore)


def decode_attention() -> DecodeAttention | None:
    """The compiled decode-attention kernel; None where it cannot be built."""
    return bind(DecodeAttention)
