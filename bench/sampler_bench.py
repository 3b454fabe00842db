"""Cost of drawing a step's sampled tokens, radixrt's C passes against torch's ops.

`Sampler.sample` picks the next token of every row of a step's logits. On the
CPU every sampled row goes through `kernels/cpu/sample_rows.c`; elsewhere
through torch's ops (`_sample_rows`), which this script also times on the CPU
as the baseline, in the same run and on the same logits, by taking the C
kernel away for those calls. Logits are the bundled model's own (native
weights, bf16): at 8 positions of an English paragraph (peaked rows, as in
real text) and at 8 positions after random tokens (flat rows, where a wide
nucleus is the worst case). Per setting: median over --runs of the mean of
--calls calls, one torch thread (the engine's between steps).

Run: python bench/sampler_bench.py [--runs N] [--calls N] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from model_bench import cpu_name, make_runner  # noqa: E402

from radixrt.kernels import cpu  # noqa: E402
from radixrt.kernels.forward_batch import ForwardBatch  # noqa: E402
from radixrt.model.loader import load_model  # noqa: E402
from radixrt.sampling.params import SamplingParams  # noqa: E402
from radixrt.model.row_kernels import cpu_row_kernels  # noqa: E402
from radixrt.sampling.sampler import Sampler  # noqa: E402

PARAGRAPH = (
    "The old lighthouse keeper climbed the spiral stairs every evening to light the lamp. From the top he could "
    "see the fishing boats returning to the harbour, their sails catching the last light of the sun, and he "
    "would count them one by one until every boat was home. On stormy nights he stayed awake"
)
SETTINGS = {
    "T=0.7": SamplingParams(temperature=0.7),
    "T=0.7, top_p=0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "T=1, top_p=0.95": SamplingParams(temperature=1.0, top_p=0.95),
    "T=0.7, top_k=40": SamplingParams(temperature=0.7, top_k=40),
    "T=0.7, min_p=0.05": SamplingParams(temperature=0.7, min_p=0.05),
    "T=0.9, top_p=0.95, top_k=50": SamplingParams(temperature=0.9, top_p=0.95, top_k=50),
}


def model_logits(rows: int) -> dict[str, torch.Tensor]:
    """float32 logits [rows, vocab] of the bundled model: after a paragraph, and after random tokens."""
    loaded = load_model(None, device="cpu", dtype="bf16", weights="native")
    generator = torch.Generator().manual_seed(0)
    contexts = {
        "paragraph": loaded.tokenizer.encode(PARAGRAPH),
        "random tokens": torch.randint(100, 30000, (64,), generator=generator).tolist(),
    }
    out = {}
    for name, ids in contexts.items():
        runner = make_runner(loaded, len(ids))
        batch = ForwardBatch.build([ids], [0], [torch.arange(len(ids))])
        with torch.inference_mode():
            out[name] = runner.forward(batch, torch.arange(len(ids) - rows, len(ids)))
    return out


def time_sample(logits: torch.Tensor, params: SamplingParams, runs: int, calls: int) -> float:
    """Median over `runs` of the mean seconds of `calls` calls of `Sampler.sample` on every row."""
    sampler = Sampler(cpu_row_kernels())
    rows = logits.shape[0]
    args = ([params] * rows, list(range(rows)), [[1]] * rows, [[2]] * rows)
    sampler.sample(logits, *args)
    means = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            sampler.sample(logits, *args)
        means.append((time.perf_counter() - start) / calls)
    return statistics.median(means)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8, help="logits rows a step samples")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the C passes use as many)")
    args = parser.parse_args()
    if cpu.row_sampler() is None:
        print("radixrt's C kernels cannot be built here: nothing to compare", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    logits = model_logits(args.rows)
    print(f"CPU: {cpu_name()}, torch {torch.__version__} ({args.threads} thread(s)); {args.rows} rows of the "
          f"bundled model's logits; median of {args.runs} runs of {args.calls} calls")
    print("| logits | setting | radixrt C (ms) | torch ops (ms) | speed-up |")
    print("|---|---|---:|---:|---:|")
    for context, rows in logits.items():
        for name, params in SETTINGS.items():
            ours = time_sample(rows, params, args.runs, args.calls)
            with mock.patch.object(cpu, "row_sampler", lambda: None):  # the sampler's path without the kernel
                theirs = time_sample(rows, params, args.runs, args.calls)
            print(f"| {context} | {name} | {ours * 1e3:.2f} | {theirs * 1e3:.2f} | {theirs / ours:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
