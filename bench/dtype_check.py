"""Does bf16 answer like fp32? Greedy outputs of the table and few-shot workloads in both.

bf16 is radixrt's CPU default where the CPU has AVX-512 BF16 (it is faster);
this reports how often its greedy outputs equal fp32's on the benchmark's own
prompts: identical token sequences, and identical answers (the text up to the
first newline, the part a user reads). Not a test: nothing is asserted, and a
few differing low-margin tokens are expected from any precision change.

    python bench/dtype_check.py [--workloads table,few-shot-32]
"""

from __future__ import annotations

import argparse
import re
import time

import radixrt
from radixrt.benchmarks.workloads import FULL, build_workloads
from radixrt.demo import table_rows

_TABLE_QUESTION = re.compile(r"Question: what is the (.+?) of (.+?)\? Your answer")


def greedy_outputs(dtype: str, names: tuple[str, ...]) -> tuple[dict[str, list[list[int]]], object, list, float]:
    start = time.perf_counter()
    with radixrt.Runtime(dtype=dtype) as rt:
        workloads = build_workloads(rt.tokenizer, FULL, seed=0, names=names)
        outputs = {}
        for workload in workloads:
            params = {"max_new_tokens": workload.sampling.max_new_tokens, "temperature": 0, "ignore_eos": True}
            results = rt.generate(input_ids=[list(p) for p in workload.prompts], sampling_params=params)
            outputs[workload.name] = [r["output_ids"] for r in results]
        return outputs, rt.tokenizer, workloads, time.perf_counter() - start


def table_truth(tokenizer: object, prompt: tuple[int, ...]) -> str:
    """The table's value for the column and name a table prompt asks about."""
    column, name = _TABLE_QUESTION.search(tokenizer.decode(list(prompt))).groups()  # type: ignore[attr-defined]
    key = {"phone number": "Phone Number"}.get(column, column.capitalize())
    return str(next(row for row in table_rows() if row["Name"] == name)[key])


def first_line(tokenizer: object, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True).strip().split("\n")[0]  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="table,few-shot-32")
    args = parser.parse_args()
    names = tuple(args.workloads.split(","))
    bf16, tokenizer, workloads, bf16_s = greedy_outputs("bfloat16", names)
    fp32, _, _, fp32_s = greedy_outputs("float32", names)
    print(f"wall time: bf16 {bf16_s:.1f} s, fp32 {fp32_s:.1f} s (load included)")
    print("| workload | prompts | identical tokens | identical answers | first differing example |")
    print("|---|---:|---:|---:|---|")
    for name in names:
        pairs = list(zip(bf16[name], fp32[name]))
        same_tokens = sum(a == b for a, b in pairs)
        answers = [(first_line(tokenizer, a), first_line(tokenizer, b)) for a, b in pairs]
        same_answers = sum(a == b for a, b in answers)
        example = next((f"bf16 {a!r} / fp32 {b!r}" for a, b in answers if a != b), "-")
        print(f"| {name} | {len(pairs)} | {same_tokens}/{len(pairs)} | {same_answers}/{len(pairs)} | {example} |")
    table = next((w for w in workloads if w.name == "table"), None)
    if table is not None:
        truths = [table_truth(tokenizer, p) for p in table.prompts]
        for dtype, outputs in (("bf16", bf16), ("fp32", fp32)):
            correct = sum(first_line(tokenizer, ids).startswith(t) for ids, t in zip(outputs["table"], truths))
            print(f"table answers matching the table, {dtype}: {correct}/{len(truths)}")


if __name__ == "__main__":
    main()
