"""The triton and flashinfer backends against an explicit fp32 reference.

On a GPU (marked `gpu`): both backends on mixed extend + decode batches over
page sizes 1 and 16, bf16 and fp16, GQA ratios 1/3/4/8, head_dim 64 and 128,
with every sequence's pages scattered over the pool. Every check also compares
with the torch reference backend.

Every path also runs with sliding windows, a softmax scale and score
soft-capping (`LayerAttention`).

On the CPU: the triton kernels under the Triton interpreter (in a subprocess,
because TRITON_INTERPRET must be set before the kernels are decorated), and
the flashinfer backend's page tables and row routing through a fake
`flashinfer` module that implements the documented semantics of the two
wrappers in torch.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from radixrt.kernels.base import FULL_ATTENTION, LayerAttention
from radixrt.kernels.forward_batch import ForwardBatch
from radixrt.kernels.torch_backend import TorchAttentionBackend
from radixrt.memory.kv_cache import KVCache, KVShape

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None

# (prefix_len, extend_len) per sequence: plain prefill, decodes (one of them a
# one-token prompt, one long enough for several KV splits), an extend after a
# cached prefix, and an extend longer than one query block.
MIXED = [(0, 37), (45, 1), (100, 20), (0, 1), (300, 1), (17, 70), (1000, 1)]
DECODE_ONLY = [(5, 1), (64, 1), (257, 1), (2000, 1)]
EXTEND_ONLY = [(0, 16), (33, 9), (128, 130)]
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}


@dataclass
class Case:
    cache: KVCache
    batch: ForwardBatch
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor
    layer: int
    num_q_heads: int


def make_case(
    specs: list[tuple[int, int]],
    page_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> Case:
    """A two-layer pool full of random values with each sequence's pages handed
    out in a shuffled order, so prefixes sit in scattered slots (slot order inside
    a page is kept, as the engine guarantees). Layer 1 is the one under test."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-(p + e) // page_size) for p, e in specs]
    num_pages = sum(pages_per_seq) + 3  # spare pages of garbage nobody may read
    order = torch.randperm(num_pages, generator=gen)
    kv_slots, taken = [], 0
    for (p, e), n in zip(specs, pages_per_seq):
        pages = order[taken : taken + n]
        taken += n
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()
        kv_slots.append(slots[: p + e])
    cache = KVCache(KVShape(2, num_kv_heads, head_dim, dtype), num_pages * page_size, device)
    for layer in range(2):
        cache.k[layer].copy_(torch.randn(cache.k[layer].shape, generator=gen))
        cache.v[layer].copy_(torch.randn(cache.v[layer].shape, generator=gen))
    batch = ForwardBatch.build([[0] * e for _, e in specs], [p for p, _ in specs], kv_slots, device)
    num_tokens = sum(e for _, e in specs)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn((num_tokens, heads, head_dim), generator=gen).to(dtype=dtype, device=device)

    return Case(cache, batch, rand(num_q_heads), rand(num_kv_heads), rand(num_kv_heads), 1, num_q_heads)


def reference_attention(case: Case, attention: LayerAttention = FULL_ATTENTION) -> torch.Tensor:
    """Per-sequence softmax attention in fp32, from a copy of the pool with the new K/V stored."""
    b, dtype = case.batch, case.cache.shape.dtype
    pool_k = case.cache.k[case.layer].float().cpu()
    pool_v = case.cache.v[case.layer].float().cpu()
    out_slots = b.out_slots.cpu()
    pool_k[out_slots] = case.k.to(dtype).float().cpu()
    pool_v[out_slots] = case.v.to(dtype).float().cpu()
    q = case.q.to(dtype).float().cpu()
    group = case.num_q_heads // case.cache.shape.num_kv_heads
    scale = attention.scale or case.cache.shape.head_dim**-0.5
    kv_indices = b.kv_indices.cpu()
    out = torch.empty_like(q)
    for i, (prefix, extend) in enumerate(zip(b.prefix_lens, b.extend_lens)):
        slots = kv_indices[b.kv_offsets[i] : b.kv_offsets[i + 1]]
        keys = pool_k[slots].repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = pool_v[slots].repeat_interleave(group, dim=1)
        rows = slice(b.qo_offsets[i], b.qo_offsets[i + 1])
        scores = torch.einsum("ehd,shd->hes", q[rows], keys) * scale
        if attention.logit_softcap is not None:
            scores = torch.tanh(scores / attention.logit_softcap) * attention.logit_softcap
        position = prefix + torch.arange(extend)[:, None]
        visible = torch.arange(prefix + extend)[None, :] <= position
        if attention.sliding_window is not None:
            visible &= torch.arange(prefix + extend)[None, :] > position - attention.sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[rows] = torch.einsum("hes,shd->ehd", scores.softmax(-1), values)
    return out


