"""The table example from our design documents: one long shared prefix, two questions.

The first question computes the table; the second finds it in the radix tree
and computes only its own few tokens. What the demo prints says so, and
compares the second question's time to first token (TTFT) and reused tokens
with the first's: those two figures are what the cache changes. This module
imports no torch, so the CLI prints the introduction before loading anything.
"""

from __future__ import annotations

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


DEMO_NAMES = ("John Doe", "Zack Blue")
INTRO = """\
radixrt demo: two questions about one 30-row table, asked one after the other.
The first question computes its whole prompt, table included. The second asks about
the same table, so the radix tree hands it the table's cached keys and values and only
its own last few tokens are computed: compare the two questions' time to first token
(TTFT) and reused prompt tokens.
The bundled model, SmolLM2-135M-Instruct, is tiny: its answers are often wrong. The demo
is about the cache, not the answers (the table's true value is shown beside each one).
"""


def run_demo(runtime: Any, names: tuple[str, ...] = DEMO_NAMES) -> list[dict[str, Any]]:
    """Ask about each name alone, one after the other, and print what the cache did."""
    ages = {row["Name"]: row["Age"] for row in table_rows()}
    results = []
    for number, name in enumerate(names, start=1):
        print(f"Question {number} of {len(names)}: what is the age of {name}?", flush=True)
        print("  computing the whole prompt..." if number == 1 else "  the table should come from the cache...",
              flush=True)
        out = runtime.generate(table_prompt(name), {"max_new_tokens": 10, "temperature": 0})
        meta = out["meta_info"]
        answer = (out["text"].strip().splitlines() or [""])[0]
        print(f"  answer: The age of {name} is {answer}  (the table says {ages.get(name, '?')})")
        print(f"  TTFT {meta['ttft']:.2f} s, {meta['cached_tokens']:,} of {meta['prompt_tokens']:,} prompt tokens "
              "reused from the cache\n", flush=True)
        results.append(out)
    if len(results) >= 2:
        print(summary(results[0]["meta_info"], results[-1]["meta_info"]), flush=True)
    return results


def summary(first: dict[str, Any], last: dict[str, Any]) -> str:
    """The figure that matters: how much of the last question's prompt the cache held, and the TTFT it saved."""
    reused, total = last["cached_tokens"], last["prompt_tokens"]
    if reused == 0:
        return ("The last question reused no prompt tokens, so it computed the whole table again "
                "(the radix cache is off, or too small to keep the table).")
    speedup = first["ttft"] / last["ttft"] if last["ttft"] > 0 else float("inf")
    return (f"The last question reused {reused:,} of its {total:,} prompt tokens ({reused / total:.0%}) and its "
            f"first token came {speedup:.0f}x sooner than the first question's "
            f"({last['ttft']:.2f} s against {first['ttft']:.2f} s).")
