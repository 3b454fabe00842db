"""bench/gpu_check.py's dry run: every stage of the GPU check run at tiny shapes on the CPU
(the Triton kernels under TRITON_INTERPRET=1, the GPU machine's absent packages hidden),
and its JSON, log and JUnit report written; and a stage past its timeout killed and reported."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.append(str(BENCH))  # after the real packages: no bench file shadows one

import gpu_check  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def test_dry_run_reports_every_stage(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), str(tmp_path), "--dry-run"],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    log = (tmp_path / "gpu_check.log").read_text()
    assert (tmp_path / "gpu_tests.xml").is_file()
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == list(gpu_check.STAGE_NAMES)
    assert stages["flashinfer_jit"]["status"] == "skipped"  # hidden, as on the GPU machine
    for name, stage in stages.items():
        assert f"== {name}: " in log
        if name != "flashinfer_jit":
            assert stage["status"] == "ok", stage
            assert stage["wall_s"] > 0 and stage["budget_s"] > 0 and stage["timeout_s"] > 0
    summary = report["summary"]
    assert summary["errors"] == []
    for page_size in (1, 16):
        result = summary["correctness"][f"tiny/page{page_size}/triton"]
        assert result["ok"] and result["max_dlogit_over_std"] < 1e-4 and result["greedy_agreement"] == 1.0
    assert summary["gpu_tests"]["tests"] > 0 and summary["gpu_tests"]["skip_reasons"] == {
        "needs CUDA": summary["gpu_tests"]["tests"]}
    for backend in ("torch", "triton"):
        assert summary["prefill_tokens_per_s"][f"tiny/{backend}"] > 0
        for batch in (1, 3):
            assert summary["decode_tokens_per_s"][f"tiny/{backend}/batch{batch}"] > 0
        assert summary["decode_vs_floor"][f"tiny/{backend}/batch1"]["times_floor"] > 0
        for workload in ("few-shot-64", "self-consistency"):
            assert summary["cache_speedup"][f"{backend}/{workload}"] > 0
        assert summary["greedy_agreement"][f"{backend}/cache_on vs {backend}/cache_off (few-shot-64)"] == 1.0
    workloads = stages["workloads"]["result"]
    assert workloads["torch/cache_on"]["few-shot-64"]["cached_tokens"] > 0
    assert workloads["torch/cache_off"]["few-shot-64"]["cached_tokens"] == 0
    # the table comes last: the device tool returns the end of the output
    table = gpu_check.summary_table(report).splitlines()
    assert done.stdout.splitlines()[-len(table) :][0].startswith("== gpu_check summary")


def test_stage_past_its_timeout_is_killed_and_reported(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "config.json").write_text(json.dumps({"dry_run": True, "backends": ["torch"], "out_dir": str(tmp_path)}))
    with open(tmp_path / "log", "w") as log:
        entry = gpu_check._run_stage("hang", work, timeout=12, dry_run=True, log=log)
    assert entry["status"] == "timeout" and "killed after 12 s" in entry["error"]
    assert entry["result"] == {"started": True}  # what it wrote before it hung
    assert entry["wall_s"] < 12 + 2 * gpu_check.GRACE_S + 5
