"""The GPU check's stages, each run in its own process by `gpu_check.py` (which owns the
timeouts, the log and the JSON).

A stage gets a `Context`: the settings (`GPU` or `DRY`, the dry run's tiny shapes on the
CPU under TRITON_INTERPRET=1), the backends to measure, and `put(key, value)`, which
rewrites the stage's result file at once, so a stage killed at its timeout still
reports what it finished. Per item (a backend, a batch size) an error is recorded with
its message and the stage goes on.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gpu_check_models as models
import torch

from radixrt.kernels.forward_batch import ForwardBatch
from radixrt.memory.kv_cache import KVCache

REPO = Path(__file__).resolve().parent.parent
RATIO_LIMIT = 1e-2  # max |Δlogit| / std(row), the bound for bf16
BENCH_PAGE_SIZE = 16  # prefill and decode figures (FlashInfer reads pages; the Triton kernels slots)


@dataclass(frozen=True)
class Settings:
    device: str
    dtype: torch.dtype
    models: tuple[str, ...]  # correctness, prefill and decode
    workload_model: str
    shared_prefix: int  # tokens of the correctness batches' shared prompt
    extends: tuple[int, ...]  # new tokens of the requests sharing it
    prefill_shape: tuple[int, int]  # prompts, tokens each
    decode_batches: tuple[int, ...]
    decode_context: int
    steps: tuple[int, int]  # warm-up and timed repetitions
    copy_bytes: int
    workload_scale: dict[str, Any]
    workload_cut: tuple[int, int] | None  # the dry run's: shared prefix and own tokens kept per prompt
    pool_tokens: int
    pytest_workers: int


GPU = Settings(
    device="cuda", dtype=torch.bfloat16, models=("smollm2-135m", "llama-1b"), workload_model="smollm2-135m",
    shared_prefix=200, extends=(5, 33, 70), prefill_shape=(4, 1024), decode_batches=(1, 16, 64, 256),
    decode_context=512, steps=(2, 8), copy_bytes=1 << 30, workload_scale={}, workload_cut=None, pool_tokens=1 << 17,
    pytest_workers=8,
)  # fmt: skip
# bf16 is left out of the dry run: the interpreter reads bf16 tensors as zeros
DRY = Settings(
    device="cpu", dtype=torch.float32, models=("tiny",), workload_model="tiny", shared_prefix=20,
    extends=(3, 9, 17), prefill_shape=(2, 12), decode_batches=(1, 3), decode_context=8, steps=(1, 2),
    copy_bytes=1 << 24,
    workload_scale=dict(few_shot_prefix_tokens=24, few_shot_questions=(3, 2), few_shot_new_tokens=(2, 2),
                        question_tokens=16, num_samples=2, sample_new_tokens=2),
    workload_cut=(40, 6),
    pool_tokens=4096, pytest_workers=0,
)  # fmt: skip


@dataclass
class Context:
    settings: Settings
    dry_run: bool
    backends: tuple[str, ...]  # measured; "torch" is also every comparison's reference
    out_dir: Path
    result_path: Path
    pytest_k: str | None = None  # gpu_tests: pytest -k
    result: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        """With its index on CUDA: a model's device is "cuda:0", and ModelRunner wants the pool's equal."""
        return torch.device("cuda", 0) if self.settings.device == "cuda" else torch.device(self.settings.device)

    def put(self, key: str, value: Any, echo: bool = True) -> None:
        self.result[key] = value
        tmp = self.result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str))
        tmp.replace(self.result_path)
        if echo:
            print(f"  {key}: {json.dumps(value, default=str)[:300]}", flush=True)


def attempt(ctx: Context, key: str, fn: Callable[[], Any]) -> Any:
    """Run one item now (so a closure over loop variables is safe); on an error record
    {"error": message} under `key` and go on."""
    try:
        value = fn()
    except Exception as error:  # noqa: BLE001 - the point is to report any failure and continue
        traceback.print_exc()
        value = {"error": f"{type(error).__name__}: {error}"[:2000]}
    ctx.put(key, value)
    return value


# ---------------------------------------------------------------- env


def stage_env(ctx: Context) -> None:
    ctx.put("python", platform.python_version())
    ctx.put("torch", torch.__version__)
    ctx.put("cuda_available", torch.cuda.is_available())
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        ctx.put("device_name", props.name)
        ctx.put("capability", list(torch.cuda.get_device_capability(0)))
        ctx.put("multiprocessors", props.multi_processor_count)
        ctx.put("memory_gib", round(props.total_memory / 2**30, 1))
    packages = {}
    for name in ("triton", "flashinfer", "transformers", "tokenizers", "safetensors", "xdist", *models.ABSENT_ON_GPU_MACHINE):
        found = importlib.util.find_spec(name) is not None if name not in sys.modules or sys.modules[name] else False
        packages[name] = _version(name) if found else None
    ctx.put("packages", packages)
    ctx.put("nvcc_path", shutil.which("nvcc"))
    ctx.put("CUDA_HOME", os.environ.get("CUDA_HOME"))
    for tool, args in (("nvidia-smi", ["--query-gpu=name,driver_version,memory.total,clocks.sm", "--format=csv,noheader"]),
                       ("nvcc", ["--version"])):  # fmt: skip
        ctx.put(tool, _run_tool(tool, args))
    # every module the stages import, so a missing package shows here first
    for module in ("radixrt", "radixrt.runtime", "radixrt.benchmarks.drivers", "radixrt.kernels.triton_backend",
                   "radixrt.kernels.triton_attention"):  # fmt: skip
        attempt(ctx, f"import {module}", lambda: __import__(module) and "ok")


def _version(name: str) -> str:
    from importlib import metadata

    dist = {"xdist": "pytest-xdist", "flashinfer": "flashinfer-python"}.get(name, name)
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "found (no metadata)"


def _run_tool(tool: str, args: list[str]) -> str:
    try:
        done = subprocess.run([tool, *args], capture_output=True, text=True, timeout=20)
        return (done.stdout or done.stderr).strip().splitlines()[-1] if (done.stdout or done.stderr) else ""
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"not run: {error}"


# ---------------------------------------------------------------- correctness


def stage_correctness(ctx: Context) -> None:
    """Each backend against torch on three steps of one pool: prompts (one of them the shared
    prompt); then decodes, extends over the shared prompt's whole pages and a fresh prompt;
    then decodes of all with one more extend. Pages are handed out in a shuffled order."""
    s = ctx.settings
    for name in s.models:
        config = models.MODELS[name]
        model = models.random_model(config, ctx.device, s.dtype)
        exact = models.random_model(config, ctx.device, torch.float32) if s.dtype != torch.float32 else None
        if exact is not None:  # the same weights, rounded once: what bf16 itself costs
            with torch.no_grad():
                for low, high in zip(model.parameters(), exact.parameters()):
                    high.copy_(low)
        for page_size in (1, 16):
            steps = _correctness_steps(s, config.vocab_size, page_size)
            reference = _run_steps(model, "torch", steps, page_size, ctx)
            if exact is not None:
                attempt(ctx, f"{name}/page{page_size}/torch_vs_float32",
                        lambda: _compare(reference, _run_steps(exact, "torch", steps, page_size, ctx)))
            for backend in ctx.backends:
                if backend != "torch":
                    attempt(ctx, f"{name}/page{page_size}/{backend}",
                            lambda: _compare(_run_steps(model, backend, steps, page_size, ctx), reference))
        del model, exact
        _empty_cache(ctx)


def _correctness_steps(s: Settings, vocab: int, page_size: int) -> list[tuple[list[list[int]], list[int], list[torch.Tensor]]]:
    """Three batches (new tokens, prefix lengths, slot lists) over scattered pages."""
    gen = torch.Generator().manual_seed(page_size)
    prompt_len, other_len, fresh_len = s.shared_prefix, s.extends[1] + 4, s.extends[2]
    shared = (prompt_len // page_size) * page_size  # whole pages: what the tree would share
    lengths = [prompt_len + 2, other_len + 2, fresh_len + 2] + [prompt_len + e + 2 for e in s.extends] * 2
    num_pages = sum(-(-n // page_size) for n in lengths) + 4
    order = iter(torch.randperm(num_pages, generator=gen).tolist())

    def pages_for(num: int) -> torch.Tensor:
        pages = torch.tensor([next(order) for _ in range(-(-num // page_size))])
        return (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:num]

    def tokens(n: int) -> list[int]:
        return torch.randint(256, vocab, (n,), generator=gen).tolist()

    prompt = tokens(prompt_len)
    owner = pages_for(prompt_len + 2)
    other, fresh = tokens(other_len), tokens(fresh_len)
    other_slots, fresh_slots = pages_for(other_len + 2), pages_for(fresh_len + 2)
    sharers = [(prompt + tokens(e), torch.cat([owner[:shared], pages_for(prompt_len + e + 2 - shared)]))
               for e in (*s.extends, s.extends[0] + 1)]  # fmt: skip
    step1 = ([prompt, other], [0, 0], [owner[:prompt_len], other_slots[:other_len]])
    step2_new = [tokens(1), tokens(1), fresh] + [ids[shared:] for ids, _ in sharers[:3]]
    step2_prefix = [prompt_len, other_len, 0] + [shared] * 3
    step2_slots = [owner[: prompt_len + 1], other_slots[: other_len + 1], fresh_slots[:fresh_len]]
    step2_slots += [slots[: len(ids)] for ids, slots in sharers[:3]]
    lengths2 = [p + len(n) for p, n in zip(step2_prefix, step2_new)]
    last_ids, last_slots = sharers[3]
    step3_new = [tokens(1) for _ in lengths2] + [last_ids[shared:]]
    step3_slots = [slots_of_seq[: n + 1] for slots_of_seq, n in zip(
        [owner, other_slots, fresh_slots] + [slots for _, slots in sharers[:3]], lengths2)] + [last_slots[: len(last_ids)]]
    step3_prefix = lengths2 + [shared]
    return [step1, (step2_new, step2_prefix, step2_slots), (step3_new, step3_prefix, step3_slots)]


def _run_steps(model: Any, backend_name: str, steps: list, page_size: int, ctx: Context) -> list[torch.Tensor]:
    """Every new token's logits (float32, on the CPU) of each step, through `backend_name` on a fresh pool."""
    from radixrt.model.runner import ModelRunner

    config = model.config
    num_slots = 1 + max(int(slots.max()) for _, _, slot_lists in steps for slots in slot_lists)
    cache = KVCache(config.kv_shape(model.dtype), _whole_pages(num_slots), ctx.device)
    runner = ModelRunner(model, cache, models.make_backend(backend_name, cache, config, page_size))
    logits = []
    for new, prefix, slots in steps:
        batch = ForwardBatch.build(new, prefix, slots, ctx.device)
        rows = torch.arange(batch.num_tokens, device=ctx.device)
        logits.append(runner.forward(batch, rows).float().cpu())
    return logits


