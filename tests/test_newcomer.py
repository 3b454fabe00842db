"""What a newcomer trips over in the first hour: aborting a blocking call, a shut-down
runtime, a folder without a tokenizer, a misspelt program argument, silent loading,
the demo's message, the README's snippet and a quick benchmark's verdicts."""

from __future__ import annotations

import contextlib
import io
import logging
import random
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

import radixrt
from radixrt import Runtime
from radixrt.demo import run_demo
from radixrt.runtime.driver import StatusLine

GREEDY = {"temperature": 0, "ignore_eos": True}


def ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


@pytest.fixture(scope="module")
def rt(tiny_llama):
    with Runtime(tiny_llama, max_total_tokens=4096, check_invariants=True) as runtime:
        yield runtime


def test_abort_from_another_thread_ends_a_blocking_call(rt):
    results: list[dict] = []
    caller = threading.Thread(
        target=lambda: results.append(rt.generate(ids(8), {**GREEDY, "max_new_tokens": 1000}, rid="long-job"))
    )
    caller.start()
    while not (rt.cache_stats()["running_requests"] or rt.cache_stats()["waiting_requests"]):
        pass  # the caller's request has reached the engine: 1000 tokens leave plenty of time to abort it
    rt.abort("long-job")
    caller.join()
    meta = results[0]["meta_info"]
    assert meta["id"] == "long-job"
    assert meta["finish_reason"]["type"] == "abort"
    assert meta["completion_tokens"] < 1000


def test_a_shut_down_runtime_raises_instead_of_answering(tiny_llama):
    runtime = Runtime(tiny_llama, max_total_tokens=256)
    runtime.generate(ids(5), {**GREEDY, "max_new_tokens": 2})
    runtime.shutdown()
    runtime.shutdown()  # twice is fine
    for call in (runtime.cache_stats, runtime.flush_cache, lambda: runtime.generate(ids(5))):
        with pytest.raises(RuntimeError, match="shut down"):
            call()
    assert not runtime.is_alive()


def test_runtimes_share_a_loaded_model(tiny_llama, tiny_llama_dir):
    params = {**GREEDY, "max_new_tokens": 6}
    with Runtime(tiny_llama_dir, dtype="float32", max_total_tokens=512) as own:
        expected = own.generate(ids(20), params)["output_ids"]
    with Runtime(tiny_llama, max_total_tokens=512) as first, Runtime(tiny_llama, max_total_tokens=512) as second:
        assert first.generate(ids(20), params)["output_ids"] == expected
        assert second.generate(ids(20), params)["output_ids"] == expected
        assert second.engine.runner.kv_cache is not first.engine.runner.kv_cache
    with pytest.raises(ValueError, match="dtype 'bfloat16' asked for, but the loaded model is in torch.float32"):
        Runtime(tiny_llama, dtype="bfloat16")
    with pytest.raises(ValueError, match="weights 'native' asked for"):
        Runtime(tiny_llama, weights="native")


def test_a_folder_without_tokenizer_files_names_what_is_missing(tiny_llama_dir, tmp_path):
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama_dir / name, folder / name)
    with pytest.raises(FileNotFoundError, match="has no tokenizer files .one of tokenizer.json"):
        Runtime(folder)


def test_a_misspelt_program_argument_is_named_with_the_missing_one(rt):
    @radixrt.function
    def capital(s, country):
        s += "The capital of " + country + " is"

    with pytest.raises(TypeError) as error:
        capital.run(cuntry="France", runtime=rt)
    message = str(error.value)
    assert "unexpected argument(s) 'cuntry'" in message and "missing argument(s) 'country'" in message
    with pytest.raises(TypeError, match="run_batch item 1: unexpected argument.s. 'cuntry'"):
        capital.run_batch([{"country": "France"}, {"cuntry": "Peru"}], runtime=rt)


