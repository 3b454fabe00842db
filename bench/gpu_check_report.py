"""The GPU check's summary: the figures the issue asks for, pulled out of every stage's results,
and the short table printed last (the device tool returns the end of the output)."""

from __future__ import annotations

from typing import Any


def summary(report: dict[str, Any]) -> dict[str, Any]:
    results = {s["name"]: s.get("result", {}) for s in report["stages"]}
    env = results.get("env", {})
    out: dict[str, Any] = {
        "device": env.get("device_name") or ("cpu (dry run)" if report["dry_run"] else None),
        "versions": {"python": env.get("python"), "torch": env.get("torch"),
                     **{k: v for k, v in env.get("packages", {}).items() if k in ("triton", "flashinfer", "transformers")}},
        "stages": {s["name"]: s["status"] for s in report["stages"]},
        "overran": [s["name"] for s in report["stages"] if s.get("overran")],
    }  # fmt: skip
    out["correctness"] = {k: v for k, v in results.get("correctness", {}).items() if isinstance(v, dict)}
    tests = results.get("gpu_tests", {})
    live = tests.get("live_counts")  # a run killed at its timeout has only these
    out["gpu_tests"] = tests.get("counts") or (live and {
        "tests": sum(live.values()), "passed": live.get("passed", 0), "failed": live.get("failed", 0),
        "errors": live.get("errors", 0), "skipped": live.get("skipped", 0), "unexpected_skips": "?", "partial": True})
    out["prefill_tokens_per_s"] = _pick(results.get("prefill", {}), "tokens_per_s")
    out["decode_tokens_per_s"] = _pick(results.get("decode", {}), "tokens_per_s")
    hbm = results.get("hbm", {})
    out["copy_gb_per_s"] = hbm.get("copy_gb_per_s")
    out["decode_vs_floor"] = _decode_vs_floor(hbm, results.get("decode", {}))
    workloads = results.get("workloads", {})
    out["cache_speedup"] = workloads.get("cache_speedup")
    out["greedy_agreement"] = workloads.get("greedy_agreement")
    out["errors"] = [f"{stage}/{key}: {value['error']}" for stage, result in results.items()
                     for key, value in result.items() if isinstance(value, dict) and "error" in value]  # fmt: skip
    out["errors"] += [f"{s['name']}: {s['error']}" for s in report["stages"] if s.get("error") and s["status"] != "skipped"]
    out["skipped"] = [f"{s['name']}: {s['error']}" for s in report["stages"] if s["status"] == "skipped"]
    return out


def _pick(result: dict[str, Any], field: str) -> dict[str, Any]:
    return {k: v[field] for k, v in result.items() if isinstance(v, dict) and field in v}


def _decode_vs_floor(hbm: dict[str, Any], decode: dict[str, Any]) -> dict[str, Any]:
    """Batch-1 decode step against weight bytes / copy rate, per model and backend."""
    found = {}
    for key, value in decode.items():
        model, _, rest = key.partition("/")
        floor = hbm.get(f"{model}/floor")
        if rest.endswith("/batch1") and isinstance(value, dict) and "step_ms" in value and floor:
            found[key] = {"step_ms": value["step_ms"], "floor_ms": floor["floor_ms"],
                          "times_floor": value["step_ms"] / floor["floor_ms"]}  # fmt: skip
    return found


def summary_table(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = [f"== gpu_check summary ({'dry run, ' if report['dry_run'] else ''}{s['device']}, {report['date_utc']}, "
             f"{report['total_wall_s']:.0f} s of {report['deadline_s']:.0f})"]  # fmt: skip
    for stage in report["stages"]:
        wall = f"{stage['wall_s']:6.1f} s / {stage['budget_s']:.0f}" if "wall_s" in stage else " " * 8
        lines.append(f"  {stage['name']:<15} {stage['status']:<8} {wall}{'  OVERRAN' if stage.get('overran') else ''}")
    for key, value in s["correctness"].items():
        if "max_dlogit_over_std" in value:
            lines.append(f"  correct {key}: max|dlogit|/std {value['max_dlogit_over_std']:.2e} "
                         f"{'ok' if value['ok'] else 'FAIL'}, greedy {value['greedy_agreement']:.2f}")  # fmt: skip
    if s["gpu_tests"]:
        c = s["gpu_tests"]
        lines.append(f"  tests: {c['passed']} passed, {c['failed']} failed, {c['errors']} errors, {c['skipped']} "
                     f"skipped ({c['unexpected_skips']} not flashinfer's)")  # fmt: skip
    for key, value in s["prefill_tokens_per_s"].items():
        lines.append(f"  prefill {key}: {value:,.0f} tok/s")
    for key, value in s["decode_tokens_per_s"].items():
        lines.append(f"  decode {key}: {value:,.0f} tok/s")
    if s["copy_gb_per_s"]:
        lines.append(f"  copy: {s['copy_gb_per_s']:,.0f} GB/s (read + written)")
    for key, value in s["decode_vs_floor"].items():
        lines.append(f"  floor {key}: {value['step_ms']:.2f} ms, {value['times_floor']:.1f}x the {value['floor_ms']:.3f} ms floor")
    for key, value in (s["cache_speedup"] or {}).items():
        lines.append(f"  cache on vs off {key}: {value:.2f}x" if value else f"  cache on vs off {key}: n/a")
    for key, value in (s["greedy_agreement"] or {}).items():
        lines.append(f"  greedy agreement {key}: {value:.2f}")
    for skip in s["skipped"]:
        lines.append(f"  skipped {skip}")
    for error in s["errors"][:12]:
        lines.append(f"  ERROR {error[:200]}")
    return "\n".join(lines)