def _compare(got: list[torch.Tensor], expected: list[torch.Tensor]) -> dict[str, Any]:
    ratios, agree, rows = [], 0, 0
    for g, e in zip(got, expected):
        ratios.append(float(((g - e).abs().amax(dim=1) / e.std(dim=1)).max()))
        agree += int((g.argmax(dim=1) == e.argmax(dim=1)).sum())
        rows += e.shape[0]
    worst = max(ratios)
    finite = all(bool(torch.isfinite(g).all()) for g in got)
    return {"max_dlogit_over_std": worst, "per_step": ratios, "ok": finite and worst <= RATIO_LIMIT,
            "greedy_agreement": agree / rows, "rows": rows}  # fmt: skip


# ---------------------------------------------------------------- hbm, prefill, decode


def stage_hbm(ctx: Context) -> None:
    """Device-to-device copy rate, counting bytes read and written, and each model's decode floor."""
    n = ctx.settings.copy_bytes
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    seconds = models.median_seconds(lambda: dst.copy_(src), ctx.device, 3, 10)
    rate = 2 * n / seconds
    ctx.put("copy_gb_per_s", rate / 1e9)
    for name in ctx.settings.models:
        weights = models.weight_bytes(models.MODELS[name], ctx.settings.dtype)
        ctx.put(f"{name}/floor", {"weight_bytes": weights, "floor_ms": 1e3 * weights / rate})