def test_loading_says_what_it_does_at_info(tiny_llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger="radixrt"):
        Runtime(tiny_llama_dir, dtype="float32", max_total_tokens=300).shutdown()
    messages = [record.getMessage() for record in caplog.records]
    assert any(m.startswith("loading tiny-llama") and "MB of weights" in m and "float32 on cpu" in m for m in messages)
    assert any(re.match(r"loaded tiny-llama\S* in \d+\.\d s", m) for m in messages)
    ready = [m for m in messages if m.startswith("ready in")]
    assert len(ready) == 1 and "KV pool 300 tokens" in ready[0] and "attention backend torch" in ready[0]


def test_status_line_while_busy_and_none_when_idle(rt, caplog):
    status = StatusLine(rt.engine, interval_s=0.0)
    with caplog.at_level(logging.INFO, logger="radixrt"):
        status.tick(busy=False)
        assert not caplog.records
        status.tick(busy=True)
    [record] = caplog.records
    assert re.match(r"running \d+, queued \d+, KV pool \d+% used, cache hit rate [\d.]+%, generation [\d.]+ tokens/s",
                    record.getMessage())


class _FakeRuntime:
    """Answers the demo's two questions with the figures of a real run."""

    def __init__(self, cached: tuple[int, int]):
        self.cached = list(cached)
        self.ttft = [1.8, 0.075]

    def generate(self, prompt: str, params: dict[str, Any]) -> dict[str, Any]:
        return {"text": " 30.\nMore", "meta_info": {"ttft": self.ttft.pop(0), "cached_tokens": self.cached.pop(0),
                                                   "prompt_tokens": 1452}}


def test_demo_says_what_it_shows():
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_demo(_FakeRuntime(cached=(0, 1437)))
    text = printed.getvalue()
    assert "answer: The age of Zack Blue is 30.  (the table says 30)" in text
    assert "TTFT 0.07 s, 1,437 of 1,452 prompt tokens reused from the cache" in text
    assert "reused 1,437 of its 1,452 prompt tokens (99%)" in text and "24x sooner" in text
    assert "hit rate" not in text

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_demo(_FakeRuntime(cached=(0, 0)))
    assert "reused no prompt tokens" in printed.getvalue()


def test_quick_benchmark_shows_targets_without_verdicts():
    from radixrt.benchmarks.report import markdown

    def report(scale: str) -> dict[str, Any]:
        return {
            "suite": {"command": "radixrt bench", "scale": scale, "reps": 1, "duration_s": 1.0,
                      "load_average_before": [0.0], "load_average_after": [0.0]},
            "machine": {"model": "m", "gpu": None, "cpu": "c", "logical_cores": 2, "device": "cpu",
                        "dtype": "float32", "torch": "t", "transformers": "t"},
            "workloads": {}, "results": {}, "ratios": {},
            "targets": [{"target": "chat: cache hit rate", "value": 0.1, "goal": ">= 0.6", "met": False}],
        }

    quick, full = markdown(report("quick")), markdown(report("full"))
    assert "| chat: cache hit rate | 0.1 | >= 0.6 |" in quick
    assert "**no**" not in quick and "| met |" not in quick and "not judged" in quick
    assert "| chat: cache hit rate | 0.1 | >= 0.6 | **no** |" in full


@pytest.mark.slow
def test_readme_snippet_shows_the_cache_at_work(smollm2):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", readme, re.S)
    assert snippet is not None
    code = snippet.group(1)
    assert "radixrt.Runtime()" in code
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code.replace("radixrt.Runtime()", "radixrt.Runtime(smollm2, max_total_tokens=4096)"), {"smollm2": smollm2})
    output = printed.getvalue()
    cached = [re.search(r": (\d+) of (\d+) prompt tokens cached$", line) for line in output.splitlines()[:2]]
    assert all(cached), output
    assert int(cached[0][1]) == 0 and int(cached[1][1]) > 0.8 * int(cached[1][2])
    assert output.endswith("\n"), "the streamed reply ends its line"
