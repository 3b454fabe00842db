"""The table example from our design documents: one long shared prefix, two questions.

The first question computes the table; the second finds it in the radix tree
and computes only its own few tokens.
"""

from __future__ import annotations

import time
from typing import Any

SYSTEM_LINE = "You are a helpful assistant. Answer questions about the table below briefly and exactly."

_FIRST_NAMES = [
    "John", "Jane", "Alice", "Bob", "Carol", "David", "Eve", "Frank", "Grace", "Henry",
    "Irene", "Jack", "Karen", "Leo", "Mia", "Nina", "Oscar", "Paula", "Quinn", "Rosa",
    "Sam", "Tina", "Umar", "Vera", "Walt", "Xena", "Yuri", "Zack", "Amir", "Bella",
]
_LAST_NAMES = [
    "Doe", "Smith", "Brown", "Green", "White", "Black", "Gray", "Stone", "Hill", "King",
    "Wood", "Hall", "Young", "Allen", "Wright", "Scott", "Adams", "Baker", "Nelson", "Carter",
    "Mitchell", "Perez", "Roberts", "Turner", "Phillips", "Campbell", "Parker", "Blue", "Evans", "Collins",
]
_OCCUPATIONS = ["Engineer", "Teacher", "Doctor", "Designer", "Nurse", "Lawyer", "Chef", "Artist", "Pilot", "Writer"]
_COUNTRIES = ["USA", "Canada", "UK", "Germany", "France", "Spain", "Italy", "Japan", "Brazil", "India"]
_STREETS = ["Main St", "Oak Ave", "Pine Rd", "Maple Dr", "Cedar Ln", "Elm St", "Lake Rd", "Hill Ave"]


def table_rows() -> list[dict[str, Any]]:
    """30 deterministic rows; row 1 is John Doe (29), row 28 is Zack Blue (30)."""
    rows = []
    for i in range(30):
        first, last = _FIRST_NAMES[i], _LAST_NAMES[i]
        rows.append({
            "ID": i + 1,
            "Name": f"{first} {last}",
            "Age": 29 if i == 0 else 30 if i == 27 else 22 + (i * 7) % 40,
            "Occupation": _OCCUPATIONS[i % len(_OCCUPATIONS)],
            "Country": _COUNTRIES[(i * 3) % len(_COUNTRIES)],
            "Email": f"{first.lower()}.{last.lower()}@example.com",
            "Phone Number": f"+1-555-{1000 + i * 37:04d}",
            "Address": f"{100 + i * 11} {_STREETS[i % len(_STREETS)]}",
        })
    return rows


def table_markdown() -> str:
    rows = table_rows()
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def table_prompt(name: str) -> str:
    return (
        f"{SYSTEM_LINE}\n\n{table_markdown()}\n\n"
        f"Question: what is the age of {name}? Your answer: The age of {name} is "
    )


def run_demo(runtime: Any, names: tuple[str, ...] = ("John Doe", "Zack Blue")) -> list[dict[str, Any]]:
    """Ask about each name alone, one after the other, and print what the cache did."""
    results = []
    for name in names:
        started = time.perf_counter()
        out = runtime.generate(table_prompt(name), {"max_new_tokens": 10, "temperature": 0})
        latency = time.perf_counter() - started
        meta = out["meta_info"]
        print(f"Q: what is the age of {name}?")
        print(f"A: The age of {name} is {out['text'].strip()}")
        print(
            f"   latency {latency:.2f} s, ttft {meta['ttft']:.2f} s, "
            f"prompt tokens {meta['prompt_tokens']}, cached tokens {meta['cached_tokens']}\n"
        )
        results.append(out)
    stats = runtime.cache_stats()
    print(f"cache hit rate {stats['hit_rate']:.1%} ({stats['cached_prompt_tokens']}/{stats['prompt_tokens']} prompt tokens)")
    return results
