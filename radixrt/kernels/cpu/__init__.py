"""C kernels for the CPU path, compiled on first use by the machine's C compiler.

A decode step is hundreds of small ops; where torch's CPU kernels spend more
on setup than on arithmetic at those sizes, a plain C loop does the job:

    decode_attention.c  torch's CPU attention is built for long query blocks:
                        for one query per sequence its flash kernel spends
                        most of its time on per-block setup, and the padded
                        gather in front of it copies every key once more per
                        layer. Here each key and value is read once, in
                        place, for all the query heads that share it.
    pack_gguf.c         GGUF Q4_0/Q4_1 rows into quantized_matmul.c's layout in one
                        pass over the file's blocks, at load.
    rms_norm.c          torch's bf16 rms_norm is about eight ops; here one
                        pass, with the residual add fused in.
    quantized_matmul.c  torch's 4-bit CPU matmul dequantizes to float32 and
                        works one row at a time: 8 rows cost 8 times 1.
                        Here the codes feed bf16 dot products directly and
                        are decoded once for several rows (one version
                        per instruction set, plain C the reference).
    kv_store.c          a step's new K and V rows into their pool slots in one
                        call, instead of two indexed assignments a layer.
    row_stats.c         each logits row's argmax and log-sum-exp in two
                        vectorized passes, for the sampler (torch's index
                        reduction does not vectorize, its logsumexp is
                        several ops).
    sample_rows.c       a token drawn from a row's temperature-scaled softmax
                        after its top-k/top-p/min-p filters, in a few passes,
                        instead of torch's ~10 ops a row and, for a wide
                        nucleus, a full sort.
    packed_matrix.c     a weight whose rows come in parts of different formats
                        (a fused projection, llama.cpp's mixes) as one matrix
                        of tiles: the products below take any format.
    int4_layer.c        a quantized Llama layer's work around attention (norms,
                        projections, RoPE, SwiGLU, residuals) in two calls
                        instead of about thirty ops, for decode-sized steps.
    decode_stack.c      a whole step of a Llama-family model (biases, q/k
                        norms, partial rotary, windows, soft-caps, Gemma's
                        norms), token ids to logits, for a few new tokens in
                        one call: threads forked once a step, not once an op,
                        and no Python in between.
    decode_run.c        several decode steps of a steady batch in one call,
                        each sampling the tokens the next one reads: no
                        engine and no Python between the steps at all.
    rowwise_matmul.c    a dense matmul whose every output is reduced in one
                        fixed order whatever the batch: library GEMMs change
                        a row's rounding with the number of rows (deterministic
                        mode; one version per instruction set).

The sources are compiled together once per instruction-set level (`build.py`:
portable C, AVX2, AVX-512), cached under `cache_root()/kernels`, and the best
build the CPU runs is loaded with ctypes (no torch headers), capped by
RADIXRT_CPU_ISA; `isa()` names it. Without a C compiler, or if building fails,
the accessors return None and callers keep torch's path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from radixrt.kernels.cpu import build
from radixrt.kernels.cpu.stack_model import (
    FORMAT_Q4_1,
    FORMAT_Q8_0,
    FORMATS,
    LayerExtras,
    LayerWeights,
    ModelExtras,
    PackedMatrix,
    STACK_MAX_PLANS,
    STACK_MAX_ROPES,
    PackedPart,
    SegmentList,
    StackModel,
    StackWeights,
    TileBytes,
    fill_matrix,
)
from radixrt.sampling.run_data import RunMasks, RunPenalties, RunSampling

logger = logging.getLogger(__name__)

# Shapes the kernel's fixed-size buffers hold (MAX_GROUP, MAX_HEAD_DIM in the source).
MAX_GROUP = 16
MAX_HEAD_DIM = 256

# A decode run's call back between steps (`RunMasks.advance`): nonzero ends the run.
_ADVANCE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)
_lock = threading.Lock()
_library: list[ctypes.CDLL | None] = []  # empty until the first accessor call, then [library or None]
_calling_thread = threading.local()  # .threads: the `kernel_threads` override of this thread's calls


class kernel_threads:
    """Run the kernels this thread calls inside the block on `count` threads (None: torch's
    count, the default), whatever torch's own thread count is meanwhile.

    A decode step's torch ops are too small to gain from a second thread and pay its wake-up
    instead, while the C kernels (one parallel region for a whole step, spin barriers inside)
    gain from every core: the model runner sets the two counts apart. (A class, not a
    generator: entered at every step, where a generator's context manager costs several
    times as much.)
    """

    def __init__(self, count: int | None):
        self._count = count
        self._previous: int | None = None

    def __enter__(self) -> None:
        self._previous = getattr(_calling_thread, "threads", None)
        _calling_thread.threads = self._count

    def __exit__(self, *exc_info: object) -> None:
        _calling_thread.threads = self._previous


def _threads() -> int:
    return getattr(_calling_thread, "threads", None) or torch.get_num_threads()


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
            i32, i32, i32, ctypes.c_float, i32, pointer, pointer,  # Hq, Hkv, D, scale, num_threads, out, lse
            i32,  # 1: q, pools and out float32; 0: bf16
        ]
        self._segments_fn.restype = i32
        # Keys per piece of a segment's reduction (`kernels.segments.aligned_attention_segments`)
        self.chunk = int(library.radixrt_attention_chunk())

    def segments(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_indices: torch.Tensor,
        segments: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], out: torch.Tensor,
        lse: torch.Tensor | None, scale: float,
    ) -> None:
        """Attention of query rows over segments (starts, lens, row_ptr, rows: `kernels.segments`),
        layouts as in `__call__`: each listed row of `out` (and `lse`) written once. q, the pools
        and out may also all be float32 (`supports_segments`)."""
        starts, lens, row_ptr, rows = segments
        status = self._segments_fn(
            q.data_ptr(), q.stride(0), k_pool.data_ptr(), v_pool.data_ptr(), kv_indices.data_ptr(),
            starts.numel(), starts.data_ptr(), lens.data_ptr(), row_ptr.data_ptr(), rows.data_ptr(),
            q.shape[1], k_pool.shape[1], q.shape[2], scale, _threads(), out.data_ptr(),
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
            kv_starts.numel(), num_q_heads, k_pool.shape[1], head_dim, scale, _threads(),
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
            hidden.shape[0], hidden.shape[1], eps, _threads(),
        )  # fmt: skip
        return out


class PackedWeight(NamedTuple):
    """A weight in a packed layout: `QuantizedMatmul`'s own 4- or 8-bit one (`bits`), or the
    formats' layouts (`format_matmul.h`), its rows in `parts` of one format each, lying one after
    another in `data` (`stack_model`)."""

    data: torch.Tensor  # uint8
    bits: int  # 4 or 8: one part in quantized_matmul.c's own layout; 0: `parts` say
    num_rows: int
    parts: tuple[PackedPart, ...] = ()
    num_cols: int = 0  # with `parts` (the own layouts: [tiles, groups, bytes] data says)

    def layout(self) -> tuple[PackedPart, ...]:
        """The parts' formats (GGUF type numbers) and rows; the own 4-bit layout reads Q4_0 and
        Q4_1 alike (an offset per group), so it is Q4_1's."""
        return self.parts or (PackedPart(FORMAT_Q8_0 if self.bits == 8 else FORMAT_Q4_1, self.num_rows),)

    def columns(self) -> int:
        return self.num_cols if self.parts else int(self.data.shape[1]) * QuantizedMatmul.GROUP