def check_backend(
    backend_cls: type, case: Case, page_size: int, attention: LayerAttention = FULL_ATTENTION, **kwargs: object
) -> torch.Tensor:
    """Run one layer through the backend; check the store and the output; return the output."""
    expected = reference_attention(case, attention)
    cache = case.cache
    backend = backend_cls(cache, case.num_q_heads, cache.shape.num_kv_heads, cache.shape.head_dim, page_size, **kwargs)
    plan = backend.plan(case.batch, attention)
    out = backend.forward(case.q, case.k, case.v, case.layer, case.batch, plan)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    slots = case.batch.out_slots
    assert torch.equal(cache.k[case.layer][slots], case.k.to(cache.shape.dtype))
    assert torch.equal(cache.v[case.layer][slots], case.v.to(cache.shape.dtype))
    tol = TOLERANCE[cache.shape.dtype]
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol, rtol=tol)
    # The pool already holds this step's K/V; the torch backend stores the same values again.
    twin = TorchAttentionBackend(cache, case.num_q_heads, cache.shape.num_kv_heads, cache.shape.head_dim, page_size)
    torch_out = twin.forward(case.q, case.k, case.v, case.layer, case.batch, twin.plan(case.batch, attention))
    torch.testing.assert_close(out.float(), torch_out.float(), atol=tol, rtol=tol)
    return out


def backend_class(name: str) -> type:
    if name == "triton":
        from radixrt.kernels.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend
    from radixrt.kernels.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend


def gpu_backend_params() -> list:
    needs_flashinfer = pytest.mark.skipif(not HAS_FLASHINFER, reason="flashinfer is not installed")
    needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
    return [pytest.param("triton", marks=needs_triton), pytest.param("flashinfer", marks=needs_flashinfer)]


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("backend", gpu_backend_params())
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(8, 8), (12, 4), (16, 4), (32, 4)], ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_batch_on_gpu(backend: str, page_size: int, dtype: torch.dtype, heads: tuple, head_dim: int) -> None:
    case = make_case(MIXED, page_size, heads[0], heads[1], head_dim, dtype, "cuda")
    check_backend(backend_class(backend), case, page_size)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("backend", gpu_backend_params())
@pytest.mark.parametrize("specs", [DECODE_ONLY, EXTEND_ONLY], ids=["decode_only", "extend_only"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_pure_batches_on_gpu(backend: str, specs: list, page_size: int) -> None:
    case = make_case(specs, page_size, 32, 8, 128, torch.bfloat16, "cuda", seed=1)
    check_backend(backend_class(backend), case, page_size)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("backend", gpu_backend_params())
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("attention", [LayerAttention(sliding_window=100), LayerAttention(33, 0.0625, 50.0)],
                         ids=["window", "window-scale-softcap"])  # fmt: skip
def test_layer_attention_on_gpu(backend: str, page_size: int, attention: LayerAttention) -> None:
    case = make_case(MIXED, page_size, 16, 4, 128, torch.bfloat16, "cuda", seed=2)
    check_backend(backend_class(backend), case, page_size, attention)


# ---------------------------------------------------------------- CPU: triton interpreter

# (page_size, dtype, num_q_heads, num_kv_heads, head_dim); head_dim 24 checks
# the masking of a head_dim that is not a power of two. bf16 is left out: the
# interpreter (numpy) reads bf16 tensors as zeros.
INTERPRETER_CONFIGS = [
    (page_size, dtype, hq, hkv, d)
    for page_size in (1, 16)
    for dtype in (torch.float32, torch.float16)
    for hq, hkv, d in ((4, 4, 16), (6, 2, 32), (8, 1, 24))
]
INTERPRETER_SPECS = [(0, 5), (7, 1), (20, 3), (0, 1), (150, 1), (10, 70), (65, 3), (130, 2)]
# Windows shorter than a tile and spanning several; a scale and score cap as Gemma 2's.
INTERPRETER_ATTENTIONS = [LayerAttention(sliding_window=9), LayerAttention(70, scale=0.3, logit_softcap=4.0)]


def run_interpreter_cases() -> None:
    """Entry point of the interpreter subprocess: every config against the reference."""
    from radixrt.kernels.triton_backend import TritonAttentionBackend

    for config in INTERPRETER_CONFIGS:
        page_size, dtype, hq, hkv, d = config
        start = time.perf_counter()
        for specs in (INTERPRETER_SPECS, [(3, 1), (40, 1)], [(0, 9), (12, 4)]):
            check_backend(TritonAttentionBackend, make_case(specs, page_size, hq, hkv, d, dtype, "cpu"), page_size)
        print(f"ok {config} {time.perf_counter() - start:.1f}s", flush=True)
    for config in (INTERPRETER_CONFIGS[1], INTERPRETER_CONFIGS[-1]):
        page_size, dtype, hq, hkv, d = config
        for attention in INTERPRETER_ATTENTIONS:
            case = make_case(INTERPRETER_SPECS, page_size, hq, hkv, d, dtype, "cpu")
            check_backend(TritonAttentionBackend, case, page_size, attention)
            print(f"ok {config} {attention}", flush=True)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernels_under_interpreter() -> None:
    # The child sees this process's import path, so it finds radixrt and this file.
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), *sys.path]))
    code = f"import {Path(__file__).stem} as t; t.run_interpreter_cases()"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------- CPU: compile for a real GPU

