"""The CPU kernels' instruction-set levels against one another on this machine.

    python bench/isa_bench.py [--rounds 3]

For each level this CPU runs (portable, avx2, avx512: `RADIXRT_CPU_ISA` caps a
process at it), a fresh process per level and round, the levels alternating
within each round, measures:

- the bundled model (native 4-bit weights, radix cache off): a 512-token
  prefill (a 1-token greedy request on 512 random prompt tokens) and a batch-1
  decode step ((the time of 65 greedy tokens - that of 1) / 64), each the
  median of three requests in the process;
- the quantized product alone, 2048 x 8192 (N x K) 4- and 8-bit weights times 1
  and 8 bf16 rows, the median of 20 calls after a warm-up.

Medians over the rounds go to stdout as a markdown table. Timings on a shared
machine are noisy: compare levels only within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = """
import json, random, statistics, time
import torch
from radixrt import Runtime
from radixrt.kernels import cpu

result = {"isa": cpu.isa()}
kernel = cpu.quantized_matmul()
generator = torch.Generator().manual_seed(0)
num_rows, num_cols = 2048, 8192
codes = torch.randint(0, 16, (num_rows, num_cols), generator=generator, dtype=torch.uint8)
scales = (torch.rand(num_rows, num_cols // 32, generator=generator) * 0.02).half().float()
offsets = (torch.randn(num_rows, num_cols // 32, generator=generator) * 0.05).half().float()
weights = {4: kernel.pack_int4(codes, scales, offsets),
           8: kernel.pack_int8((codes.to(torch.int16) * 16 - 128).to(torch.int8), scales)}
for bits, packed in weights.items():
    for rows in (1, 8):
        x = torch.randn(rows, num_cols, generator=generator).bfloat16()
        kernel(x, packed)
        times = []
        for _ in range(20):
            started = time.perf_counter()
            kernel(x, packed)
            times.append(time.perf_counter() - started)
        result[f"product_{bits}bit_m{rows}_ms"] = 1e3 * statistics.median(times)

def timed(runtime, ids, tokens):
    started = time.perf_counter()
    runtime.generate(input_ids=ids, sampling_params={"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True})
    return time.perf_counter() - started

with Runtime(max_total_tokens=4096, disable_radix_cache=True) as runtime:
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 30000) for _ in range(512)]
    short = prompt[:16]
    timed(runtime, short, 2)
    result["prefill_512_s"] = statistics.median(timed(runtime, prompt, 1) for _ in range(3))
    steps = [(timed(runtime, short, 65) - timed(runtime, short, 1)) / 64 for _ in range(3)]
    result["decode_step_ms"] = 1e3 * statistics.median(steps)
print(json.dumps(result))
"""

COLUMNS = [("decode_step_ms", "batch-1 decode step, ms"), ("prefill_512_s", "512-token prefill, s"),
           ("product_4bit_m1_ms", "4-bit x1, ms"), ("product_4bit_m8_ms", "4-bit x8, ms"),
           ("product_8bit_m1_ms", "8-bit x1, ms"), ("product_8bit_m8_ms", "8-bit x8, ms")]


def run_level(level: str) -> dict[str, float | str]:
    env = dict(os.environ, RADIXRT_CPU_ISA=level)
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{level}: the measurement failed:\n{done.stderr[-4000:]}")
    result: dict[str, float | str] = json.loads(done.stdout.strip().splitlines()[-1])
    if result["isa"] != level:
        raise RuntimeError(f"RADIXRT_CPU_ISA={level} loaded the {result['isa']} build")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from radixrt.kernels.cpu import build

    levels = build.LEVELS[: build.LEVELS.index(build.cpu_level()) + 1]
    results: dict[str, list[dict[str, float | str]]] = {level: [] for level in levels}
    for round_index in range(args.rounds):
        for level in levels if round_index % 2 == 0 else reversed(levels):
            results[level].append(run_level(level))
            print(f"round {round_index + 1} {level}: {results[level][-1]}", file=sys.stderr)
    print("| level | " + " | ".join(title for _, title in COLUMNS) + " |")
    print("|---|" + "---:|" * len(COLUMNS))
    for level in levels:
        cells = [statistics.median(float(r[key]) for r in results[level]) for key, _ in COLUMNS]
        print(f"| {level} | " + " | ".join(f"{cell:.3g}" for cell in cells) + " |")


if __name__ == "__main__":
    main()