def stage_prefill(ctx: Context) -> None:
    prompts, length = ctx.settings.prefill_shape
    for name in ctx.settings.models:
        config = models.MODELS[name]
        model = models.random_model(config, ctx.device, ctx.settings.dtype)
        new = torch.randint(256, config.vocab_size, (prompts, length)).tolist()
        slots = _page_aligned_slots(prompts, length)
        for backend in ctx.backends:
            attempt(ctx, f"{name}/{backend}", lambda: _time_prefill(ctx, model, backend, new, slots))
        del model
        _empty_cache(ctx)


def _time_prefill(ctx: Context, model: Any, backend: str, new: list, slots: list) -> dict[str, Any]:
    runner = _runner(ctx, model, backend, 1 + max(int(s.max()) for s in slots))
    batch = ForwardBatch.build(new, [0] * len(new), slots, ctx.device)
    seconds = models.median_seconds(lambda: runner.forward(batch), ctx.device, *ctx.settings.steps)
    return {"tokens": batch.num_tokens, "ms": 1e3 * seconds, "tokens_per_s": batch.num_tokens / seconds}


def stage_decode(ctx: Context) -> None:
    """Decode steps over a pool of random K/V (values do not change the cost), the batch built
    every step as the engine does; a fresh slot per token."""
    s = ctx.settings
    for name in s.models:
        config = models.MODELS[name]
        model = models.random_model(config, ctx.device, s.dtype)
        for batch_size in s.decode_batches:
            for backend in ctx.backends:
                attempt(ctx, f"{name}/{backend}/batch{batch_size}",
                        lambda: _time_decode(ctx, model, backend, batch_size))  # fmt: skip
        del model
        _empty_cache(ctx)


