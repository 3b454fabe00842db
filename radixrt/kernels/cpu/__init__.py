"""C kernels for the CPU path, compiled on first use by the machine's C compiler.

A decode step is hundreds of small ops; where torch's CPU kernels spend more
on setup than on arithmetic at those sizes, a plain C loop does the job:

    decode_attention.c  torch's CPU attention is built for long query blocks:
                        for one query per sequence its flash kernel spends
                        most of its time on per-block setup, and the padded
                        gather in front of it copies every key once more per
                        layer. Here each key and value is read once, in
                        place, for all the query heads that share it.
    rms_norm.c          torch's bf16 rms_norm is about eight ops; here one
                        pass, with the residual add fused in.
    q4_matmul.c         torch's 4-bit CPU matmul dequantizes to float32 and
                        works one row at a time: 8 rows cost 8 times 1.
                        Here the codes feed bf16 dot products directly and
                        are decoded once for several rows (AVX512-BF16
                        CPUs; elsewhere callers keep torch's kernel).
    int4_layer.c        a 4-bit Llama layer's work around attention (norms,
                        projections, RoPE, SwiGLU, residuals) in two calls
                        instead of about thirty ops, for decode-sized steps.

The sources are compiled together with `-march=native` for this machine,
cached under `cache_root()/kernels`, and loaded with ctypes (no torch
headers: building took 0.6-0.75 s on the project's 2-core machine).
Without a C compiler, or if building fails, the accessors return None and
callers keep torch's path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
import uuid
from pathlib import Path

import torch

from radixrt.paths import cache_root

logger = logging.getLogger(__name__)

_SOURCES = tuple(sorted(Path(__file__).parent.glob("*.c")))
# No -ffast-math: linking it would switch the whole process to flush-to-zero floats.
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared")
# Shapes the kernel's fixed-size buffers hold (MAX_GROUP, MAX_HEAD_DIM in the source).
MAX_GROUP = 16
MAX_HEAD_DIM = 256

_lock = threading.Lock()
_library: list[ctypes.CDLL | None] = []  # empty until the first accessor call, then [library or None]


class DecodeAttention:
    """`radixrt_decode_attention_bf16` with its argument types, over torch tensors."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = library.radixrt_decode_attention_bf16
        pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._fn.argtypes = [
            pointer, i64, pointer,  # q, q_row_stride, q_rows
            pointer, pointer,  # k_pool, v_pool
            pointer, pointer, pointer,  # kv_indices, kv_starts, kv_lens
            i32, i32, i32, i32, ctypes.c_float, i32,  # num_seqs, Hq, Hkv, D, scale, num_threads
            pointer, pointer, pointer,  # out_rows, out, lse
        ]
        self._fn.restype = i32

    def __call__(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_starts: torch.Tensor,
        kv_lens: torch.Tensor,
        q_rows: torch.Tensor,
        out_rows: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        scale: float,
    ) -> None:
        """Attention of the query rows `q[q_rows[s]]` ([*, Hq, D] bf16, head stride D) over the
        pool slots `kv_indices[kv_starts[s]:][:kv_lens[s]]`, written to `out[out_rows[s]]`
        ([*, Hq, D] bf16, contiguous) and, if given, natural-log `lse[out_rows[s]]` ([*, Hq] fp32).

        Index tensors are int64 and contiguous; the caller keeps every tensor alive and checks
        shapes (`supports`): the kernel trusts them.
        """
        num_q_heads, head_dim = q.shape[1], q.shape[2]
        status = self._fn(
            q.data_ptr(), q.stride(0), q_rows.data_ptr(),
            k_pool.data_ptr(), v_pool.data_ptr(),
            kv_indices.data_ptr(), kv_starts.data_ptr(), kv_lens.data_ptr(),
            kv_starts.numel(), num_q_heads, k_pool.shape[1], head_dim, scale, torch.get_num_threads(),
            out_rows.data_ptr(), out.data_ptr(), 0 if lse is None else lse.data_ptr(),
        )  # fmt: skip
        if status:
            raise ValueError(f"decode attention kernel refused shapes q {tuple(q.shape)}, pool {tuple(k_pool.shape)}")


