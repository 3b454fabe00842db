"""Real-sized GGUF files: radixrt against llama.cpp (native and AVX2-only builds), one file, same token ids.

Opt-in: never run in CI, imported by no test. Every system and repetition runs
in a fresh process (this file, `--worker`), systems taking turns within each
repetition; the report gives medians of `--runs`. Systems:

  radixrt        radixrt.Runtime(model=FILE) with its defaults, from the checkout
                 `--radixrt-checkout` (PYTHONPATH; run from there), with
                 RADIXRT_CPU_ISA=`--radixrt-isa` when given
  llamacpp       llama-cpp-python built with GGML_NATIVE=ON, AMX code off (its AMX path
                 crashes on the project's VM; docs/benchmarks.md) (`--llamacpp-python`)
  llamacpp-avx2  llama-cpp-python built for AVX2/FMA/F16C, every AVX-512, AMX and
                 AVX-VNNI option off (`--llamacpp-avx2-python`)

Each system gets `--threads` threads (llama.cpp: n_threads = n_threads_batch;
radixrt: torch's and its C kernels' threads) and a KV pool of `--kv-tokens`
tokens: radixrt's `max_total_tokens`, llama.cpp's `n_ctx` (one sequence, f16 K
and V; radixrt's pool is bf16, so equal tokens are equal bytes: the report
prints both pools' bytes). Measures, in this order, in one process:

  start      from before the process is spawned to the return of a one-token
             greedy request (imports, load, first step); the file is read
             once before the first run, so it is in the page cache
  peak RSS   getrusage's ru_maxrss after the start, and at the end of the run
  prefill    a cold ~320-token prompt, one greedy token: prompt tokens / seconds
  decode     the same prompt again (cached), `decode_tokens` greedy tokens:
             seconds / tokens (one step re-reads the prompt's last token)
  fork       one ~330-token prompt, `fork_samples` continuations of
             `fork_new_tokens` at T=0.7, cold: radixrt with `n` in one request,
             llama.cpp one sequence after another (llama-cpp-python's `Llama`
             serves one sequence; each sample reuses the prompt's KV)
  few-shot   `few_shot_questions` questions behind a warm shared prefix of
             ~`few_shot_prefix_tokens`, `few_shot_new_tokens` greedy each:
             radixrt in one call, llama.cpp one after another (prefix reused)

Every request generates exactly its new tokens (radixrt `ignore_eos`, llama.cpp
by reading that many from `Llama.generate`); a short output fails the run.
A system that fails prints why; the others go on.

    python bench/real_models_bench.py /work/models/smollm2-1.7b-shape.Q4_0.gguf --runs 3 \\
        --radixrt-checkout /work/main --json out.json --out out.md
    python bench/real_models_bench.py /work/models/llama-3.1-8b-shape.Q4_K_M.gguf --sizes small --runs 1
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SYSTEMS = ("radixrt", "llamacpp", "llamacpp-avx2")
LLAMA_VENVS = {"llamacpp": "/work/llama-native-venv", "llamacpp-avx2": "/work/llama-avx2-venv"}
ROWS = (  # (result key, label, unit, digits)
    ("start_s", "start: spawn to first token", "s", 2),
    ("start_rss_gib", "peak RSS after the start", "GiB", 2),
    ("peak_rss_gib", "peak RSS, whole run", "GiB", 2),
    ("prefill_tok_s", "prefill", "tok/s", 1),
    ("decode_ms", "decode, batch 1", "ms/token", 1),
    ("fork_s", "fork", "s", 2),
    ("few_shot_s", "few-shot, prefix warm", "s", 2),
)


@dataclass(frozen=True)
class Sizes:
    """Workload sizes; prompt lengths are targets in tokens, reached by whole sentences."""

    prefill_tokens: int = 300
    decode_tokens: int = 64
    fork_tokens: int = 330
    fork_samples: int = 8
    fork_new_tokens: int = 32
    few_shot_prefix_tokens: int = 1000
    few_shot_questions: int = 32
    few_shot_new_tokens: int = 16


SIZES = {
    "full": Sizes(),
    # an 8B-sized file: one run of three systems within half an hour on 2 cores (docs/benchmarks.md)
    "small": Sizes(decode_tokens=16, fork_new_tokens=8, few_shot_prefix_tokens=500, few_shot_questions=4,
                   few_shot_new_tokens=8),
    "quick": Sizes(prefill_tokens=100, decode_tokens=8, fork_tokens=100, fork_samples=2, fork_new_tokens=4,
                   few_shot_prefix_tokens=200, few_shot_questions=2, few_shot_new_tokens=4),
}


# --- the worker: one system, one process; standard library only (it runs in each system's venv) ---


class RadixrtSystem:
    def __init__(self, model: str, spec: dict[str, Any]):
        import radixrt
        import torch

        checkout = os.environ.get("PYTHONPATH", "")
        if checkout and not radixrt.__file__.startswith(checkout):
            raise RuntimeError(f"radixrt imported from {radixrt.__file__}, not from PYTHONPATH={checkout}")
        torch.set_num_threads(spec["threads"])
        self.runtime = radixrt.Runtime(model=model, max_total_tokens=spec["kv_tokens"])
        runner = self.runtime.engine.runner
        dtype = str(runner.model.dtype).removeprefix("torch.")
        isa = os.environ.get("RADIXRT_CPU_ISA", "best")
        self.version = f"radixrt {radixrt.__version__} ({dtype}, weights={self.runtime.config.weights}, ISA {isa})"
        self.kv_bytes = _radixrt_kv_bytes(self.runtime)

    def generate(self, prompts: list[list[int]], new_tokens: int, temperature: float = 0.0, n: int = 1,
                 seed: int = 0) -> list[list[int]]:
        params = {"max_new_tokens": new_tokens, "temperature": temperature, "ignore_eos": True, "n": n, "seed": seed}
        results = self.runtime.generate(input_ids=prompts, sampling_params=params)
        return [r["output_ids"] for r in results]

    def flush(self) -> None:
        self.runtime.flush_cache()

    def close(self) -> None:
        self.runtime.shutdown()


def _radixrt_kv_bytes(runtime: Any) -> int | None:
    """The KV pool's bytes (its K and V tensors), None where the runner does not expose them."""
    cache = getattr(runtime.engine.runner, "kv_cache", None)
    if cache is None or not hasattr(cache, "k"):
        return None
    return sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v))


