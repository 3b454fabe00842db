"""Batch-1 greedy decode speed of a bf16 folder as loaded, and quantized at load (q8_0, q4_0).

The folder: the bundled SmolLM2-135M-Instruct's dense weights written in bf16 to a temp dir
(`radixrt.benchmarks.hf_folders`), or --folder. Each way is a `Runtime` as users get one
(its defaults: deterministic where radixrt's kernels serve it, decode runs); one prompt is
answered greedily with 1 and with 1 + --tokens new tokens (ignore_eos), and a decode token
costs the difference over --tokens. The ways alternate within each of --runs rounds (a slow
minute falls on all of them); medians, with the fastest round beside them.

Run: python bench/quantize_speed_bench.py [--folder PATH] [--ways dense,q8_0,q4_0] [--tokens 64] [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from model_bench import cpu_name  # noqa: E402

from radixrt.runtime.api import Runtime  # noqa: E402

PROMPT = "Explain what a hash table is, and when a binary search tree is the better choice."


def answer_s(runtime: Runtime, max_new_tokens: int) -> float:
    runtime.flush_cache()
    started = time.perf_counter()
    runtime.generate(PROMPT, {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True})
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=None)
    parser.add_argument("--ways", default="dense,q8_0,q4_0")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temp:
        folder = args.folder
        if folder is None:
            from radixrt.benchmarks.hf_folders import write_hf_folder

            folder = write_hf_folder(Path(temp) / "SmolLM2-135M-Instruct-bf16")
        runtimes = {way: Runtime(folder, device="cpu", dtype="bfloat16", max_total_tokens=4096,
                                 quantize=None if way == "dense" else way) for way in args.ways.split(",")}
        try:
            for runtime in runtimes.values():  # warm-up: kernels built, packed copies made
                answer_s(runtime, 8)
            per_token: dict[str, list[float]] = {way: [] for way in runtimes}
            for _ in range(args.runs):
                for way, runtime in runtimes.items():
                    first, longer = answer_s(runtime, 1), answer_s(runtime, 1 + args.tokens)
                    per_token[way].append((longer - first) / args.tokens * 1000)
            print(f"CPU: {cpu_name()}, torch {torch.__version__} ({torch.get_num_threads()} threads); "
                  f"{folder.name}; {args.tokens} greedy tokens, batch 1, {args.runs} alternating rounds")
            print("| way | deterministic | decode ms/token (median) | fastest round |")
            print("|---|---|---:|---:|")
            for way, times in per_token.items():
                deterministic = runtimes[way].deterministic
                print(f"| {way} | {deterministic} | {statistics.median(times):.2f} | {min(times):.2f} |")
        finally:
            for runtime in runtimes.values():
                runtime.shutdown()


if __name__ == "__main__":
    main()
