"""The suite's outputs: results.json (everything), results.md (the tables), and the machine they came from.

results.json
    suite      command line, scale, repetitions, seed, start time, duration, load averages
    machine    CPU model, logical cores, memory, GPU, torch/transformers/python versions, device, dtype
    workloads  per workload: description, kind, exact token counts, sampling settings
    results    per workload, per system: the medians (metrics.SUMMARY_FIELDS, plus the
               first-vs-rest TTFT of sequential workloads) and every repetition's figures
    ratios     per workload: radixrt's throughput over each other system's
    targets    the issue's goals on the bundled model: value, goal, met (None: not measured);
               results.md judges them only in a full run
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

RATIO_PAIRS = (("radixrt", "transformers"), ("radixrt", "radixrt-no-cache"), ("radixrt-no-cache", "transformers"),
               ("radixrt", "radixrt-nondeterministic"))


def machine(device: str, dtype: torch.dtype, model_name: str) -> dict[str, Any]:
    """What the figures were measured on; the load average tells how busy the (shared) machine was."""
    import transformers

    import radixrt

    cuda = device.startswith("cuda")
    return {
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "device": "cuda" if cuda else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "model": model_name,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "radixrt": radixrt.__version__,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per workload, output tokens/s of one system over another's (> 1: the first is faster)."""
    out: dict[str, dict[str, float]] = {}
    for workload, by_system in results.items():
        for top, bottom in RATIO_PAIRS:
            if top in by_system and bottom in by_system and by_system[bottom]["output_tokens_per_s"] > 0:
                ratio = by_system[top]["output_tokens_per_s"] / by_system[bottom]["output_tokens_per_s"]
                out.setdefault(workload, {})[f"{top}/{bottom}"] = ratio
    return out


def targets(results: dict[str, dict[str, Any]], speedups: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """The issue's goals (reported, never asserted); value None when the run did not measure it."""
    def radix(workload: str, field: str) -> float | None:
        return results.get(workload, {}).get("radixrt", {}).get(field)

    def speedup(workload: str, pair: str) -> float | None:
        return speedups.get(workload, {}).get(pair)

    first, rest = radix("table", "ttft_first_s"), radix("table", "ttft_rest_p50_s")
    goals = [
        ("few-shot-64: throughput, cache on / cache off",
         speedup("few-shot-64", "radixrt/radixrt-no-cache"), ">=", 3.0),
        ("few-shot-64: throughput, radixrt / transformers", speedup("few-shot-64", "radixrt/transformers"), ">=", 3.0),
        ("table: TTFT of a hit / TTFT of the miss", rest / first if first and rest else None, "<=", 1 / 8),
        ("self-consistency: cache hit rate", radix("self-consistency", "hit_rate"), ">=", 0.8),
        ("self-consistency: throughput, radixrt / transformers",
         speedup("self-consistency", "radixrt/transformers"), ">=", 2.0),
        ("chat: cache hit rate", radix("chat", "hit_rate"), ">=", 0.6),
        ("chat: throughput, radixrt / transformers", speedup("chat", "radixrt/transformers"), ">=", 2.0),
    ]
    return [
        {"target": name, "value": value, "goal": f"{op} {goal:.3g}",
         "met": None if value is None else (value >= goal if op == ">=" else value <= goal)}
        for name, value, op, goal in goals
    ]


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.write_text(json.dumps(report, indent=1, default=float) + "\n")


def markdown(report: dict[str, Any]) -> str:
    """The human-readable tables: workloads, results per system, ratios, targets."""
    suite, host = report["suite"], report["machine"]
    lines = [
        "# radixrt benchmark suite", "",
        f"`{suite['command']}`", "",
        f"{host['model']} on {host['gpu'] or host['cpu']} ({host['logical_cores']} logical cores, "
        f"{host['device']}, {host['dtype']}); torch {host['torch']}, transformers {host['transformers']}. "
        f"Median of {suite['reps']} repetition(s) after a warm-up; load average "
        f"{suite['load_average_before'][0]:.2f} before, {suite['load_average_after'][0]:.2f} after; "
        f"{suite['duration_s']:.0f} s in all.", "",
        "| workload | requests | prompt tokens | shared prefix | new tokens | sampling |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, info in report["workloads"].items():
        if "prompt_tokens_min" in info:
            prompt = f"{info['prompt_tokens_min']}–{info['prompt_tokens_max']}"
        else:  # chat: later turns depend on the answers
            prompt = f"{info['first_turn_prompt_tokens']} (turn 1)"
        sampling = "greedy" if info["temperature"] == 0 else f"T={info['temperature']}"
        warm = ", prefix warm" if info["warm_prefix"] else ""
        lines.append(f"| {name} | {info['requests']} | {prompt} | {info['shared_prefix_tokens']} "
                     f"| {info['max_new_tokens']} | {sampling}{warm} |")
    lines += ["", "| workload | system | wall s | out tok/s | TTFT p50 s | TTFT p99 s | e2e p50 s | e2e p99 s "
              "| prompt tok | cached tok | hit rate | vs transformers |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for workload, by_system in report["results"].items():
        for system, r in by_system.items():
            speedup = report["ratios"].get(workload, {}).get(f"{system}/transformers")
            lines.append(
                f"| {workload} | {system} | {r['wall_s']:.2f} | {r['output_tokens_per_s']:.1f} | {r['ttft_p50_s']:.3f} "
                f"| {r['ttft_p99_s']:.3f} | {r['e2e_p50_s']:.3f} | {r['e2e_p99_s']:.3f} | {r['prompt_tokens']:.0f} "
                f"| {r['cached_tokens']:.0f} | {r['hit_rate']:.1%} | {'-' if speedup is None else f'{speedup:.2f}x'} |"
            )
    table = report["results"].get("table", {})
    if table:
        lines += ["", "Table workload, TTFT of the first question against the other questions' median:", ""]
        lines += [f"- {system}: first {r['ttft_first_s']:.3f} s, rest {r['ttft_rest_p50_s']:.3f} s "
                  f"({r['ttft_first_s'] / r['ttft_rest_p50_s']:.1f}x)" for system, r in table.items()]
    lines += ["", *_targets_table(report["targets"], judged=suite["scale"] != "quick")]
    return "\n".join(lines) + "\n"


def _targets_table(targets: list[dict[str, Any]], judged: bool) -> list[str]:
    """The goals with their values; a --quick run's workloads are too small to measure anything,
    so its table shows the values without a verdict."""
    if not judged:
        lines = ["A --quick run is a smoke run, not a measurement: the targets are shown, not judged.", "",
                 "| target | value | goal |", "|---|---:|---|"]
    else:
        lines = ["| target | value | goal | met |", "|---|---:|---|---|"]
    for t in targets:
        value = "-" if t["value"] is None else f"{t['value']:.3g}"
        row = f"| {t['target']} | {value} | {t['goal']} |"
        if judged:
            row += " not measured |" if t["met"] is None else (" yes |" if t["met"] else " **no** |")
        lines.append(row)
    return lines