class LlamaCppSystem:
    """llama-cpp-python's `Llama`: one sequence; a call reuses the KV of the longest prefix it shares
    with the previous call (the whole prompt matching, its last token is computed again)."""

    def __init__(self, model: str, spec: dict[str, Any]):
        llama_cpp = importlib.import_module("llama_cpp")  # installed in its own venv, not radixrt's
        threads = spec["threads"]
        self.llm = llama_cpp.Llama(model_path=model, n_ctx=spec["kv_tokens"], n_threads=threads,
                                   n_threads_batch=threads, seed=0, verbose=False)
        info = llama_cpp.llama_print_system_info().decode()
        self.version = f"llama-cpp-python {llama_cpp.__version__} ({_cpu_features(info)})"
        meta = self.llm.metadata
        layers, heads = int(meta["llama.block_count"]), int(meta["llama.attention.head_count"])
        kv_heads, hidden = int(meta["llama.attention.head_count_kv"]), int(meta["llama.embedding_length"])
        # K and V, f16 (llama.cpp's default cache type), every layer, n_ctx tokens
        self.kv_bytes = 2 * layers * kv_heads * (hidden // heads) * 2 * spec["kv_tokens"]

    def generate(self, prompts: list[list[int]], new_tokens: int, temperature: float = 0.0, n: int = 1,
                 seed: int = 0) -> list[list[int]]:
        outputs = []
        for prompt in prompts:
            for sample in range(n):
                self.llm.set_seed(seed + sample)
                output: list[int] = []
                # top_k=0, top_p=1, min_p=0: plain temperature sampling, as radixrt's default
                for token in self.llm.generate(prompt, top_k=0, top_p=1.0, min_p=0.0, temp=temperature,
                                               repeat_penalty=1.0):
                    output.append(token)
                    if len(output) == new_tokens:
                        break
                outputs.append(output)
        return outputs

    def flush(self) -> None:
        self.llm.reset()

    def close(self) -> None:
        self.llm.close()


def _cpu_features(system_info: str) -> str:
    """The instruction sets llama.cpp's CPU backend was built for (`llama_print_system_info`'s `X = 1`)."""
    parts = [p.strip() for p in system_info.removeprefix("CPU :").replace("|", ";").split(";")]
    return ", ".join(p.split("=")[0].strip() for p in parts if p.endswith("= 1")) or system_info.strip()


def _timed(system: Any, prompts: list[list[int]], new_tokens: int, **sampling: Any) -> float:
    """Wall seconds of one `generate`, after checking every sequence got exactly `new_tokens`."""
    start = time.perf_counter()
    outputs = system.generate(prompts, new_tokens, **sampling)
    seconds = time.perf_counter() - start
    lengths = sorted({len(o) for o in outputs})
    if lengths != [new_tokens]:
        raise RuntimeError(f"expected {new_tokens} new tokens per sequence, got lengths {lengths}")
    return seconds


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def worker(name: str, model: str, spec_path: Path, out_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    work = spec["work"]
    system = RadixrtSystem(model, spec) if name == "radixrt" else LlamaCppSystem(model, spec)
    system.generate([work["start"]], 1)
    result: dict[str, Any] = {"start_s": time.time() - float(os.environ["BENCH_SPAWNED_AT"]),
                              "start_rss_gib": _peak_rss_gib()}
    try:
        for prompt in work["warmup"]:  # untimed: first-call costs (allocations, kernel choice) go here
            system.generate([prompt], 4)
            system.generate([prompt], 4, temperature=0.7, n=2)
        system.flush()
        prefill = work["prefill"]
        result["prefill_tok_s"] = len(prefill) / _timed(system, [prefill], 1)
        result["decode_ms"] = 1000 * _timed(system, [prefill], work["decode_tokens"]) / work["decode_tokens"]
        fork = work["fork"]
        system.flush()
        result["fork_s"] = _timed(system, [fork["prompt"]], fork["new_tokens"], temperature=0.7, n=fork["n"], seed=1)
        few_shot = work["few_shot"]
        system.flush()
        system.generate([few_shot["prefix"]], 1)  # the prefix is warm, as in a running service
        result["few_shot_s"] = _timed(system, few_shot["prompts"], few_shot["new_tokens"])
        result["peak_rss_gib"] = _peak_rss_gib()
    finally:
        system.close()
    result.update(system=name, version=system.version, kv_bytes=system.kv_bytes)
    out_path.write_text(json.dumps(result))


# --- the parent: token ids, runs, report ---------------------------------------------------------


def build_work(model: Path, sizes: Sizes) -> tuple[dict[str, Any], dict[str, str]]:
    """Every workload's token ids (from the file's own tokenizer), and a line per table row on its shape."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peers_bench import Sizes as PeerSizes
    from peers_bench import _Prompts
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name)
    peer_sizes = PeerSizes(few_shot_prefix_tokens=sizes.few_shot_prefix_tokens,
                           few_shot_questions=sizes.few_shot_questions, few_shot_new_tokens=sizes.few_shot_new_tokens,
                           fork_tokens=sizes.fork_tokens, fork_samples=sizes.fork_samples,
                           fork_new_tokens=sizes.fork_new_tokens)
    prompts = _Prompts(tokenizer, peer_sizes)
    few_shot, fork = prompts.few_shot(), prompts.fork()
    # the prefill prompt: another fork-style question, of its own length
    prompts.sizes = PeerSizes(fork_tokens=sizes.prefill_tokens)
    prefill = prompts.fork()["prompt"]
    work = {"start": prompts.user_turn("Say hello."),
            "warmup": [prompts.user_turn(f"Name a fruit that starts with {letter}.") for letter in "AB"],
            "prefill": prefill, "decode_tokens": sizes.decode_tokens, "fork": fork, "few_shot": few_shot}
    lengths = [len(p) for p in few_shot["prompts"]]
    shapes = {
        "start_s": "one-token greedy request, file in the page cache",
        "start_rss_gib": "getrusage ru_maxrss",
        "peak_rss_gib": "getrusage ru_maxrss",
        "prefill_tok_s": f"{len(prefill)}-token prompt, cold, 1 token",
        "decode_ms": f"{sizes.decode_tokens} greedy tokens after that prompt (cached)",
        "fork_s": f"{len(fork['prompt'])}-token prompt, {sizes.fork_samples} x {sizes.fork_new_tokens} new, T=0.7",
        "few_shot_s": f"{sizes.few_shot_questions} x {min(lengths)}-{max(lengths)} tokens "
                      f"({len(few_shot['prefix'])} shared, warm), {sizes.few_shot_new_tokens} new",
    }
    return work, shapes


def read_into_page_cache(path: Path) -> float:
    """Read the whole file once, so every start finds it in the page cache; seconds taken."""
    start = time.perf_counter()
    with path.open("rb") as f:
        while f.read(1 << 24):
            pass
    return time.perf_counter() - start


def run_system(system: str, args: argparse.Namespace, spec_path: Path) -> dict[str, Any] | str:
    """One system's results, or why it failed (the tail of its error output)."""
    out_path = spec_path.with_name(f"{system}.json")
    out_path.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    cwd = None
    if system == "radixrt":
        python = args.radixrt_python
        env["PYTHONPATH"] = str(args.radixrt_checkout)
        cwd = str(args.radixrt_checkout)
        if args.radixrt_isa:
            env["RADIXRT_CPU_ISA"] = args.radixrt_isa
    else:
        python = getattr(args, system.replace("-", "_") + "_python")
        env.pop("PYTHONPATH", None)
    env["BENCH_SPAWNED_AT"] = str(time.time())
    command = [python, str(Path(__file__).resolve()), "--worker", system, str(args.model), str(spec_path),
               str(out_path)]
    try:
        done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=args.timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        return f"no result within {args.timeout:.0f} s"
    except OSError as error:
        return f"cannot start {python}: {error}"
    if done.returncode or not out_path.is_file():
        tail = "\n".join(done.stderr.strip().splitlines()[-12:])
        return f"exit status {done.returncode}:\n{tail}"
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def report(results: dict[str, list[dict[str, Any]]], failures: dict[str, str], shapes: dict[str, str],
           args: argparse.Namespace, loads: tuple[float, float]) -> str:
    systems = [s for s in results if results[s]]

    def median(system: str, key: str) -> float | None:
        values = [r[key] for r in results[system] if r.get(key) is not None]
        return statistics.median(values) if values else None

    lines = [f"{args.model.name}: {args.model.stat().st_size / 2**30:.2f} GiB", "",
             f"| measure | shape | {' | '.join(systems)} |", "|---|---|" + "---:|" * len(systems)]
    for key, label, unit, digits in ROWS:
        cells = []
        for system in systems:
            value = median(system, key)
            each = ", ".join(f"{r[key]:.{digits}f}" for r in results[system] if r.get(key) is not None)
            cells.append("-" if value is None else f"{value:.{digits}f} {unit}" + (f" ({each})" if args.runs > 1 else ""))
        lines.append(f"| {label} | {shapes[key]} | {' | '.join(cells)} |")
    kv = [f"{results[s][0]['kv_bytes'] / 2**20:.0f} MiB" if results[s][0].get("kv_bytes") else "?" for s in systems]
    lines.append(f"| KV pool | {args.kv_tokens} tokens | {' | '.join(kv)} |")
    kind = f"medians of {args.runs} (each run in brackets)" if args.runs > 1 else "1 run"
    lines += ["", f"{kind}; {args.threads} threads each; {os.cpu_count()} cores; 1-minute load average "
                  f"{loads[0]:.1f} at the start, {loads[1]:.1f} at the end (the benchmark itself adds about "
                  f"{args.threads})."]
    lines += [f"- {system}: {results[system][0]['version']}" for system in systems]
    lines += [f"- {system} failed: {why}" for system, why in failures.items()]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, help="the GGUF file every system loads")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {', '.join(SYSTEMS)}")
    parser.add_argument("--runs", type=int, default=3, help="processes per system, interleaved; medians reported")
    parser.add_argument("--sizes", choices=sorted(SIZES), default="full",
                        help="workload sizes: full, small (an 8B file within half an hour), quick (a smoke test)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-tokens", type=int, default=4096,
                        help="KV pool in tokens: radixrt's max_total_tokens, llama.cpp's n_ctx")
    parser.add_argument("--radixrt-checkout", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the radixrt checkout to run (PYTHONPATH)")
    parser.add_argument("--radixrt-python", default=sys.executable, help="the python with radixrt's dependencies")
    parser.add_argument("--radixrt-isa", help="RADIXRT_CPU_ISA for radixrt (default: unset, the best the CPU runs)")
    parser.add_argument("--llamacpp-python", default=f"{LLAMA_VENVS['llamacpp']}/bin/python")
    parser.add_argument("--llamacpp-avx2-python", default=f"{LLAMA_VENVS['llamacpp-avx2']}/bin/python")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one system's run may take")
    parser.add_argument("--json", type=Path, help="write every run's results here")
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    args = parser.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown or not args.systems:
        parser.error(f"--systems must name some of {', '.join(SYSTEMS)}; unknown: {', '.join(unknown)}")
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    if not args.model.is_file():
        parser.error(f"no file {args.model}")
    args.model = args.model.resolve()
    args.radixrt_checkout = args.radixrt_checkout.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = SIZES[args.sizes]
    work, shapes = build_work(args.model, sizes)
    spec = {"threads": args.threads, "kv_tokens": args.kv_tokens, "work": work}
    print(f"{args.model}: read into the page cache in {read_into_page_cache(args.model):.1f} s", file=sys.stderr)
    results: dict[str, list[dict[str, Any]]] = {system: [] for system in args.systems}
    failures: dict[str, str] = {}
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="real-models-bench-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for run in range(args.runs):
            for system in [s for s in args.systems if s not in failures]:
                start = time.perf_counter()
                outcome = run_system(system, args, spec_path)
                took = time.perf_counter() - start
                if isinstance(outcome, str):
                    failures[system] = outcome
                    print(f"run {run + 1}/{args.runs} {system}: failed in {took:.0f} s (why: in the report)", file=sys.stderr)
                else:
                    results[system].append(outcome)
                    print(f"run {run + 1}/{args.runs} {system}: {took:.0f} s {json.dumps(outcome)}", file=sys.stderr)
    text = report(results, failures, shapes, args, (load_at_start, os.getloadavg()[0]))
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "model_bytes": args.model.stat().st_size,
                                         "sizes": asdict(sizes), "threads": args.threads,
                                         "kv_tokens": args.kv_tokens, "results": results, "failures": failures},
                                        indent=1))
    return 0 if any(results.values()) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5]))
    else:
        sys.exit(main())
