"""The GPU check's two stages that run existing suites: the benchmark suite's few-shot and
self-consistency workloads through `Runtime` (cache on against off), and the tests marked
`gpu` in tests/ (pass/fail/skip counts from pytest's JUnit XML)."""

from __future__ import annotations

import dataclasses
import time
import xml.etree.ElementTree as ElementTree
from collections import Counter
from typing import Any

import gpu_check_models as models
import torch
from gpu_check_stages import REPO, Context, attempt

WORKLOADS = ("few-shot-64", "self-consistency")
# the one skip the GPU run may show: FlashInfer did not travel
EXPECTED_SKIP = "flashinfer is not installed"


def stage_workloads(ctx: Context) -> None:
    """Each backend with the radix cache on and off, each workload once untimed (compiles,
    allocator) and once timed; greedy few-shot outputs compared across cache and backends."""
    from radixrt.benchmarks import workloads as suite_workloads

    s = ctx.settings
    loaded = models.loaded_model(s.workload_model, ctx.device, s.dtype)
    scale = dataclasses.replace(suite_workloads.FULL, **s.workload_scale)
    built = suite_workloads.build_workloads(loaded.tokenizer, scale, seed=0, names=WORKLOADS)
    if s.workload_cut is not None:
        built = [_cut(w, loaded.tokenizer, *s.workload_cut) for w in built]
    ctx.put("workload_info", {w.name: w.info for w in built})
    outputs: dict[str, list[tuple[int, ...]]] = {}
    for backend in ctx.backends:
        for cache in (True, False):
            key = f"{backend}/cache_{'on' if cache else 'off'}"
            attempt(ctx, key, lambda: _run_system(ctx, loaded, built, backend, cache, outputs, key))
    ctx.put("cache_speedup", {
        f"{b}/{w.name}": _ratio(ctx.result, f"{b}/cache_off", f"{b}/cache_on", w.name) for b in ctx.backends for w in built
    })  # fmt: skip
    ctx.put("greedy_agreement", _agreements(outputs, ctx.backends))


def _run_system(ctx: Context, loaded: Any, built: list, backend: str, cache: bool,
                outputs: dict[str, list[tuple[int, ...]]], key: str) -> dict[str, Any]:  # fmt: skip
    from radixrt.benchmarks import drivers
    from radixrt.benchmarks.systems import RadixSystem
    from radixrt.runtime import Runtime

    with models.gpu_backends_on_cpu() if ctx.dry_run else _nothing():
        runtime = Runtime(loaded, device=ctx.settings.device, dtype=str(ctx.settings.dtype).removeprefix("torch."),
                          attention_backend=backend, disable_radix_cache=not cache, deterministic=False,
                          max_total_tokens=ctx.settings.pool_tokens)  # fmt: skip
    system = RadixSystem.__new__(RadixSystem)  # its generate/cache_counts over this runtime
    system.name, system.runtime = key, runtime
    results = {}
    try:
        for workload in built:
            drivers.run_workload(workload, system, loaded.tokenizer)  # untimed: compiles, warms the allocator
            runtime.flush_cache()
            run = drivers.run_workload(workload, system, loaded.tokenizer)
            runtime.flush_cache()
            new_tokens = sum(c.num_output_tokens for c in run.completions)
            results[workload.name] = {
                "wall_s": run.wall_s, "output_tokens": new_tokens, "output_tokens_per_s": new_tokens / run.wall_s,
                "prompt_tokens": run.prompt_tokens, "cached_tokens": run.cached_tokens,
            }  # fmt: skip
            if workload.sampling.temperature == 0:
                outputs[f"{key}/{workload.name}"] = [tuple(c.output_ids) for c in run.completions]
    finally:
        runtime.shutdown()
        del runtime, system
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def _cut(workload: Any, tokenizer: Any, shared_tokens: int, own_tokens: int) -> Any:
    """The dry run's workload: the first `shared_tokens` of the shared prefix and the first
    `own_tokens` after it (the suite's few-shot prefix is 5 examples long at any scale)."""
    from radixrt.benchmarks.workloads import common_prefix_len

    if workload.kind == "fork":
        text = workload.prompt_text[: shared_tokens + own_tokens]  # the byte tokenizer: a character a token
        prompts: tuple[tuple[int, ...], ...] = (tuple(tokenizer.encode(text)),)
        workload = dataclasses.replace(workload, prompt_text=text, prompts=prompts)
    else:
        shared = common_prefix_len(workload.prompts)
        prompts = tuple(p[:shared_tokens] + p[shared : shared + own_tokens] for p in workload.prompts)
        workload = dataclasses.replace(workload, prompts=prompts)
    info = dict(workload.info, prompt_tokens_total=sum(map(len, prompts)), cut_to=[shared_tokens, own_tokens])
    return dataclasses.replace(workload, info=info)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _ratio(result: dict[str, Any], slow_key: str, fast_key: str, workload: str) -> float | None:
    try:
        return float(result[slow_key][workload]["wall_s"] / result[fast_key][workload]["wall_s"])
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def _agreements(outputs: dict[str, list[tuple[int, ...]]], backends: tuple[str, ...]) -> dict[str, Any]:
    """Share of greedy requests whose whole output matches, for each pair compared."""
    pairs = [(f"{b}/cache_on", f"{b}/cache_off") for b in backends]
    pairs += [("torch/cache_on", f"{b}/cache_on") for b in backends if b != "torch"]
    found: dict[str, Any] = {}
    for a, b in pairs:
        for name in WORKLOADS:
            left, right = outputs.get(f"{a}/{name}"), outputs.get(f"{b}/{name}")
            if left is not None and right is not None:
                found[f"{a} vs {b} ({name})"] = sum(x == y for x, y in zip(left, right)) / len(left)
    return found


