"""Structured generation on the bundled model: what a constraint costs, what jump-forward saves.

Three measurements, each in this one process, settings alternating round by round, medians
over --runs rounds:

1. Cost per sampled token, jump-forward off: B prompts (B = 1 and 32) constrained to a 10-field
   JSON Schema (strings, integers, numbers, enums), greedy, against the same prompts
   unconstrained with `ignore_eos` and `max_new_tokens` equal to each constrained output's
   length; the prompts are cached before timing, so both sides time decoding the same number of
   tokens in the same number of steps. Reported: wall time per decode step and the ratio.
2. Jump-forward: a schema-heavy extraction (many fixed keys) with jump-forward on against off,
   batch 1 and 8; the outputs must be the same tokens.
3. Compiling: the tokenizer's one-time preparation for the grammar library, then the 10-field
   schema cold (a new compiler each run) and from the cache.

Run: python bench/structured_bench.py [--runs N] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from radixrt import Runtime  # noqa: E402
from radixrt.sampling.grammar import Grammars, library_version  # noqa: E402

# A record of ten fields: what an extraction or an agent's tool arguments look like.
TEN_FIELDS = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 30},
        "country": {"enum": ["France", "Germany", "Japan", "Brazil", "Canada", "India"]},
        "occupation": {"type": "string", "maxLength": 40},
        "salary": {"type": "number", "minimum": 0},
        "married": {"type": "boolean"},
        "children": {"type": "integer", "minimum": 0, "maximum": 12},
        "email": {"type": "string", "maxLength": 60},
        "status": {"enum": ["active", "inactive", "pending"]},
    },
    "required": ["name", "age", "city", "country", "occupation", "salary", "married", "children", "email",
                 "status"],
    "additionalProperties": False,
}
# Many fixed keys with short values: most of the output is forced text.
EXTRACTION = {
    "type": "object",
    "properties": {
        "patient_identifier": {"type": "integer", "minimum": 0, "maximum": 99999},
        "primary_diagnosis_category": {"enum": ["cardiology", "neurology", "oncology"]},
        "admission_was_emergency": {"type": "boolean"},
        "length_of_stay_in_days": {"type": "integer", "minimum": 0, "maximum": 365},
        "discharge_destination_type": {"enum": ["home", "rehabilitation", "transfer"]},
        "follow_up_appointment_required": {"type": "boolean"},
        "number_of_prescribed_medications": {"type": "integer", "minimum": 0, "maximum": 30},
        "attending_physician_department": {"enum": ["internal medicine", "surgery", "pediatrics"]},
    },
    "required": ["patient_identifier", "primary_diagnosis_category", "admission_was_emergency",
                 "length_of_stay_in_days", "discharge_destination_type", "follow_up_appointment_required",
                 "number_of_prescribed_medications", "attending_physician_department"],
    "additionalProperties": False,
}
PEOPLE = ["Alice Martin", "Bruno Schmidt", "Chiara Rossi", "Daniel Okafor", "Emi Tanaka", "Farid Haddad",
          "Greta Lund", "Hugo Silva"]
CITIES = ["Lyon", "Hamburg", "Osaka", "Recife", "Toronto", "Pune", "Bergen", "Porto"]


def person_request(i: int) -> str:
    """The i-th user message of the 10-field workload (also `peers_bench.py`'s structured workload)."""
    return f"Write a JSON record for {PEOPLE[i % 8]} (case {i}), who lives in {CITIES[(i * 3) % 8]}, with every field filled in."


def person_prompts(count: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": person_request(i)}] for i in range(count)]


def discharge_prompts(count: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"Summarise discharge note {i}: the patient stayed {3 + i} days after an "
                                          "emergency admission for chest pain and goes home. Answer in JSON."}]
            for i in range(count)]  # fmt: skip


def outputs_of(result: Any) -> list[dict[str, Any]]:
    return result if isinstance(result, list) else [result]


async def _unconstrained(rt: Runtime, prompts: list[Any], lengths: list[int]) -> list[Any]:
    calls = [rt.async_generate(prompt, {"max_new_tokens": n, "ignore_eos": True, "temperature": 0})
             for prompt, n in zip(prompts, lengths)]  # fmt: skip
    return await asyncio.gather(*calls)


def timed_decode(rt: Runtime, run: Any) -> tuple[float, int, Any]:
    """Seconds, model steps and the result of `run()`."""
    steps = rt.engine.num_steps
    start = time.perf_counter()
    result = run()
    return time.perf_counter() - start, rt.engine.num_steps - steps, result


