"""Frontend programs with the radix cache on and off, on the bundled SmolLM2-135M-Instruct.

Two workloads, each run as `radixrt` programs:
  self-consistency  4 arithmetic questions one after another; each forks k = 8
                    paths that decode exactly 32 tokens (temperature 0.7,
                    seeded, ignore_eos), so both configurations do the same work
  few-shot batch    64 capital-city questions behind one 5-shot prefix of 546
                    tokens, with run_batch (32 threads), greedy, <= 8 tokens

Per configuration one Runtime (default dtype: bfloat16 on a CPU with native
bf16, else float32; the table's header says which) is loaded and warmed
up; every run starts from an empty cache (flush_cache), and the figures are
the median of the runs: wall time, and the cached-token ratio (prompt tokens
found in the radix tree / all prompt tokens). Wall time on a shared machine
is noisy: compare the two configurations of the same run, not runs of
different days.

Run: python bench/frontend_bench.py [--runs 3] [--k 8] [--items 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import radixrt  # noqa: E402
from radixrt import function, gen  # noqa: E402

ARITHMETIC_SHOTS = """Question: Tom has 3 apples and buys 4 more. How many apples does he have?
Answer: Tom starts with 3 apples. He buys 4 more, so 3 + 4 = 7. The answer is 7.

Question: A box holds 10 pens. Sara takes out 4 pens. How many pens are left?
Answer: The box had 10 pens. Sara took 4, so 10 - 4 = 6. The answer is 6.

Question: There are 5 birds on a tree and 2 more land on it. How many birds are there now?
Answer: There were 5 birds. 2 more landed, so 5 + 2 = 7. The answer is 7.

