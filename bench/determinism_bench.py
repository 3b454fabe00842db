"""Does batching change the answer? Greedy outputs of the same prompts under six ways of running them.

The bundled SmolLM2 (bf16, native 4-bit weights; or --model, e.g. its Hugging Face
folder for the dense path) answers N questions about one
shared ledger (a prefix of ~1,000 tokens) with G greedy tokens each, under:
one batch (the reference), one request at a time, a shuffled order, a tight
KV pool (evicting and retracting), the radix cache off, chunked prefill of
64 tokens, pages of 16 tokens. For radixrt's default mode and for
`deterministic=True`, it counts the prompts whose output equals the
reference's and the prompts that agree across every configuration, and
times each configuration (wall seconds, one run each: a rough cost, the
suite measures it properly).

Not a test: nothing is asserted.
Run: python bench/determinism_bench.py [--model FOLDER_OR_GGUF] [--dtype bfloat16|float32] [--prompts 24]
                                       [--new-tokens 24]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixrt import Runtime  # noqa: E402

CONFIGURATIONS: list[tuple[str, dict[str, Any], str]] = [
    ("one batch", {}, "together"),
    ("one at a time", {}, "one by one"),
    ("shuffled order", {}, "shuffled"),
    ("tight pool (2,000 tokens)", {"max_total_tokens": 2000}, "together"),
    ("cache off", {"disable_radix_cache": True}, "together"),
    ("chunked prefill of 64", {"chunked_prefill_size": 64}, "together"),
    ("pages of 16", {"page_size": 16}, "together"),
]


def ledger_prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    names = ["Ada", "Bruno", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jun"]
    items = ["apples", "pears", "melons", "plums", "figs", "limes", "dates", "kiwis"]
    records = "\n".join(
        f"{i + 1}. {rng.choice(names)} bought {rng.randint(2, 40)} {rng.choice(items)} for "
        f"{rng.randint(3, 90)}.{rng.randint(0, 99):02d} euros on day {rng.randint(1, 28)}."
        for i in range(40)
    )
    preamble = f"Here is a shop's ledger.\n{records}\n\n"
    questions = [f"Question: what did {rng.choice(names)} buy on day {rng.randint(1, 28)}, and how many "
                 f"{rng.choice(items)} were sold in total? Answer:" for _ in range(count)]
    return [preamble + q for q in questions]


def run(model: str | None, dtype: str, prompts: list[str], options: dict[str, Any], submit: str, new_tokens: int,
        deterministic: bool) -> tuple[list[list[int]], float]:
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    order = list(range(len(prompts)))
    if submit == "shuffled":
        random.Random(1).shuffle(order)
    with Runtime(model, dtype=dtype, deterministic=deterministic, **options) as runtime:
        start = time.perf_counter()
        if submit == "one by one":
            answers = [runtime.generate(prompts[i], params) for i in order]
        else:
            answers = runtime.generate([prompts[i] for i in order], params)
        seconds = time.perf_counter() - start
    outputs: list[list[int]] = [[] for _ in prompts]
    for i, answer in zip(order, answers):
        assert isinstance(answer, dict)
        outputs[i] = answer["output_ids"]
    return outputs, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Hugging Face folder or .gguf file (default: bundled)")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 or float32")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    prompts = ledger_prompts(args.prompts, args.seed)
    print("| mode | configuration | outputs equal to one batch's | seconds |")
    print("|---|---|---:|---:|")
    for deterministic in (False, True):
        mode = "deterministic" if deterministic else "default"
        results = []
        for name, options, submit in CONFIGURATIONS:
            outputs, seconds = run(args.model, args.dtype, prompts, options, submit, args.new_tokens, deterministic)
            results.append(outputs)
            same = sum(a == b for a, b in zip(outputs, results[0]))
            print(f"| {mode} | {name} | {same}/{len(prompts)} | {seconds:.1f} |", flush=True)
        agree = sum(all(r[i] == results[0][i] for r in results) for i in range(len(prompts)))
        print(f"| {mode} | **all seven agree** | {agree}/{len(prompts)} | |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
