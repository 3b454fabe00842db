"""How fast each GGUF format's CPU product reads its weight (kernels/cpu/format_matmul.h).

One weight of --rows x --cols (default 2048 x 8192) per format, random valid file blocks packed
once; then bf16 rows times it, --batches rows at a time (default 1 and 8). Reported per format
and batch: the median ms per product over --runs (after warm-up) and the packed bytes read per
second (GB/s; at batch 1 the product is memory-bound, so this is the figure to compare with
Q4_0's). Formats alternate within each round so that a busy machine slows them alike. --copies N
packs N copies of each weight and multiplies them in turn, so that with enough of them the weight
is read from memory rather than from a large last-level cache.

Run: python bench/format_matmul_bench.py [--formats Q4_0,Q4_K,Q6_K] [--batches 1,8] [--runs 50] [--threads N]
                                         [--copies N] [--portable]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixrt.benchmarks.gguf_models import _random_blocks  # noqa: E402
from radixrt.kernels import cpu  # noqa: E402
from radixrt.kernels.cpu.format_matmul import FORMATS, FormatWeight, format_matmul  # noqa: E402


def file_rows(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    qtype = gguf.GGMLQuantizationType[name]
    if name.endswith("_K"):
        return np.ascontiguousarray(_random_blocks(qtype, (rows, cols), rng))
    return np.ascontiguousarray(gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default="Q4_0,Q4_K,Q6_K")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=8192)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--copies", type=int, default=1, help="copies of each weight, multiplied in turn")
    parser.add_argument("--threads", type=int, default=None, help="kernel threads (default: torch's)")
    parser.add_argument("--portable", action="store_true", help="the plain-C kernel instead of the SIMD one")
    args = parser.parse_args()
    kernels = format_matmul()
    if kernels is None:
        sys.exit("the CPU kernels could not be built")
    rng = np.random.default_rng(0)
    names = args.formats.split(",")
    weights: dict[str, list[FormatWeight]] = {}
    for name in names:
        packed = kernels.pack_blocks(FORMATS[name], torch.from_numpy(file_rows(name, args.rows, args.cols, rng)))
        weights[name] = [packed._replace(data=packed.data.clone()) for _ in range(args.copies)]
    batches = [int(b) for b in args.batches.split(",")]
    times: dict[tuple[str, int], list[float]] = {(n, b): [] for n in names for b in batches}
    with cpu.kernel_threads(args.threads):
        for batch in batches:
            x = torch.randn(batch, args.cols).to(torch.bfloat16)
            out = torch.empty(batch, args.rows)
            for name in names:  # warm-up
                for weight in weights[name]:
                    kernels(x, weight, out, portable=args.portable)
            for run in range(args.runs):
                for name in names:
                    weight = weights[name][run % args.copies]
                    start = time.perf_counter()
                    kernels(x, weight, out, portable=args.portable)
                    times[(name, batch)].append(time.perf_counter() - start)
    print(f"weight {args.rows} x {args.cols} ({args.copies} copies), threads {args.threads or torch.get_num_threads()}, "
          f"{'portable' if args.portable else 'dispatched'} kernel, median of {args.runs}")
    print(f"{'format':>7} {'batch':>5} {'MB':>7} {'ms':>8} {'GB/s':>7}")
    for batch in batches:
        for name in names:
            seconds = statistics.median(times[(name, batch)])
            size = weights[name][0].data.numel()
            print(f"{name:>7} {batch:>5} {size / 1e6:7.2f} {seconds * 1e3:8.3f} {size / seconds / 1e9:7.1f}")


if __name__ == "__main__":
    main()
