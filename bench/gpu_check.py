"""One command for a lent GPU machine: radixrt's GPU path checked and measured in under 5 minutes.

    python3 bench/gpu_check.py OUT_DIR                 # on the GPU machine (docs/benchmarks.md, "GPU check")
    python3 bench/gpu_check.py OUT_DIR --dry-run       # here: the same stages, tiny, on the CPU

Each stage runs in its own process under its own timeout (the process group is
killed at the timeout, so a hung kernel cannot hold the GPU); a stage that
outlives its budget is reported, not fatal; a failed import or compile is
recorded with its message and the next stage starts. Stage timeouts are cut
so the whole run ends by `--deadline-s`. Written into OUT_DIR: gpu_check.json
(every stage: status, wall time, budget, results), gpu_check.log (everything
the stages printed) and gpu_tests.xml (pytest's JUnit report). The last lines
printed are a short table.

The dry run runs the same Triton kernels under TRITON_INTERPRET=1 at tiny
shapes in float32 (the interpreter reads bf16 as zeros), with the packages the
GPU machine lacks hidden (`gpu_check_models.ABSENT_ON_GPU_MACHINE`).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from gpu_check_report import summary, summary_table  # beside this file: sys.path[0] when run as a script

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


@dataclass(frozen=True)
class Stage:
    name: str
    budget_s: float  # on the GPU; what the 5 minutes were planned with
    dry_budget_s: float  # on the project's 2-core CPU machine
    needs: str | None = None  # a package without which the stage is skipped, not started
    max_timeout_s: float | None = None  # a hard cap whatever the budget


STAGES = (
    Stage("env", 15, 30),
    Stage("flashinfer_jit", 150, 30, needs="flashinfer", max_timeout_s=180),  # the cap on its JIT
    Stage("correctness", 40, 60),
    Stage("gpu_tests", 90, 60),
    Stage("hbm", 10, 20),
    Stage("prefill", 25, 40),
    Stage("decode", 45, 60),
    Stage("workloads", 60, 90),
)
STAGE_NAMES = tuple(s.name for s in STAGES)
TIMEOUT_FACTOR = 1.5  # a stage may run this much over its budget before it is killed
GRACE_S = 5.0  # between SIGTERM and SIGKILL


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, Triton interpreted")
    p.add_argument("--stages", default=",".join(STAGE_NAMES), help=f"comma-separated, of {','.join(STAGE_NAMES)}")
    p.add_argument("--backends", default=None,
                   help="comma-separated, of torch,triton,flashinfer (default: torch, triton and flashinfer if installed)")
    p.add_argument("--pytest-k", default=None, help="gpu_tests: only the tests pytest -k selects")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="the whole run ends by then (default 300 on the GPU, 900 in the dry run)")
    p.add_argument("--stage", help=argparse.SUPPRESS)  # a child: run this one stage
    p.add_argument("--work-dir", type=Path, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.stage:
        return run_child(args.stage, args.work_dir)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGE_NAMES]
    if unknown:
        raise SystemExit(f"--stages: unknown {unknown}; choose from {list(STAGE_NAMES)}")
    if args.dry_run:
        _hide_absent_packages()
    backends = _backends(args.backends)
    deadline_s = args.deadline_s or (900.0 if args.dry_run else 300.0)
    return run_parent(args.out_dir, args.dry_run, stages, backends, deadline_s, argv or sys.argv[1:], args.pytest_k)


def _hide_absent_packages() -> None:
    sys.path.insert(0, str(HERE))
    import gpu_check_models

    gpu_check_models.hide_packages()


def _backends(value: str | None) -> tuple[str, ...]:
    if value is None:
        return ("torch", "triton") + (("flashinfer",) if importlib.util.find_spec("flashinfer") else ())
    names = tuple(b.strip() for b in value.split(",") if b.strip())
    bad = [b for b in names if b not in ("torch", "triton", "flashinfer")]
    if bad:
        raise SystemExit(f"--backends: unknown {bad}; choose from torch, triton, flashinfer")
    return names if "torch" in names else ("torch", *names)  # torch: every comparison's reference


def run_parent(out_dir: Path, dry_run: bool, stages: list[str], backends: tuple[str, ...], deadline_s: float,
               argv: list[str], pytest_k: str | None = None) -> int:  # fmt: skip
    started = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    (work_dir / "config.json").write_text(json.dumps(
        {"dry_run": dry_run, "backends": backends, "out_dir": str(out_dir.resolve()), "pytest_k": pytest_k}))  # fmt: skip
    report: dict[str, Any] = {
        "command": "python3 bench/gpu_check.py " + " ".join(argv), "date_utc": _now(), "dry_run": dry_run,
        "backends": list(backends), "deadline_s": deadline_s, "stages": [],
    }  # fmt: skip
    json_path = out_dir / "gpu_check.json"
    with open(out_dir / "gpu_check.log", "w") as log:
        _say(log, f"gpu_check {'(dry run) ' if dry_run else ''}{report['date_utc']}: stages {','.join(stages)}; "
                  f"backends {','.join(backends)}; deadline {deadline_s:.0f} s")  # fmt: skip
        chosen = [s for s in STAGES if s.name in stages]
        for i, stage in enumerate(chosen):
            budget = stage.dry_budget_s if dry_run else stage.budget_s
            entry: dict[str, Any] = {"name": stage.name, "budget_s": budget}
            left = deadline_s - (time.monotonic() - started)
            # leave the stages after this one at least half their budgets
            reserve = sum(0.5 * (s.dry_budget_s if dry_run else s.budget_s) for s in chosen[i + 1:])
            timeout = min(TIMEOUT_FACTOR * budget, stage.max_timeout_s or budget * 9, left - reserve, left - GRACE_S)
            if stage.needs and (dry_run or importlib.util.find_spec(stage.needs) is None):
                entry.update(status="skipped", error=f"{stage.needs} is not installed")
            elif timeout < 3:
                entry.update(status="not run", error=f"no time left ({left:.0f} s of the deadline)")
            else:
                entry.update(_run_stage(stage.name, work_dir, timeout, dry_run, log), timeout_s=round(timeout, 1))
                entry["overran"] = entry["wall_s"] > budget
            report["stages"].append(entry)
            _say(log, f"== {stage.name}: {entry['status']}" + (f" in {entry['wall_s']:.1f} s of {budget:.0f}"
                      if "wall_s" in entry else "") + (f" ({entry['error']})" if entry.get("error") else ""))  # fmt: skip
            _write(json_path, report, started)
        report["summary"] = summary(report)
        _write(json_path, report, started)
        _say(log, summary_table(report))
    shutil.rmtree(work_dir, ignore_errors=True)
    failed = [s["name"] for s in report["stages"] if s["status"] not in ("ok", "skipped")]
    return 1 if failed else 0


def _run_stage(name: str, work_dir: Path, timeout: float, dry_run: bool, log: TextIO) -> dict[str, Any]:
    """The stage in a child process (its own session, killed as a group at the timeout)."""
    result_path = work_dir / f"{name}.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        [str(REPO), str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]))  # fmt: skip
    if dry_run:
        env["TRITON_INTERPRET"] = "1"
    _say(log, f"== {name}: starting, timeout {timeout:.0f} s")
    command = [sys.executable, str(Path(__file__).resolve()), "-", "--stage", name, "--work-dir", str(work_dir)]
    started = time.monotonic()
    child = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)  # fmt: skip
    reader = threading.Thread(target=_copy_lines, args=(child.stdout, log, name), daemon=True)
    reader.start()
    status = "ok"
    try:
        code = child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        status, code = "timeout", None
        _kill_group(child)
    reader.join(timeout=GRACE_S)
    wall_s = time.monotonic() - started
    result = json.loads(result_path.read_text()) if result_path.is_file() else {}
    error = result.pop("_error", None)
    if status == "ok" and code != 0:
        status = "failed"
        error = error or f"exit code {code} (see gpu_check.log)"
    elif status == "timeout":
        error = f"killed after {timeout:.0f} s; results up to then kept"
    return {"status": status, "wall_s": round(wall_s, 2), "error": error, "result": result}


def _kill_group(child: subprocess.Popen[str]) -> None:
    for sig, wait_s in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, GRACE_S)):
        try:
            os.killpg(child.pid, sig)
            child.wait(timeout=wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def _copy_lines(stream: Any, log: TextIO, name: str) -> None:
    for line in stream:
        _say(log, f"[{name}] {line.rstrip()}")


_log_lock = threading.Lock()


def _say(log: TextIO, text: str) -> None:
    with _log_lock:
        print(text, flush=True)
        log.write(text + "\n")
        log.flush()


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _write(path: Path, report: dict[str, Any], started: float) -> None:
    report["total_wall_s"] = round(time.monotonic() - started, 1)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(path)


def run_child(name: str, work_dir: Path) -> int:
    """One stage: its function from gpu_check_stages / gpu_check_suite, its result file kept current."""
    config = json.loads((work_dir / "config.json").read_text())
    if config["dry_run"]:
        _hide_absent_packages()
    import gpu_check_stages as stages
    import gpu_check_suite as suite

    ctx = stages.Context(settings=stages.DRY if config["dry_run"] else stages.GPU, dry_run=config["dry_run"],
                         backends=tuple(config["backends"]), out_dir=Path(config["out_dir"]),
                         result_path=work_dir / f"{name}.json", pytest_k=config.get("pytest_k"))  # fmt: skip
    function = getattr(stages, f"stage_{name}", None) or getattr(suite, f"stage_{name}")
    try:
        function(ctx)
    except Exception as error:
        import traceback

        traceback.print_exc()
        ctx.put("_error", f"{type(error).__name__}: {error}"[:2000])
        return 1
    return 0

if __name__ == "__main__":
    sys.exit(main())