# (dtype, head_dim, GQA group); head_dim 80 is not a power of two.
AOT_CONFIGS = [(torch.bfloat16, 128, 4), (torch.float16, 64, 1), (torch.bfloat16, 80, 3)]
_AOT_POINTERS = {
    "kv_indices": "*i64", "Mid_O": "*fp32", "Mid_LSE": "*fp32",
    **dict.fromkeys(["q_rows", "kv_starts", "seq_lens", "q_starts", "extend_lens", "prefix_lens"], "*i32"),
}  # fmt: skip
_AOT_TENSORS = {"Q", "K_cache", "V_cache", "K_new", "V_new", "Out"}
_AOT_FLOATS = {"qk_scale", "cap_log2"}


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="kernels are interpreted, not compiled")
@pytest.mark.parametrize("config", AOT_CONFIGS, ids=lambda c: f"{str(c[0])[6:]}-d{c[1]}-gqa{c[2]}")
@pytest.mark.parametrize("softcap", [False, True], ids=["plain", "softcap"])
def test_triton_kernels_compile_for_hopper(config: tuple, softcap: bool) -> None:
    """Compile every kernel down to a cubin for sm_90 with Triton's compiler and the
    ptxas its wheel ships, no GPU needed: this catches what the interpreter lets
    through (types, tl.dot shapes, loop-carried values, shared memory)."""
    import triton
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend")
    from radixrt.kernels.triton_attention import launch_configs

    dtype, head_dim, group = config
    element = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    for kernel, launch in launch_configs(dtype, head_dim, group, softcap):
        constexprs = {k: v for k, v in launch.items() if k not in ("num_warps", "num_stages")}
        signature = {
            name: "constexpr" if name in constexprs
            else f"*{element}" if name in _AOT_TENSORS
            else _AOT_POINTERS.get(name, "fp32" if name in _AOT_FLOATS else "i32")
            for name in kernel.arg_names
        }  # fmt: skip
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs=constexprs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": launch["num_warps"], "num_stages": launch["num_stages"]},
        )
        assert compiled.asm["cubin"] and compiled.metadata.shared <= 100 * 1024


# ---------------------------------------------------------------- CPU: flashinfer metadata


def test_page_table_of_a_subset() -> None:
    from radixrt.kernels.flashinfer_backend import build_page_table

    page_size = 4
    slots = [torch.tensor([8, 9, 10, 11, 20, 21]), torch.tensor([4, 5, 6]), torch.tensor([0, 1, 2, 3, 28, 29, 30, 31])]
    batch = ForwardBatch.build([[0], [0, 0], [0]], [5, 1, 7], slots)
    table = build_page_table(batch, [0, 2], page_size)
    assert table.indptr.tolist() == [0, 2, 4]
    assert table.indices.tolist() == [2, 5, 0, 7]
    assert table.last_page_len.tolist() == [2, 4]
    assert {table.indptr.dtype, table.indices.dtype, table.last_page_len.dtype} == {torch.int32}
    single = build_page_table(batch, [1], 1)
    assert single.indices.tolist() == [4, 5, 6] and single.last_page_len.tolist() == [1]