class QuantizedMatmul:
    """`radixrt_quantized_matmul_bf16`: bf16 rows times a 4- or 8-bit GGUF weight (`pack_int4`, `pack_int8`)."""

    TILE_ROWS = 16
    GROUP = 32

    def __init__(self, library: ctypes.CDLL):
        self._fn = library.radixrt_quantized_matmul_bf16
        pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._fn.argtypes = [
            pointer, i64, i64,  # x, x_row_stride, rows
            pointer, i32, i64, i64,  # packed weight, bits, N, K
            pointer, pointer, i32,  # out fp32, out bf16, num_threads
        ]
        self._fn.restype = i32
        self._pack_gguf = library.radixrt_pack_gguf_q4_rows
        self._pack_gguf.argtypes = [pointer, pointer, i64, i64, pointer, i32]  # rows, kinds, N, K, out, threads
        self._pack_gguf.restype = i32
        self._pack_gguf_q8 = library.radixrt_pack_gguf_q8_rows
        self._pack_gguf_q8.argtypes = [pointer, i64, i64, pointer, i32]  # rows, N, K, out, threads
        self._pack_gguf_q8.restype = i32
        self._pack_format = library.radixrt_pack_format_rows
        self._pack_format.argtypes = [i32, pointer, i64, i64, pointer, i32]  # format, rows, N, K, out, threads
        self._pack_format.restype = i32
        self._matrix_fn = library.radixrt_matrix_matmul_bf16
        # x, stride, M, matrix, out, out bf16, threads
        self._matrix_fn.argtypes = [pointer, i64, i64, pointer, pointer, pointer, i32]
        self._matrix_fn.restype = i32
        self._gather_fn = library.radixrt_matrix_gather_bf16
        self._gather_fn.argtypes = [pointer, pointer, i64, pointer]  # w, ids, n, out
        self._gather_fn.restype = i32
        self._dequantize_fn = library.radixrt_matrix_dequantize_bf16
        self._dequantize_fn.argtypes = [pointer, pointer, i32]  # w, out, threads
        self._dequantize_fn.restype = i32
        self.tile_bytes = TileBytes(library)
        self._matrices: dict[tuple[int, tuple[PackedPart, ...], int], PackedMatrix] = {}

    def format_runs(self, format: int, shape: tuple[int, int]) -> bool:
        """Whether a [N, K] weight of `format` (a GGUF type number) has a packed layout here: whole
        tiles of 16 rows of a format with a kernel."""
        return shape[0] % self.TILE_ROWS == 0 and self.tile_bytes(format, shape[1]) > 0

    def packed_bytes(self, format: int, shape: tuple[int, int]) -> int:
        """The bytes a [N, K] weight of `format` takes packed (`format_runs` first)."""
        return shape[0] // self.TILE_ROWS * self.tile_bytes(format, shape[1])

    def pack_format(self, parts: Sequence[tuple[int, torch.Tensor]], num_cols: int,
                    out: torch.Tensor | None = None) -> PackedWeight:
        """Rows of GGUF blocks in the formats' packed layouts, straight from the blocks: `parts`, each
        (format, [n] int64 addresses of its rows' blocks, kept alive by the caller), lie one after
        another in `out` (or a new buffer) as one weight."""
        sizes = [self.packed_bytes(format, (rows.numel(), num_cols)) for format, rows in parts]
        for (format, rows), size in zip(parts, sizes):
            if size <= 0:
                raise ValueError(f"format {format} has no packed layout for ({rows.numel()}, {num_cols}) rows: "
                                 f"rows must be whole tiles of {self.TILE_ROWS}")
        data = torch.empty(sum(sizes), dtype=torch.uint8) if out is None else out
        if data.numel() != sum(sizes) or not data.is_contiguous() or data.dtype != torch.uint8:
            raise ValueError(f"out must be {sum(sizes)} contiguous bytes")
        at = 0
        for (format, rows), size in zip(parts, sizes):
            rows = rows.to(torch.int64).contiguous()
            status = self._pack_format(format, rows.data_ptr(), rows.numel(), num_cols, data[at:].data_ptr(),
                                       _threads())
            if status:
                raise ValueError(f"pack_format_rows refused format {format} rows ({rows.numel()}, {num_cols}) "
                                 f"(status {status})")
            at += size
        layout = tuple(PackedPart(format, rows.numel()) for format, rows in parts)
        return PackedWeight(data, 0, sum(part.num_rows for part in layout), layout, num_cols)

    def matrix(self, weight: PackedWeight) -> PackedMatrix:
        """The kernels' description of `weight` (`stack_model.PackedMatrix`; the caller keeps the
        weight alive). A description depends on the address, layout and width alone, so one made
        for an equal key is reused: a layer's step asks for its four at every call."""
        key = (weight.data.data_ptr(), weight.layout(), weight.columns())
        matrix = self._matrices.get(key)
        if matrix is None:
            if len(self._matrices) >= 4096:
                self._matrices.clear()
            matrix = self._matrices[key] = PackedMatrix()
            fill_matrix(matrix, weight, self.tile_bytes)
        return matrix

    def rows(self, weight: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` ([n] int64) of a packed weight as bf16 [n, K], each weight rounded once from its
        exact value: what the whole-step kernels look an embedding row up as."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), weight.columns(), dtype=torch.bfloat16)
        if self._gather_fn(ctypes.byref(self.matrix(weight)), ids.data_ptr(), ids.numel(), out.data_ptr()):
            raise IndexError(f"a token id outside the embedding's rows 0 .. {weight.num_rows - 1}")
        return out

    def dequantize(self, weight: PackedWeight, out: torch.Tensor) -> torch.Tensor:
        """The whole weight as bf16 into `out` (at least N * K contiguous bf16 elements), each value
        rounded once from its exact one; returned as [N, K]."""
        num_cols = weight.columns()
        size = weight.num_rows * num_cols
        if out.dtype != torch.bfloat16 or not out.is_contiguous() or out.numel() < size:
            raise ValueError(f"out must hold {size} contiguous bf16 elements")
        if self._dequantize_fn(ctypes.byref(self.matrix(weight)), out.data_ptr(), _threads()):
            raise ValueError(f"the dequantizer refused a weight of parts {weight.layout()}")
        return out.view(-1)[:size].view(weight.num_rows, num_cols)

    def supports(self, shape: tuple[int, int]) -> bool:
        """Whether a [N, K] weight fits the layout: N a multiple of 16 rows, K of 32 inputs."""
        return shape[0] % self.TILE_ROWS == 0 and shape[1] % self.GROUP == 0

    def pack_int4(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> PackedWeight:
        """w = codes * scales + offsets (codes [N, K] uint8 in 0..15; scales, offsets [N, K // 32],
        exact in fp16 as GGUF stores them) in the kernel's layout: see quantized_matmul.c."""
        tiles, groups = self._tiles(codes)
        # k = 32 g + 4 c + 2 h + e; chunk c holds (row, e) pairs, nibble h
        nibbles = codes.reshape(tiles, self.TILE_ROWS, groups, 8, 2, 2).permute(0, 2, 3, 1, 5, 4)
        chunks = (nibbles[..., 0] | (nibbles[..., 1] << 4)).reshape(tiles, groups, -1)
        blocks = torch.cat([chunks, self._fp16_rows(scales, tiles, groups), self._fp16_rows(offsets, tiles, groups)], -1)
        return PackedWeight(blocks.contiguous(), 4, codes.shape[0])

    def pack_gguf_q4(self, rows: torch.Tensor, kinds: torch.Tensor, num_cols: int,
                     out: torch.Tensor | None = None) -> PackedWeight:
        """GGUF Q4_0/Q4_1 rows in the 4-bit layout, straight from their blocks (`pack_gguf.c`): what
        `pack_int4` makes of the same codes, scales and offsets, in one pass. `rows` [N] int64: the
        address of each row's blocks (the caller keeps them alive); `kinds` [N] uint8: 0 for Q4_0,
        1 for Q4_1; `out`: N * K * 5 / 8 bytes to write into (a slot of the weights' buffer)."""
        num_rows = rows.numel()
        tiles, groups = self._tiles_of(num_rows, num_cols)
        data = torch.empty(tiles * groups * 320, dtype=torch.uint8) if out is None else out
        if data.numel() != tiles * groups * 320 or not data.is_contiguous() or data.dtype != torch.uint8:
            raise ValueError(f"out must be {tiles * groups * 320} contiguous bytes")
        rows, kinds = rows.to(torch.int64).contiguous(), kinds.to(torch.uint8).contiguous()
        status = self._pack_gguf(rows.data_ptr(), kinds.data_ptr(), num_rows, num_cols, data.data_ptr(), _threads())
        if status == -1:
            raise ValueError("a Q4_0 block's offset (-8 times its scale) does not fit in float16")
        if status:
            raise ValueError(f"pack_gguf_q4: rows must be Q4_0 or Q4_1 and the shape whole tiles, got ({num_rows}, "
                             f"{num_cols})")
        return PackedWeight(data.view(tiles, groups, 320), 4, num_rows)

    def pack_gguf_q8(self, rows: torch.Tensor, num_cols: int, out: torch.Tensor | None = None) -> PackedWeight:
        """GGUF Q8_0 rows in the 8-bit layout straight from their blocks (`pack_gguf.c`): what
        `pack_int8` makes of the same codes and scales. `rows` [N] int64 addresses (kept alive by
        the caller); `out`: N * K * 17 / 16 bytes to write into."""
        num_rows = rows.numel()
        tiles, groups = self._tiles_of(num_rows, num_cols)
        data = torch.empty(tiles * groups * 544, dtype=torch.uint8) if out is None else out
        if data.numel() != tiles * groups * 544 or not data.is_contiguous() or data.dtype != torch.uint8:
            raise ValueError(f"out must be {tiles * groups * 544} contiguous bytes")
        rows = rows.to(torch.int64).contiguous()
        if self._pack_gguf_q8(rows.data_ptr(), num_rows, num_cols, data.data_ptr(), _threads()):
            raise ValueError(f"pack_gguf_q8: the shape must be whole tiles, got ({num_rows}, {num_cols})")
        return PackedWeight(data.view(tiles, groups, 544), 8, num_rows)

    def pack_int8(self, codes: torch.Tensor, scales: torch.Tensor) -> PackedWeight:
        """w = codes * scales (codes [N, K] int8; scales [N, K // 32], exact in fp16) in the kernel's layout."""
        tiles, groups = self._tiles(codes)
        # k = 32 g + 4 c + j: vector c holds (row, j) bytes, stored unsigned as q + 128
        unsigned = (codes.view(torch.uint8) ^ 0x80).reshape(tiles, self.TILE_ROWS, groups, 8, 4).permute(0, 2, 3, 1, 4)
        blocks = torch.cat([unsigned.reshape(tiles, groups, -1), self._fp16_rows(scales, tiles, groups)], -1)
        return PackedWeight(blocks.contiguous(), 8, codes.shape[0])

    def _tiles(self, codes: torch.Tensor) -> tuple[int, int]:
        return self._tiles_of(*codes.shape)

    def _tiles_of(self, num_rows: int, num_cols: int) -> tuple[int, int]:
        if not self.supports((num_rows, num_cols)):
            raise ValueError(f"weight shape {(num_rows, num_cols)}: rows must be a multiple of 16, columns of 32")
        return num_rows // self.TILE_ROWS, num_cols // self.GROUP

    def _fp16_rows(self, values: torch.Tensor, tiles: int, groups: int) -> torch.Tensor:
        half = values.to(torch.float16)
        if not torch.equal(half.float(), values.float()):
            raise ValueError("quantized scales and offsets must be exact in float16 (GGUF stores them so)")
        return half.reshape(tiles, self.TILE_ROWS, groups).permute(0, 2, 1).contiguous().view(torch.uint8)

    def __call__(self, x: torch.Tensor, weight: PackedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ w.T` for bf16 rows `x` [M, K] (unit stride along K): bf16 [M, N], or written to
        the fp32 tensor `out` [M, N], contiguous, and returned."""
        rows, num_cols = x.shape
        if out is None:
            result = torch.empty(rows, weight.num_rows, dtype=torch.bfloat16)
            out_f32, out_bf16 = 0, result.data_ptr()
        else:
            result, out_f32, out_bf16 = out, out.data_ptr(), 0
        if weight.parts:
            status = self._matrix_fn(x.data_ptr(), x.stride(0), rows, ctypes.byref(self.matrix(weight)), out_f32,
                                     out_bf16, _threads())
            if status == -2:
                raise ValueError(f"the quantized matmul refused a weight of parts {weight.parts}")
            if status:
                raise MemoryError("quantized matmul kernel could not allocate its scratch")
            return result
        status = self._fn(x.data_ptr(), x.stride(0), rows, weight.data.data_ptr(), weight.bits, weight.num_rows,
                          num_cols, out_f32, out_bf16, _threads())
        if status:
            raise MemoryError("quantized matmul kernel could not allocate its row sums")
        return result


class RowwiseMatmul:
    """`rowwise_matmul.c`: `x @ w.T (+ bias)` for a dense bf16 or float32 weight, each output
    rounded the same whatever else is in the batch."""

    def __init__(self, library: ctypes.CDLL):
        pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._bf16 = library.radixrt_rowwise_matmul_bf16
        self._bf16.argtypes = [pointer, i64, i64, i64, pointer, i64, pointer, pointer, i32, i32]
        self._bf16.restype = None
        self._f32 = library.radixrt_rowwise_matmul_f32
        self._f32.argtypes = [pointer, i64, i64, i64, pointer, i64, pointer, pointer, i32]
        self._f32.restype = None

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in (torch.bfloat16, torch.float32)

    def check_weight(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """ValueError unless `weight` [N, K] and `bias` [N] are contiguous, bf16 or float32, of one dtype."""
        if weight.dim() != 2 or not self.supports(weight.dtype) or (bias is not None and bias.dtype != weight.dtype):
            raise ValueError(f"rowwise matmul: weight {tuple(weight.shape)} {weight.dtype}: need [N, K] of one "
                             "dtype with its bias, bfloat16 or float32")
        if not weight.is_contiguous() or (bias is not None and not bias.is_contiguous()):
            raise ValueError("rowwise matmul: weight and bias must be contiguous")

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, float_out: bool = False
    ) -> torch.Tensor:
        """[M, N]: rows `x` [M, K] (unit stride along K) times `weight` [N, K] (contiguous) and
        `bias` [N], all of one dtype; in that dtype, or float32 with `float_out`."""
        if x.dim() != 2 or x.shape[1] != weight.shape[1] or x.dtype != weight.dtype:
            raise ValueError(f"rowwise matmul: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
                             f"{weight.dtype}: need [M, K] and [N, K] of one dtype, bfloat16 or float32")
        if x.stride(1) != 1:
            raise ValueError("rowwise matmul: x needs unit stride along K, weight and bias contiguous")
        self.check_weight(weight, bias)
        return self.multiply(x, weight, bias, float_out)

    def multiply(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, float_out: bool = False
    ) -> torch.Tensor:
        """`__call__` without its checks, for a caller that made them (`linear.rowwise`: the weight
        once, the rows by construction): the kernel trusts its arguments."""
        rows, num_cols = x.shape
        num_out = weight.shape[0]
        bias_ptr = 0 if bias is None else bias.data_ptr()
        if weight.dtype == torch.float32:
            out = torch.empty(rows, num_out, dtype=torch.float32)
            self._f32(x.data_ptr(), x.stride(0), rows, num_cols, weight.data_ptr(), num_out, bias_ptr,
                      out.data_ptr(), _threads())
            return out
        out = torch.empty(rows, num_out, dtype=torch.float32 if float_out else torch.bfloat16)
        self._bf16(x.data_ptr(), x.stride(0), rows, num_cols, weight.data_ptr(), num_out, bias_ptr, out.data_ptr(),
                   int(float_out), _threads())
        return out


class Int4Layer:
    """`int4_layer.c`: a Llama layer's work before and after attention on packed weights (`PackedWeight`)."""

    def __init__(self, library: ctypes.CDLL, matmul: QuantizedMatmul):
        pointer, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        self._matmul = matmul
        self._inputs = library.radixrt_layer_attention_inputs_bf16
        self._inputs.argtypes = [
            pointer, i64, i64, pointer, f32,  # hidden, rows, dim, norm weight, eps
            pointer, pointer, pointer,  # qkv matrix, cos, signed_sin
            i64, i64, pointer, i32,  # rotated heads, head_dim, qkv out, num_threads
        ]
        self._inputs.restype = i32
        self._finish = library.radixrt_layer_finish_bf16
        self._finish.argtypes = [
            pointer, pointer, i64, i64, i64, i64,  # hidden, attn, attn row stride, rows, dim, attn dim
            pointer, pointer, f32, pointer, pointer, i32,  # o, norm weight, eps, gate_up, down matrices, threads
        ]
        self._finish.restype = i32

    def attention_inputs(
        self, hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float, qkv: PackedWeight,
        cos: torch.Tensor, signed_sin: torch.Tensor, rotated_heads: int, head_dim: int,
    ) -> torch.Tensor:
        """[T, qkv rows] bf16: rms_norm(hidden) @ w_qkv.T with RoPE on the first `rotated_heads` heads.
        hidden [T, dim], cos and signed_sin [T, head_dim] rows: bf16, contiguous; packed weights."""
        rows, dim = hidden.shape
        out = torch.empty(rows, qkv.num_rows, dtype=torch.bfloat16)
        status = self._inputs(
            hidden.data_ptr(), rows, dim, norm_weight.data_ptr(), eps, ctypes.byref(self._matmul.matrix(qkv)),
            cos.data_ptr(), signed_sin.data_ptr(), rotated_heads, head_dim, out.data_ptr(), _threads(),
        )  # fmt: skip
        _raise_for_layer_status(status, qkv)
        return out

    def finish(
        self, hidden: torch.Tensor, attn: torch.Tensor, o: PackedWeight, norm_weight: torch.Tensor, eps: float,
        gate_up: PackedWeight, down: PackedWeight,
    ) -> torch.Tensor:
        """`hidden` ([T, dim] bf16, contiguous) after the attention output `attn` ([T, heads * head_dim],
        unit stride along a row) and the MLP are added to it, in place; returned. Packed weights."""
        rows, dim = hidden.shape
        matrix = self._matmul.matrix
        status = self._finish(
            hidden.data_ptr(), attn.data_ptr(), attn.stride(0), rows, dim, attn.shape[1], ctypes.byref(matrix(o)),
            norm_weight.data_ptr(), eps, ctypes.byref(matrix(gate_up)), ctypes.byref(matrix(down)), _threads(),
        )  # fmt: skip
        _raise_for_layer_status(status, o, gate_up, down)
        return hidden


def _raise_for_layer_status(status: int, *weights: PackedWeight) -> None:
    if status == -2:
        raise ValueError(f"the layer kernel refused weights of layouts {[w.layout() for w in weights]}")
    if status:
        raise MemoryError("layer kernel could not allocate its buffers")


class ProductBalance:
    """How a whole-step kernel's threads divide each kind of weight product (`product_balance.c`):
    learnt from their measured speeds and kept from call to call. The split changes only which
    thread computes a tile, never a result."""

    KINDS = ("qkv", "o", "gate_up", "down", "head")

    def __init__(self, library: ctypes.CDLL):
        self._shares_fn = library.radixrt_product_balance_shares
        self._shares_fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._shares_fn.restype = ctypes.c_int
        self._set_fn = library.radixrt_product_balance_set
        self._set_fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        self._max_threads = int(library.radixrt_product_balance_threads())
        self._state = torch.zeros(int(library.radixrt_product_balance_bytes()), dtype=torch.uint8)

    @property
    def pointer(self) -> int:
        """The state's address, for the kernels (the object keeps it alive)."""
        return self._state.data_ptr()

    def shares(self) -> dict[str, list[float]] | None:
        """Each kind's share of its tiles per thread, or None before a step of two or more threads."""
        out = torch.zeros(len(self.KINDS), self._max_threads, dtype=torch.float32)
        threads = self._shares_fn(self.pointer, out.data_ptr())
        return None if threads == 0 else {kind: out[k, :threads].tolist() for k, kind in enumerate(self.KINDS)}

    def set_shares(self, shares: Sequence[Sequence[float]]) -> None:
        """Fix each kind's shares (a row per kind in `KINDS` order, one positive share per thread,
        summing to 1); later steps learn on from them."""
        table = torch.tensor(shares, dtype=torch.float32)
        if table.dim() != 2 or table.shape[0] != len(self.KINDS) or not 2 <= table.shape[1] <= self._max_threads:
            raise ValueError(f"shares must be {len(self.KINDS)} rows ({', '.join(self.KINDS)}) of 2 .. "
                             f"{self._max_threads} per-thread shares, got shape {tuple(table.shape)}")
        if not bool((table > 0).all()) or not torch.allclose(table.sum(1), torch.ones(len(self.KINDS)), atol=1e-5):
            raise ValueError(f"shares must be positive and each row must sum to 1, got {table.tolist()}")
        self._set_fn(self.pointer, table.shape[1], table.contiguous().data_ptr())


class DecodeStack:
    """`decode_stack.c`: a whole step of a Llama-family model on packed weights (`StackWeights`),
    token ids to logits, for a few new tokens, in one call."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = library.radixrt_decode_stack_bf16
        pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._fn.argtypes = [
            ctypes.POINTER(StackModel), pointer, i64, pointer, pointer,  # model, token ids, rows, hidden, positions
            pointer, pointer, pointer,  # out_slots, kv_indices, each plan's segments (SegmentList[])
            i64, pointer, pointer, i32,  # logit rows: count, rows; logits; threads
        ]
        self._fn.restype = i32
        self.balance = ProductBalance(library)
        self.tile_bytes = TileBytes(library)

    def weights(self, embedding: PackedWeight | torch.Tensor, layers: list[LayerWeights],
                final_norm: torch.Tensor | None, head: PackedWeight | None, eps: float, heads: tuple[int, int, int],
                intermediate: int, extras: ModelExtras | None = None) -> StackWeights:
        """The model handle these kernels read (`stack_model.StackWeights`, keeping the weights alive):
        `embedding` [vocab, dim] bf16 or packed (its rows dequantized as looked up), every layer's
        norms and packed projections (and features, `LayerExtras`), with `head` the final norm and
        packed LM head, and the model's features (`ModelExtras`; None: a plain Llama)."""
        return StackWeights(self.tile_bytes, embedding, layers, final_norm, head, eps, heads, intermediate, extras)

    def __call__(
        self, weights: StackWeights, token_ids: torch.Tensor, hidden: torch.Tensor | None, k_pools: torch.Tensor,
        v_pools: torch.Tensor, num_slots: int, positions: torch.Tensor,
        rope_tables: Sequence[tuple[torch.Tensor, torch.Tensor]], out_slots: torch.Tensor, kv_indices: torch.Tensor,
        segments: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
        logits: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """`token_ids` ([T] rows of the embedding) through every layer into `hidden` ([T, dim] bf16,
        contiguous); with `logits` = (logit rows, out), also out [N, head rows] float32, the LM
        head's logits of the normed rows `logit rows` ([N] rows of the step), and `hidden` may be
        None (the kernel's own buffer).

        k_pools, v_pools: [layers] int64 addresses of [num_slots, Hkv, D] bf16 pools; rope_tables:
        each table's (cos, signed_sin) [P, rotary_dim] bf16, row p for position p; positions: [T];
        out_slots: [T], each row's new K/V slot; segments: for each attention plan of the model
        (its window), (starts, lens, row_ptr, rows) over kv_indices, as `kernels.segments` builds
        them. Every index tensor int64 and contiguous. Raises
        IndexError, computing nothing, for a slot outside the pools, a token id outside the
        embedding, a position outside the tables or a logit row outside the step.
        """
        logit_rows, out = (None, None) if logits is None else logits
        model = weights.model(k_pools, v_pools, num_slots, rope_tables, self.balance.pointer)
        if len(segments) != model.num_plans:
            raise ValueError(f"the layers attend {model.num_plans} plans (windows), got {len(segments)} segment lists")
        plans = (SegmentList * len(segments))(*(
            SegmentList(starts.numel(), starts.data_ptr(), lens.data_ptr(), row_ptr.data_ptr(), rows.data_ptr())
            for starts, lens, row_ptr, rows in segments))  # fmt: skip
        status = self._fn(
            ctypes.byref(model), token_ids.data_ptr(), token_ids.shape[0], None if hidden is None else hidden.data_ptr(),
            positions.data_ptr(), out_slots.data_ptr(), kv_indices.data_ptr(), plans,
            0 if logit_rows is None else logit_rows.numel(), None if logit_rows is None else logit_rows.data_ptr(),
            None if out is None else out.data_ptr(), _threads(),
        )  # fmt: skip
        if status == -6:
            raise IndexError(f"a logit row outside the step's rows 0 .. {token_ids.shape[0] - 1}")
        heads = (model.num_q_heads, model.num_kv_heads, model.head_dim)
        table_rows = min(cos.shape[0] for cos, _ in rope_tables)
        _raise_for_stack_status(status, "decode stack", num_slots, weights.vocab_rows, table_rows, heads)


class RunRows(NamedTuple):
    """A decode run's batch (`decode_run.c`): row r's last token, its position (the keys before
    it), its slots (`slots[slot_starts[r]:]`, one for every position up to the run's last), and
    the whole `chunk`s of keys it reads from row `owner[r]`'s slots (`shared_chunks[r]` of them:
    a prefix they share). Every tensor int64, contiguous, [B] unless said."""

    first_tokens: torch.Tensor
    first_positions: torch.Tensor
    slots: torch.Tensor  # every row's slots, one after another
    slot_starts: torch.Tensor
    owner: torch.Tensor
    shared_chunks: torch.Tensor
    chunk: int


class RunOutput(NamedTuple):
    """What a decode run's n steps give: each step's token of each row and its log-probability
    at temperature 1 ([n, B]), and with `RunSampling.top_logprobs` = k > 0 each row's k most
    likely tokens and their log-probabilities ([n, B, k], largest first, equal values in token
    order: `sampler.top_tokens`'s rule), else None."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    top_tokens: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    def top_lists(self) -> list[list[list[tuple[int, float]]]] | None:
        """The top log-probabilities as the sampler lists them, [step][row] -> [(token, logprob)]."""
        if self.top_tokens is None or self.top_logprobs is None:
            return None
        return [[list(zip(row_tokens, row_logprobs)) for row_tokens, row_logprobs in zip(*step)]
                for step in zip(self.top_tokens.tolist(), self.top_logprobs.tolist())]  # fmt: skip


class DecodeRun:
    """`decode_run.c`: up to k decode steps of a Llama-family model on packed weights (`StackWeights`)
    in one call, each sampling the tokens of the next."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = library.radixrt_decode_run_bf16
        pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._fn.argtypes = [
            ctypes.POINTER(StackModel),  # the model (its head required)
            i64, pointer, pointer, pointer,  # rows, first tokens, first positions, slots
            pointer, pointer, pointer, i64,  # slot starts, owner, shared chunks, chunk
            pointer, pointer, pointer, pointer, pointer,  # temperatures, top_k, top_p, min_p, uniforms
            pointer, pointer, pointer, pointer, pointer,  # repetition, frequency, presence, seen, output counts
            pointer, pointer, pointer, i32, pointer,  # stop ptr, stop ids, interrupt, steps, tokens
            pointer, i32, pointer, pointer,  # logprobs, top count, top tokens, top logprobs
            pointer, i64, pointer, _ADVANCE,  # allowed, allowed words, masked, advance
            i32,  # threads
        ]
        self._fn.restype = i32
        self.balance = ProductBalance(library)

    def __call__(
        self, weights: StackWeights, k_pools: torch.Tensor, v_pools: torch.Tensor, num_slots: int,
        rope_tables: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: RunRows, sampling: RunSampling, num_steps: int,
        interrupt: ctypes.c_int32 | None = None,
    ) -> RunOutput:
        """The n <= `num_steps` steps run (`RunOutput`): n stops at the first step where a row
        drew a stop token, or where `interrupt` (set from any thread) was nonzero. The model as
        `DecodeStack` takes it, with its head; each step's K/V go to the rows' next slots. Raises IndexError,
        computing nothing, for a slot outside the pools, a token id outside the embedding or a
        position outside the tables; ValueError for penalty counts not [B, head rows] int32 and
        contiguous, or top_logprobs outside 0 .. head rows."""
        head = weights.head
        if head is None:
            raise ValueError("a decode run needs the model's LM head")
        batch = rows.first_tokens.shape[0]
        penalties = sampling.penalties
        for counts in () if penalties is None else (penalties.seen, penalties.output_counts):
            if counts.shape != (batch, head.num_rows) or counts.dtype != torch.int32 or not counts.is_contiguous():
                raise ValueError(f"penalty counts must be [{batch}, {head.num_rows}] int32 and contiguous, "
                                 f"got {tuple(counts.shape)} {counts.dtype}")
        if not 0 <= sampling.top_logprobs <= head.num_rows:
            raise ValueError(f"top_logprobs must be in [0, {head.num_rows}], got {sampling.top_logprobs}")
        tokens = torch.empty(num_steps, batch, dtype=torch.int64)
        logprobs = torch.empty(num_steps, batch, dtype=torch.float32)
        masks, advance, failure = sampling.masks, None, []
        if masks is not None:
            if (masks.allowed.dtype != torch.int32 or masks.allowed.shape[0] != batch or not masks.allowed.is_contiguous()
                    or masks.allowed.shape[1] * 32 < head.num_rows):  # fmt: skip
                raise ValueError(f"masks must be [{batch}, >= {(head.num_rows + 31) // 32}] int32 and contiguous, "
                                 f"got {tuple(masks.allowed.shape)} {masks.allowed.dtype}")
            if masks.masked.dtype != torch.uint8 or masks.masked.shape != (batch,):
                raise ValueError(f"masked must be [{batch}] uint8, got {tuple(masks.masked.shape)}")

            def call_back(step: int) -> int:
                try:
                    return int(bool(masks.advance(step, tokens[step].tolist())))
                except BaseException as error:  # raised again once the run is over
                    failure.append(error)
                    return 1

            advance = _ADVANCE(call_back)
        top = sampling.top_logprobs
        top_tokens = torch.empty(num_steps, batch, top, dtype=torch.int64) if top else None
        top_logprobs = torch.empty(num_steps, batch, top, dtype=torch.float32) if top else None
        model = weights.model(k_pools, v_pools, num_slots, rope_tables, self.balance.pointer)
        done = self._fn(
            ctypes.byref(model), batch, rows.first_tokens.data_ptr(), rows.first_positions.data_ptr(), rows.slots.data_ptr(),
            rows.slot_starts.data_ptr(), rows.owner.data_ptr(), rows.shared_chunks.data_ptr(), rows.chunk,
            sampling.temperatures.data_ptr(), sampling.top_k.data_ptr(), sampling.top_p.data_ptr(),
            sampling.min_p.data_ptr(), sampling.uniforms.data_ptr(),
            *([None] * 5 if penalties is None else [tensor.data_ptr() for tensor in penalties]),
            sampling.stop_ptr.data_ptr(), sampling.stop_ids.data_ptr(),
            None if interrupt is None else ctypes.addressof(interrupt), num_steps, tokens.data_ptr(),
            logprobs.data_ptr(), top, None if top_tokens is None else top_tokens.data_ptr(),
            None if top_logprobs is None else top_logprobs.data_ptr(),
            None if masks is None else masks.allowed.data_ptr(), 0 if masks is None else masks.allowed.shape[1],
            None if masks is None else masks.masked.data_ptr(), advance or _ADVANCE(), _threads(),
        )  # fmt: skip
        if failure:
            raise failure[0]
        if done < 0:
            heads = (model.num_q_heads, model.num_kv_heads, model.head_dim)
            table_rows = min(cos.shape[0] for cos, _ in rope_tables)
            _raise_for_stack_status(done, "decode run", num_slots, weights.vocab_rows, table_rows, heads)
        return RunOutput(tokens[:done], logprobs[:done], None if top_tokens is None else top_tokens[:done],
                         None if top_logprobs is None else top_logprobs[:done])


def _raise_for_stack_status(
    status: int, kernel: str, num_slots: int, vocab_rows: int, table_rows: int, heads: tuple[int, int, int]
) -> None:
    """The error a whole-step kernel's negative status stands for (nothing was computed)."""
    if status == -3:
        raise IndexError(f"a K/V slot is outside the pool of {num_slots} slots")
    if status == -4:
        raise IndexError(f"a token id outside the embedding's rows 0 .. {vocab_rows - 1}")
    if status == -5:
        raise IndexError(f"a position outside the RoPE tables' rows 0 .. {table_rows - 1}")
    if status == -1:
        raise ValueError(f"{kernel} kernel refused heads {heads} or the shape of its batch")
    if status:
        raise MemoryError(f"{kernel} kernel could not allocate its buffers")


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
                 stats[1].data_ptr(), _threads())  # fmt: skip
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
                          floats[2 * num_rows :].data_ptr(), uniform.data_ptr(), tokens.data_ptr(), _threads())
        if status:
            raise MemoryError("row sampling kernel could not allocate its block sums")


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
    library = _load()
    return None if library is None else KVStore(library)