def supports(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel handles this attention shape and KV dtype."""
    group = num_q_heads // num_kv_heads
    return dtype == torch.bfloat16 and group <= MAX_GROUP and head_dim <= MAX_HEAD_DIM


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
            hidden.shape[0], hidden.shape[1], eps, torch.get_num_threads(),
        )  # fmt: skip
        return out


class Q4Matmul:
    """`radixrt_q4_matmul_bf16`: bf16 rows times a 4-bit weight in the kernel's own layout (`pack`)."""

    TILE_ROWS = 16
    GROUP = 32

    def __init__(self, library: ctypes.CDLL):
        self._fn = library.radixrt_q4_matmul_bf16
        pointer, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn.argtypes = [
            pointer, i64, i64,  # x, x_row_stride, rows
            pointer, i64, i64,  # packed weight, N, K
            pointer, pointer, ctypes.c_int, ctypes.c_int,  # out fp32, out bf16, accumulate, num_threads
        ]
        self._fn.restype = ctypes.c_int

    def supports(self, shape: tuple[int, int]) -> bool:
        """Whether a [N, K] weight fits the layout: N a multiple of 16 rows, K of 32 inputs."""
        return shape[0] % self.TILE_ROWS == 0 and shape[1] % self.GROUP == 0

    def pack(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The kernel's layout of w = codes * scales + offsets (codes [N, K] uint8 in 0..15; scales,
        offsets [N, K // 32], exact in fp16 as GGUF stores them): see q4_matmul.c."""
        num_rows, num_cols = codes.shape
        tiles, groups = num_rows // self.TILE_ROWS, num_cols // self.GROUP
        # k = 32 g + 4 c + 2 h + e; the kernel's chunk c holds (row, e) pairs, nibble h
        nibbles = codes.reshape(tiles, self.TILE_ROWS, groups, 8, 2, 2).permute(0, 2, 3, 1, 5, 4)
        chunks = (nibbles[..., 0] | (nibbles[..., 1] << 4)).reshape(tiles, groups, -1)
        blocks = [chunks]
        for values in (scales, offsets):
            half = values.to(torch.float16)
            if not torch.equal(half.float(), values.float()):
                raise ValueError("4-bit scales and offsets must be exact in float16 (GGUF stores them so)")
            blocks.append(half.reshape(tiles, self.TILE_ROWS, groups).permute(0, 2, 1).contiguous().view(torch.uint8))
        return torch.cat(blocks, dim=-1).contiguous()

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, num_rows: int, out: torch.Tensor | None = None,
                 accumulate: bool = False) -> torch.Tensor:
        """`x @ w.T` for bf16 rows `x` [M, K] (unit stride along K): bf16 [M, N], or written to
        (`accumulate`: added to) the fp32 tensor `out` [M, N], contiguous, and returned."""
        rows, num_cols = x.shape
        if out is None:
            result = torch.empty(rows, num_rows, dtype=torch.bfloat16)
            out_f32, out_bf16 = 0, result.data_ptr()
        else:
            result, out_f32, out_bf16 = out, out.data_ptr(), 0
        status = self._fn(x.data_ptr(), x.stride(0), rows, packed.data_ptr(), num_rows, num_cols,
                          out_f32, out_bf16, int(accumulate), torch.get_num_threads())
        if status:
            raise MemoryError("4-bit matmul kernel could not allocate its row sums")
        return result


class Int4Layer:
    """`int4_layer.c`: a Llama layer's work before and after attention on `Q4Matmul.pack`ed weights."""

    def __init__(self, library: ctypes.CDLL):
        pointer, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        self._inputs = library.radixrt_int4_attention_inputs_bf16
        self._inputs.argtypes = [
            pointer, i64, i64, pointer, f32,  # hidden, rows, dim, norm weight, eps
            pointer, i64, pointer, pointer,  # qkv weight, its rows, cos, signed_sin
            i64, i64, pointer, i32,  # rotated heads, head_dim, qkv out, num_threads
        ]
        self._inputs.restype = i32
        self._finish = library.radixrt_int4_finish_layer_bf16
        self._finish.argtypes = [
            pointer, pointer, i64, i64, i64, i64,  # hidden, attn, attn row stride, rows, dim, attn dim
            pointer, pointer, f32, pointer, i64, pointer, i32,  # o, norm weight, eps, gate_up, intermediate, down, threads
        ]
        self._finish.restype = i32

    def attention_inputs(
        self, hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float, qkv_weight: torch.Tensor, qkv_rows: int,
        cos: torch.Tensor, signed_sin: torch.Tensor, rotated_heads: int, head_dim: int,
    ) -> torch.Tensor:
        """[T, qkv_rows] bf16: rms_norm(hidden) @ w_qkv.T with RoPE on the first `rotated_heads` heads.
        hidden [T, dim], cos and signed_sin [T, head_dim] rows: bf16, contiguous."""
        rows, dim = hidden.shape
        qkv = torch.empty(rows, qkv_rows, dtype=torch.bfloat16)
        status = self._inputs(
            hidden.data_ptr(), rows, dim, norm_weight.data_ptr(), eps, qkv_weight.data_ptr(), qkv_rows,
            cos.data_ptr(), signed_sin.data_ptr(), rotated_heads, head_dim, qkv.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise MemoryError("4-bit layer kernel could not allocate its buffers")
        return qkv

    def finish(
        self, hidden: torch.Tensor, attn: torch.Tensor, o_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
        gate_up_weight: torch.Tensor, intermediate: int, down_weight: torch.Tensor,
    ) -> torch.Tensor:
        """`hidden` ([T, dim] bf16, contiguous) after the attention output `attn` ([T, heads * head_dim],
        unit stride along a row) and the MLP are added to it, in place; returned."""
        rows, dim = hidden.shape
        status = self._finish(
            hidden.data_ptr(), attn.data_ptr(), attn.stride(0), rows, dim, attn.shape[1], o_weight.data_ptr(),
            norm_weight.data_ptr(), eps, gate_up_weight.data_ptr(), intermediate, down_weight.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise MemoryError("4-bit layer kernel could not allocate its buffers")
        return hidden


def decode_attention() -> DecodeAttention | None:
    """The compiled decode-attention kernel; None where it cannot be built."""
    library = _load()
    return None if library is None else DecodeAttention(library)


def rms_norm() -> RMSNorm | None:
    """The compiled bf16 RMSNorm; None where it cannot be built."""
    library = _load()
    return None if library is None else RMSNorm(library)


def q4_matmul() -> Q4Matmul | None:
    """The compiled 4-bit matmul; None where it cannot be built or the CPU lacks AVX512-BF16."""
    library = _load()
    return None if library is None or not library.radixrt_q4_matmul_available() else Q4Matmul(library)


def int4_layer() -> Int4Layer | None:
    """The compiled 4-bit layer parts; None wherever `q4_matmul` is."""
    library = _load()
    return None if library is None or not library.radixrt_q4_matmul_available() else Int4Layer(library)


def _load() -> ctypes.CDLL | None:
    """The kernels' library, built on the first call in any process on this machine."""
    with _lock:
        if not _library:
            _library.append(_build_and_open())
        return _library[0]


def _build_and_open() -> ctypes.CDLL | None:
    if platform.system() != "Linux":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found (set CC): radixrt's CPU kernels fall back to torch's slower ops")
        return None
    try:
        return ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.warning("could not build radixrt's CPU kernels (%s); using torch's ops", detail)
        return None


def _build(compiler: str) -> Path:
    """The shared library for these sources, compiler and CPU, compiled if not cached yet."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256()
    for part in (*(source.read_bytes() for source in _SOURCES), " ".join(_FLAGS).encode(), version.encode(),
                 _cpu_flags().encode()):
        digest.update(part)
    target = cache_root() / "kernels" / f"radixrt_cpu-{digest.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
    logger.info("compiling radixrt's CPU kernels for this CPU (once per machine, a few seconds)")
    subprocess.run([compiler, *_FLAGS, *map(str, _SOURCES), "-o", str(tmp), "-lm"], capture_output=True, text=True,
                   check=True)
    os.replace(tmp, target)  # a concurrent build writes the same bytes; readers see a whole file
    return target


def _cpu_flags() -> str:
    """The CPU's feature flags: -march=native code must not be reused on another CPU."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return platform.processor()
