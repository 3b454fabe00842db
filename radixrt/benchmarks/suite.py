"""The suite's command line: build the workloads, run every system on them, write the report.

    python -m radixrt.benchmarks [--quick] [--workloads table,chat] [--systems radixrt,transformers]
                                 [--reps 3] [--out bench/results] [--model PATH] [--device cpu] [--dtype auto]
    radixrt bench ...             (the same options)

Systems run one after the other in one process (system-major), each loaded
once, warmed up once (untimed), then every workload `reps` times. Only one
system holds memory at a time, so a GPU's KV pool can take its usual share.
Before each repetition the system's cache is flushed: repetitions start cold,
except that a `warm_prefix` workload then gets its shared prefix cached,
untimed.
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from radixrt.benchmarks import report as reporting
from radixrt.benchmarks.drivers import prime, run_workload
from radixrt.benchmarks.metrics import RepMetrics, summarize
from radixrt.benchmarks.plots import write_plots
from radixrt.benchmarks.systems import SYSTEM_NAMES, System, make_system, model_folder, resolved_device
from radixrt.benchmarks.workloads import FULL, QUICK, WORKLOAD_NAMES, Sampling, Workload, build_workloads


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="radixrt bench",
        description="Prefix-sharing workloads on radixrt (cache on and off) and transformers generate.",
    )
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 (GPU)")
    p.add_argument("--attention-backend", default="auto", help="radixrt's attention backend")
    p.add_argument("--page-size", type=int, default=1, help="radixrt's KV page size")
    p.add_argument("--workloads", default=",".join(WORKLOAD_NAMES), help=f"comma-separated, of {','.join(WORKLOAD_NAMES)}")
    p.add_argument("--systems", default=",".join(SYSTEM_NAMES), help=f"comma-separated, of {','.join(SYSTEM_NAMES)}")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per workload and system (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny workloads: a smoke run (CI), not a measurement")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload generators and of sampling")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for results.json, results.md, *.png")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    workload_names = _names(args.workloads, WORKLOAD_NAMES, "--workloads")
    system_names = _names(args.systems, SYSTEM_NAMES, "--systems")
    reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    if reps < 1:
        raise SystemExit("radixrt bench: --reps must be >= 1")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder(args.model))
    workloads = build_workloads(tokenizer, QUICK if args.quick else FULL, args.seed, workload_names)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "radixrt bench " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    report: dict[str, Any] = {
        "suite": {"command": command, "scale": "quick" if args.quick else "full", "reps": reps, "seed": args.seed,
                  "systems": list(system_names), "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "load_average_before": list(os.getloadavg())},
        "machine": reporting.machine(resolved_device(args.device), _dtype(args.device, args.dtype), _model_name(args.model)),
        "workloads": {w.name: w.info for w in workloads},
        "results": {w.name: {} for w in workloads},
    }
    started = time.perf_counter()
    for name in system_names:
        _log(f"{name}: loading")
        system = make_system(name, args.model, args.device, args.dtype, args.attention_backend, args.page_size)
        try:
            _warm_up(system, workloads)
            for workload in workloads:
                report["results"][workload.name][name] = _measure(system, workload, tokenizer, reps)
        finally:
            system.close()
            del system
            gc.collect()
        _finish(report, args.out, started, plots=False)  # a crash later keeps what is done
    paths = _finish(report, args.out, started, plots=True)
    print(reporting.markdown(report))
    _log("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _measure(system: System, workload: Workload, tokenizer: Any, reps: int) -> dict[str, Any]:
    metrics = []
    for rep in range(reps):
        system.reset()
        prime(workload, system)
        run = run_workload(workload, system, tokenizer)
        metrics.append(RepMetrics.from_run(run))
        _log(f"  {system.name} {workload.name} rep {rep + 1}/{reps}: {run.wall_s:.2f} s")
    return summarize(metrics, sequential=workload.kind == "sequential")


def _warm_up(system: System, workloads: list[Workload]) -> None:
    """One untimed greedy batch and one sampled fork on slices of the first prompt: first-call costs
    (allocator growth, thread pools, lazy imports) stay out of the timed repetitions."""
    source = next((w.prompts[0] for w in workloads if w.prompts), (1,) * 64)
    prompts = [source[: max(1, len(source) // 2)], source[: max(1, len(source) // 3)]]
    system.generate(prompts, Sampling(max_new_tokens=8))
    system.generate(prompts[:1], Sampling(max_new_tokens=8, temperature=0.7), n=2)
    system.reset()


def _finish(report: dict[str, Any], out: Path, started: float, plots: bool) -> list[Path]:
    report["suite"]["duration_s"] = time.perf_counter() - started
    report["suite"]["load_average_after"] = list(os.getloadavg())
    report["ratios"] = reporting.ratios(report["results"])
    report["targets"] = reporting.targets(report["results"], report["ratios"])
    paths = [out / "results.json", out / "results.md"]
    reporting.write_json(paths[0], report)
    paths[1].write_text(reporting.markdown(report))
    return paths + (write_plots(report, out) if plots else [])


def _names(value: str, accepted: tuple[str, ...], option: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = [n for n in names if n not in accepted]
    if unknown or not names:
        raise SystemExit(f"radixrt bench: {option} takes a comma-separated list of {', '.join(accepted)}; got {value!r}")
    return names


def _dtype(device: str, dtype: str) -> Any:
    from radixrt.model.loader import resolve_device, resolve_dtype

    return resolve_dtype(dtype, resolve_device(resolved_device(device)))


def _model_name(model: str | None) -> str:
    from radixrt.model.loader import BUNDLED_MODEL_NAME

    return BUNDLED_MODEL_NAME if model is None else Path(model).name


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