def _time_decode(ctx: Context, model: Any, backend: str, batch_size: int) -> dict[str, Any]:
    warmups, reps = ctx.settings.steps
    context = ctx.settings.decode_context
    per_seq = context + warmups + reps
    slots = _page_aligned_slots(batch_size, per_seq)
    runner = _runner(ctx, model, backend, 1 + int(slots[-1].max()))
    for layer in range(model.config.num_layers):
        runner.kv_cache.k[layer].normal_()
        runner.kv_cache.v[layer].normal_()
    tokens = [[300 % model.config.vocab_size]] * batch_size
    length = [context]

    def step() -> None:
        n = length[0]
        runner.forward(ForwardBatch.build(tokens, [n] * batch_size, [s[: n + 1] for s in slots], ctx.device))
        length[0] = n + 1

    seconds = models.median_seconds(step, ctx.device, warmups, reps)
    return {"step_ms": 1e3 * seconds, "tokens_per_s": batch_size / seconds, "context": context}


def _page_aligned_slots(num_seqs: int, length: int) -> list[torch.Tensor]:
    """Each sequence's slots from the start of a page of BENCH_PAGE_SIZE."""
    stride = -(-length // BENCH_PAGE_SIZE) * BENCH_PAGE_SIZE
    return [torch.arange(i * stride, i * stride + length) for i in range(num_seqs)]


def _runner(ctx: Context, model: Any, backend: str, num_slots: int) -> Any:
    from radixrt.model.runner import ModelRunner

    cache = KVCache(model.config.kv_shape(ctx.settings.dtype), _whole_pages(num_slots), ctx.device)
    return ModelRunner(model, cache, models.make_backend(backend, cache, model.config, BENCH_PAGE_SIZE))


def _whole_pages(num_slots: int) -> int:
    """A pool of whole pages (FlashInfer views it as [pages, page_size, heads, dim])."""
    return -(-num_slots // BENCH_PAGE_SIZE) * BENCH_PAGE_SIZE


def _empty_cache(ctx: Context) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


def stage_hang(ctx: Context) -> None:
    """Not a stage of the check: one that never ends, for the test of the timeout path."""
    ctx.put("started", True)
    while True:
        time.sleep(1)


# ---------------------------------------------------------------- flashinfer


def stage_flashinfer_jit(ctx: Context) -> None:
    """FlashInfer compiles its kernels on first use: one mixed step per model shape (and dtype)
    here, so the later stages time kernels, not the compiler. The stage's timeout caps it."""
    ctx.put("build", _prepare_flashinfer_build())
    head_dims = tuple(sorted({models.MODELS[name].head_dim for name in ctx.settings.models}))
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability(ctx.device) == (9, 0)
    attempt(ctx, "modules", lambda: build_flashinfer_modules(ctx.settings.dtype, head_dims, hopper))
    for name in ctx.settings.models:
        config = models.MODELS[name]
        attempt(ctx, f"{name}/first_step_s", lambda: _first_flashinfer_step(ctx, config))


def build_flashinfer_modules(dtype: torch.dtype, head_dims: tuple[int, ...], hopper: bool) -> dict[str, Any]:
    """Compile, side by side, the modules radixrt's FlashInfer backend loads on its first steps
    (else they compile one after another inside them): the paged prefill (FA3 on Hopper, what
    the wrapper's "auto" picks there), the CUDA-core decode (GQA < 4) and the FA2 prefill that
    decode uses with tensor cores (GQA >= 4). Seconds per module, or its error. The wrappers then
    find them built (same generators, same arguments as flashinfer 0.7.2's wrappers pass)."""
    from concurrent.futures import ThreadPoolExecutor

    from flashinfer.jit.attention import modules as jit_modules

    specs = {}
    for d in head_dims:
        args = (dtype, dtype, dtype, torch.int32, d, d, 0, False, False)  # no rope, window or soft-cap
        for backend in ("fa3", "fa2") if hopper else ("fa2",):
            specs[f"prefill_{backend}_d{d}"] = jit_modules.gen_batch_prefill_module(backend, *args, False)
        specs[f"decode_d{d}"] = jit_modules.gen_batch_decode_module(*args)

    def build(spec: Any) -> float | str:
        started = time.perf_counter()
        try:
            spec.build(verbose=False)
        except Exception as error:  # noqa: BLE001 - reported per module
            return f"{type(error).__name__}: {str(error)[-1500:]}"
        return round(time.perf_counter() - started, 1)

    with ThreadPoolExecutor(len(specs)) as pool:
        return dict(zip(specs, pool.map(build, specs.values())))


def _prepare_flashinfer_build() -> dict[str, Any]:
    """Where FlashInfer's JIT (ninja, nvcc, c++) finds CUDA: CUDA_HOME, taken as a folder with
    bin/nvcc and include/cuda_runtime.h (`nvcc` on the PATH may be a wrapper script, whose
    parent's parent is no CUDA home: seen on the CPU machine); and an unversioned libcuda.so
    for `-lcuda`, linked into a folder on LIBRARY_PATH where only the driver's libcuda.so.1 is."""
    nvcc = shutil.which("nvcc")
    if "CUDA_HOME" not in os.environ:
        candidates = [Path("/usr/local/cuda"), *sorted(Path("/usr/local").glob("cuda-*"))]
        candidates += [Path(nvcc).resolve().parent.parent] if nvcc else []
        home = next((c for c in candidates
                     if (c / "bin" / "nvcc").is_file() and (c / "include" / "cuda_runtime.h").is_file()), None)  # fmt: skip
        if home is not None:
            os.environ["CUDA_HOME"] = str(home)
    home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    found: dict[str, Any] = {"nvcc": nvcc, "CUDA_HOME": os.environ.get("CUDA_HOME")}
    dirs = [home / "lib64" / "stubs", home / "lib64", Path("/usr/local/nvidia/lib64"), Path("/usr/lib/x86_64-linux-gnu"),
            Path("/usr/lib64"), *(Path(p) for p in os.environ.get("LIBRARY_PATH", "").split(os.pathsep) if p)]  # fmt: skip
    unversioned = next((d / "libcuda.so" for d in dirs if (d / "libcuda.so").exists()), None)
    found["libcuda.so"] = str(unversioned) if unversioned else None
    if unversioned is None:
        versioned = next((d / "libcuda.so.1" for d in dirs if (d / "libcuda.so.1").exists()), None)
        if versioned is None:
            listed = _run_tool("sh", ["-c", "ldconfig -p | grep -m1 'libcuda.so.1 ' | sed 's/.*=> //'"])
            versioned = Path(listed) if listed.startswith("/") else None
        if versioned is not None:
            folder = Path(tempfile.mkdtemp(prefix="gpu_check_libcuda_"))
            (folder / "libcuda.so").symlink_to(versioned)
            os.environ["LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(folder), os.environ.get("LIBRARY_PATH")]))
            found["libcuda.so"] = f"{folder / 'libcuda.so'} -> {versioned}"
    found["curand headers"] = _curand_headers(home / "include")
    return found


def _curand_headers(cuda_include: Path) -> str | None:
    """FlashInfer's sm90 prefill includes cutlass headers that include curand_kernel.h, which a
    trimmed CUDA toolkit may lack (the CPU machine's does); torch's CUDA wheels bring it as the
    pip package nvidia-curand. Its headers alone (not that package's whole include folder, whose
    CUDA headers may differ from nvcc's) go to every nvcc call through NVCC_APPEND_FLAGS."""
    if (cuda_include / "curand_kernel.h").is_file():
        return str(cuda_include)
    import site

    roots = [*sys.path, *site.getsitepackages()]
    found = next((h.parent for r in roots if r for h in Path(r).glob("nvidia/*/include/curand_kernel.h")), None)
    if found is None:
        return None
    folder = Path(tempfile.mkdtemp(prefix="gpu_check_curand_"))
    for header in found.glob("curand*.h"):
        (folder / header.name).symlink_to(header)
    os.environ["NVCC_APPEND_FLAGS"] = f"{os.environ.get('NVCC_APPEND_FLAGS', '')} -I{folder}".strip()
    return f"{folder} -> {found}"


def _first_flashinfer_step(ctx: Context, config: Any) -> float:
    cache = KVCache(config.kv_shape(ctx.settings.dtype), 256, ctx.device)
    backend = models.make_backend("flashinfer", cache, config, BENCH_PAGE_SIZE)
    slots = _page_aligned_slots(3, 40)
    batch = ForwardBatch.build([[1] * 9, [2], [3] * 40], [31, 39, 0], slots, ctx.device)
    shape = (batch.num_tokens, config.num_kv_heads, config.head_dim)
    q = torch.randn((batch.num_tokens, config.num_heads, config.head_dim), device=ctx.device, dtype=ctx.settings.dtype)
    k, v = (torch.randn(shape, device=ctx.device, dtype=ctx.settings.dtype) for _ in range(2))
    started = time.perf_counter()
    out = backend.forward(q, k, v, 0, batch, backend.plan(batch))
    models.synchronize(ctx.device)
    if not bool(torch.isfinite(out).all()):
        raise RuntimeError("FlashInfer's first step wrote non-finite values")
    return time.perf_counter() - started
