"""The benchmark suite (radixrt/benchmarks/): a quick end-to-end run on the tiny random model.

Only the report's shape is checked, never a timing: CI machines are too noisy
for that, and --quick workloads are too small to measure anything.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from radixrt.benchmarks.metrics import SEQUENTIAL_FIELDS, SUMMARY_FIELDS, percentile
from radixrt.benchmarks.systems import DEFAULT_SYSTEMS
from radixrt.benchmarks.workloads import FULL, QUICK, WORKLOAD_NAMES, build_workloads, common_prefix_len
from radixrt.cli import main as cli_main

MACHINE_FIELDS = ("cpu", "logical_cores", "memory_gib", "gpu", "device", "dtype", "model", "torch", "transformers")
WORKLOAD_FIELDS = ("kind", "requests", "description", "max_new_tokens", "temperature", "warm_prefix",
                   "shared_prefix_tokens")


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_quick_suite_writes_every_field(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from radixrt.benchmarks.suite import main

    args = ["--quick", "--model", str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32", "--out", str(tmp_path)]
    assert main(args) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert set(report) >= {"suite", "machine", "workloads", "results", "ratios", "targets"}
    assert report["suite"]["reps"] == 1 and report["suite"]["scale"] == "quick"
    assert all(field in report["machine"] for field in MACHINE_FIELDS)
    assert list(report["workloads"]) == list(WORKLOAD_NAMES)
    for name, info in report["workloads"].items():
        assert all(field in info for field in WORKLOAD_FIELDS), name
    for workload, by_system in report["results"].items():
        assert list(by_system) == list(DEFAULT_SYSTEMS), workload
        for system, summary in by_system.items():
            fields = SUMMARY_FIELDS + (SEQUENTIAL_FIELDS if workload == "table" else ())
            assert all(isinstance(summary[f], (int, float)) for f in fields), (workload, system)
            assert summary["output_tokens"] == summary["num_requests"] * report["workloads"][workload]["max_new_tokens"]
            assert summary["num_requests"] == report["workloads"][workload]["requests"]
            assert len(summary["reps"]) == 1 and len(summary["reps"][0]["ttft_s"]) == summary["num_requests"]
            if system != "radixrt":
                assert summary["cached_tokens"] == 0, (workload, system)
        assert by_system["radixrt"]["cached_tokens"] > 0, workload  # every workload shares a prefix
        assert set(report["ratios"][workload]) == {"radixrt/transformers", "radixrt/radixrt-no-cache",
                                                   "radixrt-no-cache/transformers"}
    assert len(report["targets"]) == 7 and all(t["met"] in (True, False) for t in report["targets"])
    markdown = (tmp_path / "results.md").read_text()
    assert "| few-shot-32 | radixrt |" in markdown and "| target |" in markdown
    assert (tmp_path / "throughput.png").is_file() == _has_matplotlib()


def test_cli_bench_without_matplotlib(tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    argv = ["--model", str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32", "bench", "--quick",
            "--workloads", "table", "--systems", "radixrt", "--reps", "2", "--out", str(tmp_path)]
    assert cli_main(argv) == 0
    assert "plots skipped" in capsys.readouterr().out
    report = json.loads((tmp_path / "results.json").read_text())
    assert list(report["results"]) == ["table"] and list(report["results"]["table"]) == ["radixrt"]
    assert len(report["results"]["table"]["radixrt"]["reps"]) == 2
    assert not list(tmp_path.glob("*.png"))
    assert report["targets"][0]["met"] is None  # few-shot not measured


def test_bench_rejects_unknown_names(tmp_path: Path) -> None:
    from radixrt.benchmarks.suite import main

    with pytest.raises(SystemExit, match="--workloads"):
        main(["--workloads", "table,nope", "--out", str(tmp_path)])
    assert cli_main(["--disable-radix-cache", "bench", "--quick"]) == 2


def test_workloads_are_deterministic_and_share_prefixes(tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    first = build_workloads(tokenizer, QUICK, seed=0)
    assert first == build_workloads(tokenizer, QUICK, seed=0)
    assert first != build_workloads(tokenizer, QUICK, seed=1)
    by_name = {w.name: w for w in first}
    few_shot = by_name["few-shot-64"]
    assert len(few_shot.prompts) == QUICK.few_shot_questions[0]
    assert len(few_shot.shared_prefix) >= QUICK.few_shot_prefix_tokens - 8
    assert by_name["few-shot-32"].warm_prefix and not few_shot.warm_prefix
    assert by_name["tree-of-thought"].num_requests == 2 + 4


@pytest.mark.slow
def test_full_workloads_match_the_issue_on_the_bundled_tokenizer() -> None:
    from transformers import AutoTokenizer

    from radixrt.benchmarks.systems import model_folder

    tokenizer = AutoTokenizer.from_pretrained(model_folder(None))
    by_name = {w.name: w for w in build_workloads(tokenizer, FULL, seed=0)}
    table = by_name["table"]
    from radixrt.demo import table_prompt

    assert table.prompts[0] == tuple(tokenizer.encode(table_prompt("John Doe"), add_special_tokens=False))
    assert table.prompts[1] == tuple(tokenizer.encode(table_prompt("Zack Blue"), add_special_tokens=False))
    assert len(table.prompts) == 32 and len(set(table.prompts)) == 32
    for name, questions in (("few-shot-64", 64), ("few-shot-32", 32)):
        workload = by_name[name]
        assert len(workload.prompts) == questions
        assert 1000 <= len(workload.shared_prefix) <= 1100
    assert 300 <= len(by_name["self-consistency"].prompts[0]) <= 330
    assert by_name["self-consistency"].num_samples == 8
    assert 300 <= by_name["chat"].info["system_prompt_tokens"] <= 330
    assert by_name["chat"].num_requests == 16 * 4
    assert by_name["tree-of-thought"].num_requests == 3 + 9 + 27


def test_percentile_and_common_prefix() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert math.isnan(percentile([], 50))
    assert common_prefix_len([(1, 2, 3), (1, 2, 4), (1, 2)]) == 2
    assert common_prefix_len([(5, 6)]) == 2