def cost_per_token(rt: Runtime, batch: int, runs: int) -> dict[str, Any]:
    prompts = person_prompts(batch)
    params = {"json_schema": TEN_FIELDS, "max_new_tokens": 256, "temperature": 0}
    first = outputs_of(rt.generate(prompts, params))  # warms the cache with the prompts
    lengths = [o["meta_info"]["completion_tokens"] for o in first]
    constrained, free = [], []
    for _ in range(runs):
        seconds, steps, result = timed_decode(rt, lambda: rt.generate(prompts, params))
        assert [o["output_ids"] for o in outputs_of(result)] == [o["output_ids"] for o in first]
        constrained.append(seconds / steps)
        seconds, steps, result = timed_decode(rt, lambda: asyncio.run(_unconstrained(rt, prompts, lengths)))
        assert [o["meta_info"]["completion_tokens"] for o in result] == lengths
        free.append(seconds / steps)
    c, f = statistics.median(constrained), statistics.median(free)
    return {"batch": batch, "tokens": sum(lengths), "constrained_ms_per_step": 1e3 * c,
            "unconstrained_ms_per_step": 1e3 * f, "ratio": c / f,
            "valid": all(_valid(o["text"], TEN_FIELDS) for o in first)}  # fmt: skip


def jump_forward(on: Runtime, off: Runtime, batch: int, runs: int) -> dict[str, Any]:
    prompts = discharge_prompts(batch)
    params = {"json_schema": EXTRACTION, "max_new_tokens": 256, "temperature": 0}
    reference = [o["output_ids"] for o in outputs_of(off.generate(prompts, params))]
    on.generate(prompts, params)  # both caches warm
    with_jumps, without = [], []
    drafted = on.cache_stats()["confirmed_draft_tokens"]
    for _ in range(runs):
        seconds, _, result = timed_decode(on, lambda: on.generate(prompts, params))
        assert [o["output_ids"] for o in outputs_of(result)] == reference, "jump-forward changed the output"
        with_jumps.append(seconds)
        seconds, _, result = timed_decode(off, lambda: off.generate(prompts, params))
        assert [o["output_ids"] for o in outputs_of(result)] == reference
        without.append(seconds)
    confirmed = (on.cache_stats()["confirmed_draft_tokens"] - drafted) / runs
    tokens = sum(len(ids) for ids in reference)
    return {"batch": batch, "tokens": tokens, "jumped_tokens_per_run": confirmed,
            "on_s": statistics.median(with_jumps), "off_s": statistics.median(without),
            "speedup": statistics.median(without) / statistics.median(with_jumps)}  # fmt: skip


def compile_times(rt: Runtime, runs: int) -> dict[str, Any]:
    vocab = rt.inputs.limits.vocab_size
    prepare, cold, warm = [], [], []
    text = json.dumps(TEN_FIELDS)
    for _ in range(runs):
        grammars = Grammars(rt.tokenizer, vocab, rt.inputs.eos_token_ids)
        start = time.perf_counter()
        grammars.prepare()
        prepare.append(time.perf_counter() - start)
        start = time.perf_counter()
        grammars.compile("json_schema", text)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        grammars.compile("json_schema", text)
        warm.append(time.perf_counter() - start)
    return {"vocab": vocab, "tokenizer_preparation_ms": 1e3 * statistics.median(prepare),
            "ten_field_schema_cold_ms": 1e3 * statistics.median(cold),
            "ten_field_schema_cached_ms": 1e3 * statistics.median(warm)}  # fmt: skip


def _valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        import jsonschema

        jsonschema.validate(json.loads(text), schema)
        return True
    except Exception:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{library_version()}, load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    figures: dict[str, Any] = {}
    with Runtime(jump_forward=False) as off:
        figures["compile"] = compile_times(off, args.runs)
        print("compile:", figures["compile"], flush=True)
        figures["cost"] = [cost_per_token(off, batch, args.runs) for batch in (1, 32)]
        for row in figures["cost"]:
            print("cost per step:", row, flush=True)
        with Runtime(jump_forward=True) as on:
            figures["jump_forward"] = [jump_forward(on, off, batch, args.runs) for batch in (1, 8)]
        for row in figures["jump_forward"]:
            print("jump-forward:", row, flush=True)
    print(f"# load at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
