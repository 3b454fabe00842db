"""A 5-shot prompt over many questions with `run_batch`: accuracy and throughput.

Every item's prompt starts with the same five examples; the first item to
reach the runtime computes them and every other item finds them in the
radix tree, so each item costs only its own question and answer.

    python examples/few_shot_batch.py [--threads 32]
"""

from __future__ import annotations

import argparse
import time

import radixrt
from radixrt import function, gen

EXAMPLES = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Egypt?", "Cairo"),
    ("What is the capital of Canada?", "Ottawa"),
]
FEW_SHOT = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in EXAMPLES)

QUESTIONS = [
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Spain?", "Madrid"),
    ("What is the capital of England?", "London"),
    ("What is the capital of Russia?", "Moscow"),
    ("What is the capital of China?", "Beijing"),
    ("What is the capital of Greece?", "Athens"),
    ("What is the capital of Portugal?", "Lisbon"),
    ("What is the capital of Austria?", "Vienna"),
    ("What is the capital of Ireland?", "Dublin"),
    ("What is the capital of Norway?", "Oslo"),
    ("What is the capital of Sweden?", "Stockholm"),
    ("What is the capital of Poland?", "Warsaw"),
    ("What is the capital of Hungary?", "Budapest"),
    ("What is the capital of Belgium?", "Brussels"),
    ("What is the capital of the Netherlands?", "Amsterdam"),
    ("What is the capital of Denmark?", "Copenhagen"),
    ("What is the capital of Finland?", "Helsinki"),
    ("What is the capital of Turkey?", "Ankara"),
    ("What is the capital of India?", "New Delhi"),
    ("What is the capital of Thailand?", "Bangkok"),
    ("What is the capital of South Korea?", "Seoul"),
    ("What is the capital of Australia?", "Canberra"),
    ("What is the capital of Argentina?", "Buenos Aires"),
    ("What is the capital of Brazil?", "Brasilia"),
    ("What is the capital of Mexico?", "Mexico City"),
    ("What is the capital of Peru?", "Lima"),
    ("What is the capital of Kenya?", "Nairobi"),
    ("What is the capital of Cuba?", "Havana"),
    ("What is the capital of the United States?", "Washington"),
    ("What is the capital of Switzerland?", "Bern"),
    ("What is the capital of Iran?", "Tehran"),
    ("What is the capital of Vietnam?", "Hanoi"),
]


@function
def answer(s, question: str) -> None:
    s += FEW_SHOT + f"Question: {question}\nAnswer:"
    s += gen("answer", max_tokens=8, temperature=0, stop="\n")


def is_correct(predicted: str, expected: str) -> bool:
    return predicted.strip().lower().startswith(expected.lower())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=32, help="programs in flight at once")
    args = parser.parse_args()

    rt = radixrt.Runtime()  # the bundled SmolLM2-135M-Instruct
    start = time.perf_counter()
    states = answer.run_batch(
        [{"question": q} for q, _ in QUESTIONS], runtime=rt, num_threads=args.threads, progress_bar=True
    )
    elapsed = time.perf_counter() - start

    correct = 0
    for (question, expected), state in zip(QUESTIONS, states):
        predicted = state["answer"].strip()
        ok = is_correct(predicted, expected)
        correct += ok
        print(f"{'ok  ' if ok else 'miss'} {question:45s} -> {predicted!r} (expected {expected})")
    output_tokens = sum(s.get_meta_info("answer")["completion_tokens"] for s in states)
    stats = rt.cache_stats()
    print(f"\naccuracy {correct}/{len(QUESTIONS)} = {correct / len(QUESTIONS):.0%}")
    print(f"{len(QUESTIONS)} programs in {elapsed:.1f} s: {len(QUESTIONS) / elapsed:.1f} programs/s, "
          f"{output_tokens / elapsed:.1f} output tokens/s")
    print(f"cache hit rate {stats['hit_rate']:.0%} "
          f"({stats['cached_prompt_tokens']} of {stats['prompt_tokens']} prompt tokens)")
    rt.shutdown()


if __name__ == "__main__":
    main()
