"""The suite's command line: build the workloads, run every system on them, write the report.

    python -m radixrt.benchmarks [--quick] [--workloads table,chat] [--systems radixrt,transformers]
                                 [--reps 3] [--out bench/results] [--model PATH] [--device cpu] [--dtype auto]
    radixrt bench ...             (the same options)

Every system is loaded once and warmed up once (untimed); then each workload
runs `reps` times on it. On a CPU (`--order auto`) all systems stay loaded
and take turns within each repetition, so a change in a shared machine's load
falls on all of them alike; on a GPU they run one after the other (one
system holds memory at a time, so a KV pool can take its usual share).
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
from radixrt.benchmarks.system_api import System, resolved_device
from radixrt.benchmarks.systems import DEFAULT_SYSTEMS, SYSTEM_NAMES, make_system, model_folder
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
    p.add_argument("--quantize", choices=("q8_0", "q4_0"), default=None,
                   help="radixrt quantizes a dense model at load (Runtime(quantize=...))")
    p.add_argument("--workloads", default=",".join(WORKLOAD_NAMES),
                   help=f"comma-separated, of {','.join(WORKLOAD_NAMES)}")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma-separated, of {','.join(SYSTEM_NAMES)}")
    p.add_argument("--reps", type=int, default=None,
                   help="timed repetitions per workload and system (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny workloads: a smoke run (CI), not a measurement")
    p.add_argument("--order", choices=("auto", "interleaved", "system"), default="auto",
                   help="interleaved: all systems loaded, taking turns each repetition (fair under a changing "
                        "load); system: one system at a time (frees memory); auto: interleaved on cpu")
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
        "machine": reporting.machine(resolved_device(args.device), _dtype(args.device, args.dtype),
                                     _model_name(args.model)),
        "workloads": {w.name: w.info for w in workloads},
        "results": {w.name: {} for w in workloads},
    }
    started = time.perf_counter()
    interleaved = args.order == "interleaved" or (args.order == "auto" and report["machine"]["device"] == "cpu")
    report["suite"]["order"] = "interleaved" if interleaved else "system"
    for group in [system_names] if interleaved else [(name,) for name in system_names]:
        systems: list[System] = []
        try:
            for name in group:
                _log(f"{name}: loading")
                systems.append(make_system(name, args.model, args.device, args.dtype, args.attention_backend,
                                           args.page_size, args.quantize))
                _warm_up(systems[-1], workloads)
            for workload in workloads:
                for system_name, summary in _measure(systems, workload, tokenizer, reps).items():
                    report["results"][workload.name][system_name] = summary
                _finish(report, args.out, started, plots=False)  # a crash later keeps what is done
        finally:
            for system in systems:
                system.close()
            systems.clear()
            gc.collect()
    paths = _finish(report, args.out, started, plots=True)
    print(reporting.markdown(report))
    _log("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _measure(systems: list[System], workload: Workload, tokenizer: Any, reps: int) -> dict[str, dict[str, Any]]:
    """`reps` repetitions of the workload on each system, the systems taking turns within a
    repetition, so a change in the machine's load falls on all of them alike."""
    metrics: dict[str, list[RepMetrics]] = {system.name: [] for system in systems}
    for rep in range(reps):
        for system in systems:
            system.reset()
            prime(workload, system)
            load = os.getloadavg()[0]
            run = run_workload(workload, system, tokenizer)
            metrics[system.name].append(RepMetrics.from_run(run, load))
            _log(f"  {workload.name} rep {rep + 1}/{reps} {system.name}: {run.wall_s:.2f} s (load {load:.2f})")
    return {name: summarize(reps_of, sequential=workload.kind == "sequential") for name, reps_of in metrics.items()}


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
        raise SystemExit(f"radixrt bench: {option} takes a comma-separated list of {', '.join(accepted)}; "
                         f"got {value!r}")
    return names


def _dtype(device: str, dtype: str) -> Any:
    from radixrt.model.loader import resolve_device, resolve_dtype

    return resolve_dtype(dtype, resolve_device(resolved_device(device)))


def _model_name(model: str | None) -> str:
    from radixrt.model.loader import BUNDLED_MODEL_NAME

    return BUNDLED_MODEL_NAME if model is None else Path(model).name


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