@functools.cache  # the sampler asks at every step
def row_stats() -> RowStats | None:
    """The compiled argmax and log-sum-exp of logits rows; None where the kernels cannot be built."""
    library = _load()
    return None if library is None else RowStats(library)


@functools.cache  # the sampler asks at every step
def token_masks() -> TokenMasks | None:
    """The compiled token masking of logits rows; None where the kernels cannot be built."""
    library = _load()
    return None if library is None else TokenMasks(library)


@functools.cache  # the sampler asks at every step
def row_sampler() -> RowSampler | None:
    """The compiled sampling of logits rows; None where the kernels cannot be built."""
    library = _load()
    return None if library is None else RowSampler(library)


def decode_attention() -> DecodeAttention | None:
    """The compiled decode-attention kernel; None where it cannot be built."""
    library = _load()
    return None if library is None else DecodeAttention(library)


def rms_norm() -> RMSNorm | None:
    """The compiled bf16 RMSNorm; None where it cannot be built."""
    library = _load()
    return None if library is None else RMSNorm(library)


def quantized_matmul() -> QuantizedMatmul | None:
    """The compiled 4/8-bit matmul (at the level in use: `isa()`); None where it cannot be built."""
    library = _load()
    return None if library is None or not library.radixrt_quantized_matmul_available() else QuantizedMatmul(library)