def stage_gpu_tests(ctx: Context) -> None:
    """pytest -m gpu over tests/ in this process (the dry run's hidden packages stay hidden);
    on the GPU with xdist workers when pytest-xdist is there, since compiling dominates."""
    import importlib.util

    import pytest

    xml_path = ctx.out_dir / "gpu_tests.xml"
    # only the files that hold GPU tests: the others may import what the machine lacks (fastapi)
    files = sorted(str(p) for p in (REPO / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())
    args = ["-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={xml_path}", *files]
    if ctx.pytest_k:
        args[:0] = ["-k", ctx.pytest_k]
    workers = ctx.settings.pytest_workers
    if workers and importlib.util.find_spec("xdist") is not None:
        args[:0] = ["-n", str(workers)]
    ctx.put("pytest_args", args)
    started = time.perf_counter()
    code = pytest.main(args, plugins=[_LiveCounts(ctx)])
    ctx.put("exit_code", int(code))
    ctx.put("wall_s", time.perf_counter() - started)
    counts = junit_counts(xml_path)
    ctx.put("counts", counts)
    if int(code) not in (0, 5) or counts["failed"] or counts["errors"]:  # 5: none collected/selected
        raise RuntimeError(f"pytest exit code {int(code)}: {counts['failed']} failed, {counts['errors']} errors")


class _LiveCounts:
    """Outcomes as the tests finish (xdist forwards its workers' reports here), so a run
    killed at its timeout still reports how far it got; the JUnit report is written only at the end."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.counts: Counter[str] = Counter()

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed:
            self.counts["failed" if report.when == "call" else "errors"] += 1
        elif report.skipped:
            self.counts["skipped"] += 1
        elif report.when == "call":
            self.counts["passed"] += 1
        else:
            return
        self.ctx.put("live_counts", dict(self.counts), echo=False)


def junit_counts(xml_path: Any) -> dict[str, Any]:
    """passed/failed/errors/skipped from pytest's JUnit XML, skips grouped by reason, failures named."""
    root = ElementTree.parse(xml_path).getroot()
    cases = list(root.iter("testcase"))
    reasons: Counter[str] = Counter()
    failed, errors = [], []
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        for child in case:
            if child.tag == "skipped":
                reasons[(child.get("message") or "").removeprefix("Skipped: ")[:120]] += 1
            elif child.tag == "failure":
                failed.append(f"{name}: {(child.get('message') or '')[:300]}")
            elif child.tag == "error":
                errors.append(f"{name}: {(child.get('message') or '')[:300]}")
    skipped = sum(reasons.values())
    return {
        "tests": len(cases), "passed": len(cases) - skipped - len(failed) - len(errors), "failed": len(failed),
        "errors": len(errors), "skipped": skipped, "skip_reasons": dict(reasons),
        "unexpected_skips": sum(n for reason, n in reasons.items() if EXPECTED_SKIP not in reason),
        "failures": (failed + errors)[:20],
    }  # fmt: skip
