"""Passes over rows: the bf16 RMSNorm (rms_norm.c) and the sampler's passes over logits rows
(row_stats.c, sample_rows.c)."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from radixrt.kernels.cpu.library import bind, call_threads


class RMSNorm:
    """`radixrt_rms_norm_bf16` over torch tensors."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = library.radixrt_rms_norm_bf16
        pointer, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn.argtypes = [pointer, pointer, pointer, pointer, i64, i64, ctypes.c_float, ctypes.c_int]
        self._fn.restype = None

    def __call__(
        self, hidden: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """RMSNorm of `hidden`'s rows ([T, dim] bf16, contiguous) by `weight`; with `residual`
        (same shape), `hidden += residual` first, in place, and the sum is normalized."""
        if not (hidden.is_contiguous() and (residual is None or residual.is_contiguous())):
            raise ValueError("rms_norm needs contiguous rows: it adds the residual in place")
        out = torch.empty_like(hidden)
        self._fn(
            hidden.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
            hidden.shape[0], hidden.shape[1], eps, call_threads(),
        )  # fmt: skip
        return out


class RowStats:
    """`radixrt_row_stats`: each row's first argmax, its value, and the log-sum-exp, for sampling."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = library.radixrt_row_stats
        pointer, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn.argtypes = [pointer, i64, i64, i64, pointer, pointer, pointer, ctypes.c_int]
        self._fn.restype = None

    @staticmethod
    def takes(logits: torch.Tensor) -> bool:
        """Whether the kernel reads these logits: float32 rows on the CPU, unit stride, not overlapping."""
        return (logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2
                and logits.stride(1) == 1 and logits.stride(0) >= logits.shape[1])

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(argmax [B] int64: the first index of each row's largest value, that value [B] float32,
        log-sum-exp [B] float32) of float32 logits [B, V] (`takes`). Rows without a finite value
        have no meaningful result."""
        rows, cols = logits.shape
        argmax = torch.empty(rows, dtype=torch.int64)
        stats = torch.empty(2, rows, dtype=torch.float32)  # the maxima and log-sum-exps, one allocation
        self._fn(logits.data_ptr(), rows, cols, logits.stride(0), argmax.data_ptr(), stats[0].data_ptr(),
                 stats[1].data_ptr(), call_threads())  # fmt: skip
        return argmax, stats[0], stats[1]


class TokenMasks:
    """`radixrt_mask_rows`: the tokens a bitmask does not allow become -inf in logits rows."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = library.radixrt_mask_rows
        pointer, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn.argtypes = [pointer, i64, pointer, i64, i64, pointer, i64]
        self._fn.restype = None

    takes = staticmethod(RowStats.takes)

    def __call__(self, logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> None:
        """In place, row rows[i] ([N] int64, contiguous) of float32 logits [B, V] (`takes`) keeps
        the tokens allowed[i] ([N, words] int32, contiguous, words * 32 >= V) allows."""
        if (allowed.dtype != torch.int32 or not allowed.is_contiguous() or allowed.shape[0] != rows.shape[0]
                or allowed.shape[1] * 32 < logits.shape[1]):  # fmt: skip
            raise ValueError(f"allowed must be [{rows.shape[0]}, >= {(logits.shape[1] + 31) // 32}] int32 and "
                             f"contiguous, got {tuple(allowed.shape)} {allowed.dtype}")
        self._fn(logits.data_ptr(), rows.shape[0], rows.data_ptr(), logits.shape[1], logits.stride(0),
                 allowed.data_ptr(), allowed.shape[1])


class RowSampler:
    """`radixrt_sample_rows`: inverse-CDF draws from softmax(row / T) after each row's top-k,
    top-p and min-p filters."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = library.radixrt_sample_rows
        pointer, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn.argtypes = [pointer, i64, pointer, i64, i64, pointer, pointer, pointer, pointer, pointer, pointer,
                             pointer, ctypes.c_int]
        self._fn.restype = ctypes.c_int

    takes = staticmethod(RowStats.takes)

    def __call__(self, logits: torch.Tensor, rows: torch.Tensor, maxima: torch.Tensor, temperatures: Sequence[float],
                 top_k: Sequence[int], top_p: Sequence[float], min_p: Sequence[float], uniforms: Sequence[float],
                 tokens: torch.Tensor) -> None:
        """Writes tokens[r] ([B] int64, contiguous) for each row r of `rows` ([N] int64, contiguous) of
        float32 logits [B, V] (`takes`): `maxima` [B] float32 each row's largest logit; per sampled
        row, a temperature > 0, filters as in `SamplingParams` (none: top_k <= 1 or >= V, top_p >= 1,
        min_p 0) and a uniform in (0, 1). The other rows' tokens are left as they are."""
        num_rows = rows.shape[0]
        floats = torch.tensor([*temperatures, *top_p, *min_p], dtype=torch.float32)
        ks = torch.tensor(top_k, dtype=torch.int64)
        uniform = torch.tensor(uniforms, dtype=torch.float64)
        maxima = maxima.contiguous()
        status = self._fn(logits.data_ptr(), num_rows, rows.data_ptr(), logits.shape[1], logits.stride(0),
                          maxima.data_ptr(), floats.data_ptr(), ks.data_ptr(), floats[num_rows:].data_ptr(),
                          floats[2 * num_rows :].data_ptr(), uniform.data_ptr(), tokens.data_ptr(), call_threads())
        if status:
            raise MemoryError("row sampling kernel could not allocate its block sums")


def rms_norm() -> RMSNorm | None:
    """The compiled bf16 RMSNorm; None where it cannot be built."""
    return bind(RMSNorm)


@functools.cache  # the sampler asks at every step
def row_stats() -> RowStats | None:
    """The compiled argmax and log-sum-exp of logits rows; None where the kernels cannot be built."""
    return bind(RowStats)


@functools.cache  # the sampler asks at every step
def token_masks() -> TokenMasks | None:
    """The compiled token masking of logits rows; None where the kernels cannot be built."""
    return bind(TokenMasks)


@functools.cache  # the sampler asks at every step
def row_sampler() -> RowSampler | None:
    """The compiled sampling of logits rows; None where the kernels cannot be built."""
    return bind(RowSampler)
