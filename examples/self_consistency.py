"""Self-consistency: sample k reasoning paths for one question, answer by majority vote.

The few-shot prompt and the question are computed once; the k branches of
`s.fork(k)` start from that cached prefix and decode together in one batch.

    python examples/self_consistency.py [--k 8] [--question "..."]
"""

from __future__ import annotations

import argparse
import re
import time
from collections import Counter

import radixrt
from radixrt import function, gen

FEW_SHOT = """Question: Tom has 3 apples and buys 4 more. How many apples does he have?
Answer: Tom starts with 3 apples. He buys 4 more, so 3 + 4 = 7. The answer is 7.

Question: A box holds 10 pens. Sara takes out 4 pens. How many pens are left?
Answer: The box had 10 pens. Sara took 4, so 10 - 4 = 6. The answer is 6.

Question: There are 5 birds on a tree and 2 more land on it. How many birds are there now?
Answer: There were 5 birds. 2 more landed, so 5 + 2 = 7. The answer is 7.

"""
QUESTION = "Mia has 6 candies and gets 3 more from her friend. How many candies does she have?"


@function
def self_consistency(s, question: str, k: int) -> None:
    s += FEW_SHOT + "Question: " + question + "\nAnswer:"
    paths = s.fork(k)
    for path in paths:
        path += gen("reasoning", max_tokens=48, temperature=0.7, stop="\n")
    s.join(paths)  # s["reasoning"] is now the list of the k paths


def final_number(reasoning: str) -> str | None:
    """The answer a path states: the number after its last "answer is", else its last number."""
    stated = re.findall(r"answer is\s*(-?\d+)", reasoning)
    numbers = re.findall(r"-?\d+", reasoning)
    return (stated or numbers or [None])[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=8, help="reasoning paths to sample")
    parser.add_argument("--question", default=QUESTION)
    args = parser.parse_args()

    rt = radixrt.Runtime()  # the bundled SmolLM2-135M-Instruct
    start = time.perf_counter()
    state = self_consistency.run(question=args.question, k=args.k, runtime=rt)
    elapsed = time.perf_counter() - start

    answers = [final_number(path) for path in state["reasoning"]]
    for path, answer in zip(state["reasoning"], answers):
        print(f"[{answer}] {path.strip()}")
    tally = Counter(a for a in answers if a is not None)
    print("\ntally:", ", ".join(f"{answer}: {votes}" for answer, votes in tally.most_common()) or "no numbers")
    if tally:
        print("majority answer:", tally.most_common(1)[0][0])
    stats = rt.cache_stats()
    print(f"{args.k} paths in {elapsed:.1f} s; cache hit rate {stats['hit_rate']:.0%} "
          f"({stats['cached_prompt_tokens']} of {stats['prompt_tokens']} prompt tokens)")
    rt.shutdown()


if __name__ == "__main__":
    main()