"""
ARITHMETIC_QUESTIONS = [
    "Mia has 6 candies and gets 3 more from her friend. How many candies does she have?",
    "A farmer has 12 cows and sells 5 of them. How many cows does he have left?",
    "Ben reads 4 pages in the morning and 7 pages at night. How many pages does he read?",
    "A class has 9 boys and 8 girls. How many children are in the class?",
]

COUNTRY_CARDS = [
    ("France", "Europe", "French", "Euro", "Paris",
     "France borders Belgium, Germany, Switzerland, Italy and Spain. It is known for its wine, its cheese and "
     "its long history of art and science. The Loire valley is famous for its castles, and the Alps rise along "
     "its eastern border with Italy and Switzerland."),
    ("Japan", "Asia", "Japanese", "Yen", "Tokyo",
     "Japan is an island country in the Pacific Ocean made of four main islands and thousands of smaller ones. "
     "Mount Fuji is its highest mountain. Its trains are known for being fast and on time, and its cities mix "
     "old temples with modern towers."),
    ("Italy", "Europe", "Italian", "Euro", "Rome",
     "Italy is a long peninsula shaped like a boot that reaches into the Mediterranean Sea. It was the center "
     "of the Roman Empire and later of the Renaissance. Its food, such as pasta and pizza, is eaten all over "
     "the world."),
    ("Egypt", "Africa", "Arabic", "Egyptian pound", "Cairo",
     "Egypt lies in the north-east corner of Africa. The Nile river flows through it from south to north, and "
     "most people live close to its banks. The pyramids of Giza were built more than four thousand years ago."),
    ("Canada", "North America", "English and French", "Canadian dollar", "Ottawa",
     "Canada is the second largest country in the world by area. It has more lakes than any other country and "
     "a long coast on three oceans. Most Canadians live within a few hundred kilometres of the border with the "
     "United States."),
]
PREAMBLE = (
    "You are a careful geography assistant. Each example below describes a country with a short fact card: "
    "its continent, its official language, its currency and a few notes about it. After the card comes a "
    "question about the country and the correct answer, written as a single name on one line with nothing "
    "else. Read the examples, then answer the last question in exactly the same way: give only the name of "
    "the city, spelled in English, and stop at the end of the line. Do not explain the answer, do not repeat "
    "the question, and do not add anything after the name.\n\n"
)
FEW_SHOT = PREAMBLE + "".join(
    f"Country: {country}\nContinent: {continent}\nOfficial language: {language}\nCurrency: {currency}\n"
    f"Notes: {notes}\nQuestion: What is the capital of {country}?\nAnswer: {capital}\n\n"
    for country, continent, language, currency, capital, notes in COUNTRY_CARDS
)
COUNTRIES = (
    "Germany Spain Russia China Greece Portugal Austria Ireland Norway Sweden Poland Hungary Belgium Denmark "
    "Finland Turkey India Thailand Australia Argentina Brazil Mexico Peru Kenya Cuba Switzerland Iran Vietnam "
    "Indonesia Philippines Malaysia Pakistan Bangladesh Nepal Afghanistan Iraq Jordan Lebanon Syria Morocco "
    "Algeria Tunisia Nigeria Ghana Ethiopia Chile Colombia Venezuela Ecuador Uruguay Paraguay Ukraine Romania "
    "Bulgaria Serbia Croatia Slovakia Slovenia Iceland Estonia Latvia Lithuania Mongolia Qatar Senegal"
).split()


@function
def self_consistency(s, question: str, k: int) -> None:
    s += ARITHMETIC_SHOTS + "Question: " + question + "\nAnswer:"
    paths = s.fork(k)
    for i, path in enumerate(paths):
        path += gen("reasoning", max_tokens=32, temperature=0.7, seed=i, ignore_eos=True)
    s.join(paths)


@function
def capital(s, country: str) -> None:
    s += FEW_SHOT + f"Country: {country}\nQuestion: What is the capital of {country}?\nAnswer:"
    s += gen("answer", max_tokens=8, temperature=0, stop="\n")


def run_self_consistency(rt: radixrt.Runtime, k: int) -> None:
    for question in ARITHMETIC_QUESTIONS:
        self_consistency.run(question=question, k=k, runtime=rt)


def run_few_shot(rt: radixrt.Runtime, items: int) -> None:
    countries = (COUNTRIES * (items // len(COUNTRIES) + 1))[:items]
    states = capital.run_batch([{"country": c} for c in countries], runtime=rt, num_threads=32)
    failed = [s.error for s in states if s.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} items failed") from failed[0]


def measure(rt: radixrt.Runtime, workload: Callable[[], None], runs: int) -> tuple[float, float]:
    """Median wall seconds and median cached-token ratio over `runs` runs, each from an empty cache."""
    seconds, ratios = [], []
    for _ in range(runs):
        rt.flush_cache()
        start = time.perf_counter()
        workload()
        seconds.append(time.perf_counter() - start)
        ratios.append(rt.cache_stats()["hit_rate"])
        print(f"    run: {seconds[-1]:.2f} s, cached-token ratio {ratios[-1]:.1%}", file=sys.stderr)
    return statistics.median(seconds), statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--k", type=int, default=8, help="self-consistency paths per question")
    parser.add_argument("--items", type=int, default=64, help="few-shot batch size")
    args = parser.parse_args()

    workloads: dict[str, Callable[[radixrt.Runtime], None]] = {
        f"self-consistency ({len(ARITHMETIC_QUESTIONS)} questions x k={args.k})": lambda rt: run_self_consistency(
            rt, args.k
        ),
        f"few-shot batch ({args.items} items, 5-shot prefix)": lambda rt: run_few_shot(rt, args.items),
    }
    results: dict[tuple[str, bool], tuple[float, float]] = {}
    for cache in (True, False):
        rt = radixrt.Runtime(disable_radix_cache=not cache)
        prefix_tokens = len(rt.tokenizer.encode(FEW_SHOT, add_special_tokens=False))
        setup = f"{str(rt.engine.runner.model.dtype).removeprefix('torch.')}, {rt.engine.device}"
        capital.run(country="Chile", runtime=rt)  # warm-up
        for name, workload in workloads.items():
            results[name, cache] = measure(rt, lambda: workload(rt), args.runs)
            print(f"  {name}, cache {'on' if cache else 'off'}: {results[name, cache][0]:.2f} s", file=sys.stderr)
        rt.shutdown()

    print(f"\n{rt.model_name} ({setup}); few-shot prefix {prefix_tokens} tokens; median of {args.runs} runs\n")
    print("| workload | cache | wall time (s) | cached-token ratio | speedup |")
    print("|---|---|---|---|---|")
    for name in workloads:
        on, off = results[name, True], results[name, False]
        print(f"| {name} | on | {on[0]:.2f} | {on[1]:.1%} | {off[0] / on[0]:.2f}x |")
        print(f"| {name} | off | {off[0]:.2f} | {off[1]:.1%} | 1.00x |")


if __name__ == "__main__":
    main()
