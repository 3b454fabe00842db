"""Start time from a GGUF file: process start to the first token of a one-token request, radixrt
against llama.cpp, each start a fresh process, the systems taking turns; medians of `--runs`.

Opt-in: never run in CI, imported by no test. The file is read once before the
first start, so every start finds it in the page cache. radixrt's start is
broken down into its phases (wall seconds, measured in the worker by wrapping
the loader's functions; the phases sum to the start):

  python+torch  interpreter start and `import torch` (numpy with it)
  imports       radixrt's modules up to `Runtime`
  gguf header   `GGUFFile`: header, metadata, tensor infos
  config        the model config from the metadata (`gguf_loader.config_of`)
  plan+memory   `plan_tensors` and `check_memory`
  build         `build_model`: packing and placing the weights
  engine        the rest of `Runtime(...)`: the KV pool, backend, engine thread
  first token   `generate` of one token for a short prompt

beside them, not in the sum, `tokenizer`: `gguf_loader.tokenizer_of` (the start
record, or a first start's tokenizer built from the metadata), which runs in a
background thread during plan+memory and build; and each start's CPU seconds (user + system, all threads, `getrusage`) are
reported beside its wall seconds: on a shared machine the CPU time of a start
moves much less with the other load than its wall time does.

Python modules start from their compiled bytecode, as an installed package
does (`PYTHONPYCACHEPREFIX` under the run's folder, written by an untimed
start first). `--first` measures the first start of the file instead: each
radixrt start gets an empty cache folder (`RADIXRT_CACHE_DIR`) but the
compiled kernels, so it builds config and tokenizer from the metadata and
writes the start record and the packed copy (`packed_copy`; the worker waits
for it after taking its figures). A later start maps that copy.

    python bench/start_bench.py /work/models/smollm2-1.7b-shape.Q4_K_M.gguf --runs 3
    python bench/start_bench.py MODEL --runs 3 --systems radixrt --checkouts /work/main /work/wt-start
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PHASES = ("python+torch", "imports", "gguf header", "config", "plan+memory", "build", "engine", "first token")
BACKGROUND = ("tokenizer",)  # phases that overlap others: reported, not summed
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def radixrt_worker(model: str, threads: int, kv_tokens: int) -> dict[str, float]:
    marks: dict[str, float] = {}
    spawned = float(os.environ["BENCH_SPAWNED_AT"])
    import torch

    marks["python+torch"] = time.time()
    torch.set_num_threads(threads)
    from radixrt.model import gguf_loader, gguf_plan, loader
    from radixrt.runtime import Runtime

    marks["imports"] = time.time()
    spans: dict[str, float] = {}

    def timed(module: Any, name: str, phase: str) -> None:
        inner = getattr(module, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            began = time.time()
            try:
                return inner(*args, **kwargs)
            finally:
                spans[phase] = spans.get(phase, 0.0) + time.time() - began

        setattr(module, name, wrapper)

    timed(loader, "_checked_gguf", "gguf header")
    timed(gguf_loader, "config_of", "config")
    timed(gguf_loader, "tokenizer_of", "tokenizer")
    timed(gguf_plan, "plan_tensors", "plan+memory")
    timed(gguf_plan, "check_memory", "plan+memory")
    timed(gguf_loader, "build_model", "build")
    began = time.time()
    runtime = Runtime(model=model, max_total_tokens=kv_tokens)
    engine = time.time() - began - sum(span for phase, span in spans.items() if phase not in BACKGROUND)
    began = time.time()
    outputs = runtime.generate(input_ids=[PROMPT], sampling_params={"max_new_tokens": 1, "ignore_eos": True})
    done = time.time()
    if len(outputs[0]["output_ids"]) != 1:
        raise RuntimeError(f"expected one token, got {outputs[0]['output_ids']}")
    result = {"start": done - spawned, "cpu": cpu_seconds(), "python+torch": marks["python+torch"] - spawned,
              "imports": marks["imports"] - marks["python+torch"], **spans, "engine": engine,
              "first token": done - began}
    runtime.shutdown()
    from radixrt.memory import packed_copy

    packed_copy.wait_for_writers()  # a first start's packed copy, whole before the worker's os._exit
    return result


def llamacpp_worker(model: str, threads: int, kv_tokens: int) -> dict[str, float]:
    spawned = float(os.environ["BENCH_SPAWNED_AT"])
    import llama_cpp

    llm = llama_cpp.Llama(model_path=model, n_ctx=kv_tokens, n_threads=threads, n_threads_batch=threads, seed=0,
                          verbose=False)
    for _ in llm.generate(PROMPT, top_k=0, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        break
    return {"start": time.time() - spawned, "cpu": cpu_seconds()}


def run_one(system: str, python: str, checkout: str | None, args: argparse.Namespace) -> dict[str, float] | str:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false",
               PYTHONPYCACHEPREFIX=str(args.scratch / "pycache"))
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if checkout:
        env["PYTHONPATH"] = checkout
    if system == "radixrt" and args.first:
        cache = Path(tempfile.mkdtemp(dir=args.scratch))
        kernels = Path(os.environ.get("RADIXRT_CACHE_DIR", Path.home() / ".cache" / "radixrt")) / "kernels"
        (cache / "kernels").symlink_to(kernels)  # compiled kernels are not part of a model's first start
        env["RADIXRT_CACHE_DIR"] = str(cache)
    env["BENCH_SPAWNED_AT"] = str(time.time())
    command = [python, str(Path(__file__).resolve()), "--worker", system, str(args.model), str(args.threads),
               str(args.kv_tokens)]
    done = subprocess.run(command, env=env, cwd=checkout, capture_output=True, text=True, timeout=args.timeout,
                          check=False)
    if system == "radixrt" and args.first:  # its packed copy's page cache goes too: the next start finds none
        shutil.rmtree(env["RADIXRT_CACHE_DIR"], ignore_errors=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return "\n".join(done.stderr.strip().splitlines()[-8:])
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-tokens", type=int, default=4096)
    parser.add_argument("--systems", nargs="+", default=["radixrt", "llamacpp"])
    parser.add_argument("--checkouts", nargs="+", default=[str(Path(__file__).resolve().parents[1])],
                        help="radixrt checkouts, taking turns (A/B)")
    parser.add_argument("--radixrt-python", default=sys.executable)
    parser.add_argument("--llamacpp-python", default="/work/llama-native-venv/bin/python")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--first", action="store_true", help="radixrt's first start of the file (no start record)")
    args = parser.parse_args()
    args.scratch = Path(tempfile.mkdtemp(prefix="start-bench-"))
    with args.model.open("rb") as file:  # into the page cache
        while file.read(1 << 24):
            pass
    entries = [(f"radixrt {c}", "radixrt", args.radixrt_python, c) for c in args.checkouts
               if "radixrt" in args.systems]
    if "llamacpp" in args.systems:
        entries.append(("llama.cpp", "llamacpp", args.llamacpp_python, None))
    results: dict[str, list[dict[str, float]]] = {label: [] for label, *_ in entries}
    first = args.first
    args.first = False
    for label, system, python, checkout in entries:  # untimed: bytecode and start records written
        run_one(system, python, checkout, args)
    args.first = first
    for run in range(args.runs):
        for label, system, python, checkout in entries:
            result = run_one(system, python, checkout, args)
            if isinstance(result, str):
                print(f"{label} run {run}: failed\n{result}", flush=True)
                continue
            results[label].append(result)
            print(f"{label} run {run}: " + " ".join(f"{k} {v:.2f}" for k, v in result.items()), flush=True)
    shutil.rmtree(args.scratch, ignore_errors=True)
    kind = "first start" if args.first else "later start"
    print(f"\n{args.model.name}, {kind}, {args.threads} threads, medians of {args.runs} "
          f"(load {os.getloadavg()[0]:.1f})")
    for label, runs in results.items():
        if runs:
            keys = ("start", "cpu", *(p for p in (*PHASES, *BACKGROUND) if p in runs[0]))
            print(f"{label}: " + ", ".join(f"{k} {statistics.median(r[k] for r in runs):.2f}" for k in keys))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:  # SYSTEM MODEL THREADS KV_TOKENS
        system, model, threads, kv_tokens = sys.argv[2:6]
        worker = radixrt_worker if system == "radixrt" else llamacpp_worker
        print(json.dumps(worker(model, int(threads), int(kv_tokens))), flush=True)
        os._exit(0)  # no teardown in the figure's process
    main()