class _FakePagedWrapper:
    """What the FlashInfer wrappers do, per their documentation, in plain torch.

    The signatures mirror flashinfer-python 0.7.2's for the arguments the
    backend passes, so a misnamed keyword fails here too."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_tensor_cores: bool = False):
        assert float_workspace_buffer.dtype == torch.uint8 and kv_layout == "NHD"
        self.plan_args: dict | None = None

    def _plan(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
              causal, sm_scale, q_data_type, kv_data_type, pos_encoding_mode, window_left,
              logits_soft_cap):  # fmt: skip
        for t in (qo_indptr, indptr, indices, last_page_len):
            assert t.dtype == torch.int32
        assert pos_encoding_mode == "NONE" and q_data_type == kv_data_type
        assert int(last_page_len.min()) >= 1 and int(last_page_len.max()) <= page_size
        self.plan_args = dict(qo_indptr=qo_indptr.cpu(), indptr=indptr.cpu(), indices=indices.cpu(),
                              last_page_len=last_page_len.cpu(), page_size=page_size, causal=causal,
                              sm_scale=sm_scale, dtype=q_data_type, group=num_qo_heads // num_kv_heads,
                              window_left=window_left, logits_soft_cap=logits_soft_cap)  # fmt: skip

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a = self.plan_args
        k_cache, v_cache = paged_kv_cache
        assert q.dtype == a["dtype"] and k_cache.dim() == 4 and k_cache.shape[1] == a["page_size"]
        assert q.shape[0] == int(a["qo_indptr"][-1])
        out = torch.empty_like(q)
        for i in range(len(a["last_page_len"])):
            pages = a["indices"][a["indptr"][i] : a["indptr"][i + 1]].long()
            kv_len = (len(pages) - 1) * a["page_size"] + int(a["last_page_len"][i])
            keys = k_cache[pages].flatten(0, 1)[:kv_len].float().repeat_interleave(a["group"], dim=1)
            values = v_cache[pages].flatten(0, 1)[:kv_len].float().repeat_interleave(a["group"], dim=1)
            rows = slice(int(a["qo_indptr"][i]), int(a["qo_indptr"][i + 1]))
            qo_len = rows.stop - rows.start
            scores = torch.einsum("ehd,shd->hes", q[rows].float(), keys) * a["sm_scale"]
            if a["logits_soft_cap"]:
                scores = torch.tanh(scores / a["logits_soft_cap"]) * a["logits_soft_cap"]
            # aligned bottom-right: row j is at kv position j + kv_len - qo_len (a decode: kv_len - 1)
            position = torch.arange(qo_len)[:, None] + kv_len - qo_len
            visible = torch.ones(qo_len, kv_len, dtype=torch.bool)
            if a["causal"]:
                visible &= torch.arange(kv_len)[None, :] <= position
            if a["window_left"] >= 0:  # and the window_left keys before it
                visible &= torch.arange(kv_len)[None, :] >= position - a["window_left"]
            scores = scores.masked_fill(~visible, float("-inf"))
            out[rows] = torch.einsum("hes,shd->ehd", scores.softmax(-1), values).to(q.dtype)
        return out


class _FakePrefillWrapper(_FakePagedWrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, *, causal=False, pos_encoding_mode="NONE", sm_scale=None, window_left=-1,
             logits_soft_cap=None, q_data_type="float16", kv_data_type=None) -> None:  # fmt: skip
        self._plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
                   head_dim_qk, page_size, causal, sm_scale, q_data_type, kv_data_type, pos_encoding_mode,
                   window_left, logits_soft_cap)  # fmt: skip


class _FakeDecodeWrapper(_FakePagedWrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             pos_encoding_mode="NONE", sm_scale=None, window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None) -> None:  # fmt: skip
        qo_indptr = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._plan(qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                   False, sm_scale, q_data_type, kv_data_type, pos_encoding_mode, window_left,
                   logits_soft_cap)  # fmt: skip


@pytest.mark.parametrize("specs", [MIXED, DECODE_ONLY, EXTEND_ONLY], ids=["mixed", "decode_only", "extend_only"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=lambda h: f"gqa{h[0] // h[1]}")
def test_flashinfer_backend_routing_with_fake_flashinfer(
    monkeypatch: pytest.MonkeyPatch, specs: list, page_size: int, heads: tuple
) -> None:
    fake = types.ModuleType("flashinfer")
    fake.BatchPrefillWithPagedKVCacheWrapper = _FakePrefillWrapper
    fake.BatchDecodeWithPagedKVCacheWrapper = _FakeDecodeWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    from radixrt.kernels.flashinfer_backend import FlashInferAttentionBackend

    case = make_case(specs, page_size, heads[0], heads[1], 64, torch.float16, "cpu", seed=3)
    check_backend(FlashInferAttentionBackend, case, page_size, workspace_bytes=4 * 1024 * 1024)


@pytest.mark.parametrize("attention", [LayerAttention(sliding_window=9), LayerAttention(70, 0.3, 4.0)],
                         ids=["window", "window-scale-softcap"])  # fmt: skip
def test_flashinfer_backend_layer_attention_with_fake_flashinfer(
    monkeypatch: pytest.MonkeyPatch, attention: LayerAttention
) -> None:
    """Windows, scales and score caps reach the wrappers' plan options (the fake applies them
    as FlashInfer documents); each LayerAttention plans its own wrappers."""
    fake = types.ModuleType("flashinfer")
    fake.BatchPrefillWithPagedKVCacheWrapper = _FakePrefillWrapper
    fake.BatchDecodeWithPagedKVCacheWrapper = _FakeDecodeWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    from radixrt.kernels.flashinfer_backend import FlashInferAttentionBackend

    case = make_case(MIXED, 16, 6, 2, 64, torch.float16, "cpu", seed=3)
    check_backend(FlashInferAttentionBackend, case, 16, attention, workspace_bytes=4 * 1024 * 1024)