def rowwise_matmul() -> RowwiseMatmul | None:
    """The compiled batch-invariant dense matmul (at the level in use: `isa()`); None where the
    kernels cannot be built."""
    library = _load()
    return None if library is None or not library.radixrt_rowwise_matmul_available() else RowwiseMatmul(library)


def int4_layer() -> Int4Layer | None:
    """The compiled 4-bit layer parts; None wherever `quantized_matmul` is."""
    library = _load()
    matmul = quantized_matmul()
    return None if library is None or matmul is None else Int4Layer(library, matmul)


def decode_stack() -> DecodeStack | None:
    """The compiled whole-step kernel; None wherever `quantized_matmul` is."""
    library = _load()
    return None if library is None or not library.radixrt_quantized_matmul_available() else DecodeStack(library)


def decode_run() -> DecodeRun | None:
    """The compiled multi-step decode kernel; None wherever `quantized_matmul` is."""
    library = _load()
    return None if library is None or not library.radixrt_quantized_matmul_available() else DecodeRun(library)


def _load() -> ctypes.CDLL | None:
    """The kernels' library at the level in use (`build.selected_level`), built on the first call
    in any process on this machine. ValueError for an unknown RADIXRT_CPU_ISA."""
    with _lock:
        if not _library:
            _library.append(build.library(build.selected_level()))
        return _library[0]


def isa() -> str:
    """The instruction-set level of the kernels in use: "portable", "avx2" or "avx512" (what the
    loaded build reports; "none" where the kernels cannot be built)."""
    library = _load()
    return "none" if library is None else build.level_of(library)
