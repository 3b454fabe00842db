"""Loading a real-sized GGUF: first and later start, peak memory and cache disk, two checkouts A/B.

    python bench/model_sizes_bench.py --build /tmp/smollm2-1.7b-shape.Q4_0.gguf
    python bench/model_sizes_bench.py --measure /tmp/smollm2-1.7b-shape.Q4_0.gguf \\
        --before /work/main --after /work/wt-gguf --runs 3

`--build` writes a random-weight model of SmolLM2-1.7B's shape (24 layers,
hidden 2048, intermediate 8192, 32 heads, 32 KV heads, vocab 49152, tied
embedding) with the bundled SmolLM2 tokenizer as a Q4_0 GGUF: projections
Q4_0, the tied embedding Q8_0 (llama.cpp's Q4_0 files store it as Q6_K when
the row length is a multiple of 256, as here, and as Q8_0 otherwise; gguf's
writer has no K-quant quantizer), norms F32. The file is never committed.

`--measure` runs, for each checkout (PYTHONPATH), alternating, `--runs` times:
a first start (a fresh RADIXRT_CACHE_DIR holding only that checkout's compiled
kernels, which are per machine, not per model) and a later start (the same cache
again). Each start is a new process: `Runtime(model=FILE, max_total_tokens=4096)`
and a 1-token greedy request; the time is from before the process is spawned
to the request's return. The child reports its peak RSS (getrusage); the
parent the bytes the first start left in the cache (kernels excepted).
Medians go to stdout as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CHILD = """
import json, os, resource, sys, time
started = float(os.environ["BENCH_SPAWNED_AT"])
import radixrt
from radixrt import Runtime
assert radixrt.__file__.startswith(os.environ["PYTHONPATH"]), radixrt.__file__
with Runtime(model=sys.argv[1], max_total_tokens=4096) as rt:
    out = rt.generate("The capital of France is", {"max_new_tokens": 1, "temperature": 0})
    first_token_s = time.time() - started
print(json.dumps({"first_token_s": first_token_s, "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "tokens": out["meta_info"]["completion_tokens"]}))
"""


def build(path: Path) -> None:
    from radixrt.benchmarks.gguf_models import SMOLLM2_1_7B, write_llama_gguf

    started = time.perf_counter()
    write_llama_gguf(path, SMOLLM2_1_7B, projection_type="Q4_0", embedding_type="Q8_0")
    print(f"wrote {path}: {path.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - started:.0f} s")


def start(checkout: Path, model: Path, cache: Path) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(checkout), RADIXRT_CACHE_DIR=str(cache), BENCH_SPAWNED_AT=str(time.time()))
    # run from the checkout: `python -c` puts the working directory first on sys.path
    done = subprocess.run([sys.executable, "-c", _CHILD, str(model)], env=env, cwd=checkout, capture_output=True,
                          text=True, check=False)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"{checkout}: the start failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def cache_bytes(cache: Path) -> int:
    return sum(p.stat().st_size for p in cache.rglob("*") if p.is_file() and "kernels" not in p.parts)


def compiled_kernels(checkout: Path, where: Path) -> Path:
    """The checkout's own compiled CPU kernels (built once into `where`/kernels)."""
    env = dict(os.environ, PYTHONPATH=str(checkout), RADIXRT_CACHE_DIR=str(where))
    subprocess.run([sys.executable, "-c", "from radixrt.kernels import cpu; assert cpu.quantized_matmul()"],
                   env=env, cwd=checkout, check=True)  # fmt: skip
    return where / "kernels"


def measure(model: Path, checkouts: dict[str, Path], runs: int, scratch: Path) -> None:
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    kernels = {label: compiled_kernels(checkout, scratch / label) for label, checkout in checkouts.items()}
    for run in range(runs):
        for label, checkout in checkouts.items():
            with tempfile.TemporaryDirectory(prefix="radixrt-bench-cache-") as tmp:
                cache = Path(tmp)
                shutil.copytree(kernels[label], cache / "kernels")
                first = start(checkout, model, cache)
                first["cache_bytes"] = cache_bytes(cache)
                later = start(checkout, model, cache)
                later["cache_bytes"] = cache_bytes(cache) - first["cache_bytes"]
            for kind, result in (("first", first), ("later", later)):
                results.setdefault((label, kind), []).append(result)
                print(f"run {run + 1} {label} {kind}: {json.dumps(result)}", flush=True)
    print("\n| start | checkout | to first token (s) | peak RSS (GiB) | written to the cache (MB) |")
    print("|---|---|---|---|---|")
    for (label, kind), values in sorted(results.items(), key=lambda item: (item[0][1], item[0][0])):
        time_s = statistics.median(v["first_token_s"] for v in values)
        rss = statistics.median(v["peak_rss_kb"] for v in values) / 2**20
        disk = statistics.median(v["cache_bytes"] for v in values) / 1e6
        each = ", ".join(f"{v['first_token_s']:.1f}" for v in values)
        print(f"| {kind} | {label} | {time_s:.1f} ({each}) | {rss:.2f} | {disk:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", type=Path, help="write the model file here")
    parser.add_argument("--measure", type=Path, help="the model file to start from")
    parser.add_argument("--before", type=Path, help="checkout measured first (e.g. main)")
    parser.add_argument("--after", type=Path, help="checkout measured second")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()) / "radixrt-bench-kernels",
                        help="where each checkout's kernels are compiled once, to seed every fresh cache")  # fmt: skip
    args = parser.parse_args()
    if args.build:
        build(args.build)
    if args.measure:
        if not (args.before and args.after):
            parser.error("--measure needs --before and --after")
        measure(args.measure, {"before": args.before, "after": args.after}, args.runs, args.scratch)


if __name__ == "__main__":
    main()
