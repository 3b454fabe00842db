"""Peer benchmark (issue 12): radixrt against llama.cpp and vLLM's CPU build, same prompts, same machine.

Opt-in: never run in CI, imported by no test. Needs `pip install radixrt[peers]`
(llama-cpp-python, built from its source package) for the llama.cpp systems,
and vLLM's CPU build in a venv of its own (it pins its own torch) for `vllm`.

Systems, all on the bundled SmolLM2-135M-Instruct:
  radixrt        Runtime() defaults: bf16 on a CPU with native bf16, weights="auto"
                 (the GGUF file's Q4_1 projections used as stored)
  llamacpp-q4    llama-cpp-python on the same Q4_1 GGUF file: the like-for-like peer
  llamacpp-bf16  llama-cpp-python on a bf16 GGUF written by llama.cpp's own converter
                 (convert_hf_to_gguf.py) from radixrt's de-quantized Hugging Face folder
  vllm           vLLM's offline LLM on that folder in bf16, prefix caching on

llama.cpp runs with 2 threads (n_threads = n_threads_batch = 2) and one
sequence, so its requests run one after another and it reuses the longest
token prefix shared with the previous call; radixrt and vLLM get each
workload's requests in one call. Workloads (token ids built once here, the
same for every system; every request generates exactly its new tokens):
  table      a ~1,500-token table and a question, cold; then a second question
             on the same table (a prefix hit); 32 greedy tokens each
  few-shot   32 questions behind a ~900-token few-shot prefix, already cached; 16 greedy tokens
  fork       one ~330-token question sampled 8 times at temperature 0.7, 32 tokens each
  chat       8 chats x 4 turns in the model's chat template, each turn's prompt the
             whole conversation so far, turn by turn; 32 greedy tokens per reply
  JSON       16 records of a 10-field JSON Schema (structured_bench.py's), greedy, all at once,
             each system's own constraint path (radixrt's llguidance masks and jump-forward,
             vLLM's structured outputs with its default backend, llama.cpp's GBNF from the
             schema); outputs differ in length, so the table adds generated tokens / s;
             then the first 4 records one request at a time (an agent's loop)
  start-up   construction to the first answered 1-token request (imports excluded)

Every system and repetition runs in a fresh process (bench/peers_worker.py),
systems taking turns within each repetition. The table gives medians and,
for each peer, peer seconds / radixrt seconds (above 1: radixrt is faster).

Run: python bench/peers_bench.py [--systems radixrt,llamacpp-q4,llamacpp-bf16,vllm]
         [--runs 3] [--quick] [--workloads table,few_shot,fork,chat,structured] [--out FILE]
         [--vllm-python /path/to/venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peers_worker import MISSING_PACKAGE
from structured_bench import TEN_FIELDS, person_request
from transformers import AutoTokenizer

from radixrt.model.gguf_cache import cache_root, gguf_to_hf_folder
from radixrt.model.loader import bundled_model_path

SYSTEMS = ("radixrt", "llamacpp-q4", "llamacpp-bf16", "vllm")
WORKLOADS = ("table", "few_shot", "fork", "chat", "structured")
WORKER = Path(__file__).resolve().parent / "peers_worker.py"
# Symlinked from radixrt's GGUF cache: only what a Hugging Face loader or converter should read.
HF_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja")
ROWS = (  # (result key, label)
    ("table_cold_s", "table, cold"),
    ("table_hit_s", "table, second question (hit)"),
    ("few_shot_s", "few-shot, prefix warm"),
    ("fork_s", "fork, 8 samples"),
    ("chat_s", "chat, all turns"),
    ("structured_s", "JSON schema, 10 fields"),
    ("structured_one_by_one_s", "JSON schema, one record at a time"),
    ("startup_s", "start-up"),
)


@dataclass(frozen=True)
class Sizes:
    """Workload sizes; prompt lengths are targets in tokens, reached by adding whole rows or sentences."""

    table_tokens: int = 1500
    table_new_tokens: int = 32
    few_shot_prefix_tokens: int = 900
    few_shot_questions: int = 32
    few_shot_new_tokens: int = 16
    fork_tokens: int = 330
    fork_samples: int = 8
    fork_new_tokens: int = 32
    chat_system_tokens: int = 250
    chats: int = 8
    chat_turns: int = 4
    chat_new_tokens: int = 32
    structured_records: int = 16
    structured_new_tokens: int = 200
    structured_one_by_one: int = 4


FULL = Sizes()
QUICK = Sizes(table_tokens=300, table_new_tokens=8, few_shot_prefix_tokens=200, few_shot_questions=4,
              few_shot_new_tokens=8, fork_tokens=100, fork_samples=4, fork_new_tokens=8, chat_system_tokens=80,
              chats=2, chat_turns=2, chat_new_tokens=8, structured_records=2, structured_one_by_one=2)

_FIRST = ("Ada", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Keiko", "Liam",
          "Maya", "Nils", "Olga", "Pedro", "Rania", "Stefan", "Tomas", "Vera")
_LAST = ("Moreno", "Keller", "Russo", "Volkov", "Sato", "Haddad", "Lindqvist", "Laurent", "Costa", "Weber", "Tanaka",
         "Byrne", "Patel", "Eriksen", "Novak", "Alves", "Aziz", "Horvat", "Dubois", "Okafor")
_CITIES = ("Lisbon", "Kyoto", "Oslo", "Cape Town", "Montreal", "Vienna", "Hanoi", "Lima", "Reykjavik", "Seville",
           "Nairobi", "Melbourne", "Prague", "Bogota", "Edinburgh", "Istanbul")
_JOBS = ("teacher", "nurse", "carpenter", "pilot", "chemist", "baker", "lawyer", "architect", "farmer", "librarian")
_HOBBIES = ("chess", "climbing", "painting", "cycling", "gardening", "sailing", "pottery", "birdwatching")
_PRODUCTS = ("kettle", "backpack", "desk lamp", "rain jacket", "coffee grinder", "bicycle helmet", "blender",
             "phone case", "tent", "office chair", "toaster", "pair of boots")
_GOOD = ("works exactly as described", "arrived two days early", "feels solid and well made",
         "is quiet even at full speed", "was easy to set up", "still looks new after months of daily use",
         "came with clear instructions")
_BAD = ("stopped working after a week", "arrived with a cracked lid", "is much louder than advertised",
        "came with a missing part", "smells of burnt plastic", "feels cheap and flimsy", "broke on the second day")
_TRIP_QUESTIONS = ("What should I pack for the weather there?", "Can you suggest a day trip from the city?",
                   "How much should I budget per day for food and transport?",
                   "Which neighbourhood is best to stay in?", "What local dish should I try first?",
                   "How do I get from the airport to the centre?")


def _grow(count: Callable[[list[str]], int], target: int, make: Callable[[int], str]) -> list[str]:
    """Items make(0), make(1), ... until count(items) >= target tokens."""
    items: list[str] = []
    while not items or count(items) < target:
        items.append(make(len(items)))
    return items


class _Prompts:
    """Token ids of seeded text, drawn in a fixed order from one generator, so every run builds the same ids."""

    def __init__(self, tokenizer: Any, sizes: Sizes):
        self.tokenizer, self.sizes, self.rng = tokenizer, sizes, random.Random(12)

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def chat_text(self, messages: list[dict[str, str]]) -> str:
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    def user_turn(self, content: str) -> list[int]:
        return self.ids(self.chat_text([{"role": "user", "content": content}]))

    def table(self) -> dict[str, Any]:
        rng = self.rng
        people = [(f"{rng.choice(_FIRST)} {rng.choice(_LAST)}", rng.randint(19, 84), rng.choice(_CITIES),
                   rng.choice(_JOBS), rng.choice(_HOBBIES), rng.randint(1995, 2025)) for _ in range(400)]
        header = ("Here is a table of club members.\n\n| Name | Age | City | Occupation | Hobby | Member since |\n"
                  "|---|---|---|---|---|---|\n")

        def prompt(rows: list[str], question: str) -> list[int]:
            body = "\n".join(rows)
            return self.user_turn(f"{header}{body}\n\nAnswer using only the table. {question}")

        rows = _grow(lambda rows: len(prompt(rows, "")), self.sizes.table_tokens,
                     lambda i: "| " + " | ".join(map(str, people[i])) + " |")
        first, second = people[len(rows) // 3][0], people[2 * len(rows) // 3][0]
        return {"cold": prompt(rows, f"How old is {first}?"), "hit": prompt(rows, f"Which city does {second} live in?"),
                "new_tokens": self.sizes.table_new_tokens}

    def review(self) -> tuple[str, str]:
        label = self.rng.choice(["positive", "negative"])
        first, second = self.rng.sample(_GOOD if label == "positive" else _BAD, 2)
        product, weeks = self.rng.choice(_PRODUCTS), self.rng.randint(2, 11)
        return f"Review: I bought the {product} {weeks} weeks ago. It {first} and {second}.\nSentiment:", label

    def few_shot(self) -> dict[str, Any]:
        head = "Classify the sentiment of each product review as positive or negative.\n\n"
        shots = _grow(lambda shots: len(self.ids(head + "".join(shots))), self.sizes.few_shot_prefix_tokens,
                      lambda i: "{} {}\n\n".format(*self.review()))
        prefix = self.ids(head + "".join(shots))
        prompts = [prefix + self.ids(self.review()[0]) for _ in range(self.sizes.few_shot_questions)]
        return {"prefix": prefix, "prompts": prompts, "new_tokens": self.sizes.few_shot_new_tokens}

    def fork(self) -> dict[str, Any]:
        rng = self.rng

        def day(i: int) -> str:
            return (f"On day {i + 1} the shop sold {rng.randint(3, 40)} apples, {rng.randint(2, 25)} pears and "
                    f"{rng.randint(1, 12)} melons, and a farmer delivered {rng.randint(10, 60)} apples.")

        def prompt(days: list[str]) -> list[int]:
            return self.user_turn(f"A fruit shop starts the week with 120 apples, 80 pears and 30 melons. "
                                  f"{' '.join(days)} How many apples does the shop have at the end? Think step by step.")

        days = _grow(lambda days: len(prompt(days)), self.sizes.fork_tokens, day)
        return {"prompt": prompt(days), "n": self.sizes.fork_samples, "temperature": 0.7,
                "new_tokens": self.sizes.fork_new_tokens}

    def chat(self) -> dict[str, Any]:
        """Turn 1's prompt per chat, and the tokens that follow each reply (end of turn, next question).

        The template is rendered once per chat with a marker for every reply
        and split there, so the pieces are exactly what the template puts
        around replies, whatever the model's template is.
        """
        sizes, rng = self.sizes, self.rng

        def rule(i: int) -> str:
            city, question = rng.choice(_CITIES), rng.choice(_TRIP_QUESTIONS).lower().rstrip("?")
            return f"Rule {i + 1}: when a traveller to {city} asks {question}, answer briefly and name one local source."

        rules = _grow(lambda rules: len(self.ids(self.chat_text([{"role": "system", "content": " ".join(rules)}]))),
                      sizes.chat_system_tokens, rule)
        system = "You are a concise travel assistant for a small agency. " + " ".join(rules)
        reply = "\x00reply\x00"
        first, later = [], []
        for c in range(sizes.chats):
            month = ("March", "June", "September", "December")[c % 4]
            asks = [f"I am planning a week in {_CITIES[c % len(_CITIES)]} in {month}. Is that a good time to go?"]
            asks += rng.sample(_TRIP_QUESTIONS, sizes.chat_turns - 1)
            messages = [{"role": "system", "content": system}]
            for ask in asks:
                messages += [{"role": "user", "content": ask}, {"role": "assistant", "content": reply}]
            pieces = self.chat_text(messages[:-1]).split(reply)
            first.append(self.ids(pieces[0]))
            later.append([self.ids(piece) for piece in pieces[1:]])
        return {"first": first, "next": later, "turns": sizes.chat_turns, "new_tokens": sizes.chat_new_tokens}


def build_work(tokenizer: Any, sizes: Sizes) -> tuple[dict[str, Any], dict[str, str]]:
    """Every workload's token ids, and a line per table row on its shape."""
    prompts = _Prompts(tokenizer, sizes)
    table, few_shot, fork, chat = prompts.table(), prompts.few_shot(), prompts.fork(), prompts.chat()
    structured = {"prompts": [prompts.user_turn(person_request(i)) for i in range(sizes.structured_records)],
                  "schema": TEN_FIELDS, "new_tokens": sizes.structured_new_tokens,
                  "one_by_one": sizes.structured_one_by_one}
    work = {"startup": prompts.user_turn("Say hello."),
            "warmup": [[prompts.user_turn(f"Name a fruit that starts with {letter}.") for letter in "ABCD"]],
            "table": table, "few_shot": few_shot, "fork": fork, "chat": chat, "structured": structured}
    lengths = [len(p) for p in few_shot["prompts"]]
    shared, new = len(few_shot["prefix"]), sizes.few_shot_new_tokens
    shapes = {
        "table_cold_s": f"{len(table['cold']):,}-token prompt, {sizes.table_new_tokens} new",
        "table_hit_s": f"{len(table['hit']):,}-token prompt, {sizes.table_new_tokens} new",
        "few_shot_s": f"{sizes.few_shot_questions} x {min(lengths):,}-{max(lengths):,} tokens ({shared:,} shared), "
                      f"{new} new",
        "fork_s": f"{len(fork['prompt']):,}-token prompt, {sizes.fork_samples} x {sizes.fork_new_tokens} new, T=0.7",
        "chat_s": f"{sizes.chats} x {sizes.chat_turns} turns, {min(map(len, chat['first'])):,}-"
                  f"{_longest_chat(chat) - sizes.chat_new_tokens:,}-token prompts, {sizes.chat_new_tokens} new",
        "structured_s": f"{sizes.structured_records} records at once, greedy, each system's own JSON-schema "
                        f"constraint (at most {sizes.structured_new_tokens} tokens)",
        "structured_one_by_one_s": f"the first {sizes.structured_one_by_one} of them, each request after the "
                                   "one before (an agent's loop)",
        "startup_s": "construction to a first 1-token answer",
    }
    return work, shapes


def _longest_chat(chat: dict[str, Any]) -> int:
    """Tokens of the longest conversation, its last reply included."""
    return max(len(f) + sum(map(len, n)) for f, n in zip(chat["first"], chat["next"], strict=True)) + \
        chat["turns"] * chat["new_tokens"]


def context_tokens(work: dict[str, Any]) -> int:
    """A context length that holds the longest prompt and its new tokens, rounded up to 256."""
    table, few_shot, fork = work["table"], work["few_shot"], work["fork"]
    longest = max(len(table["cold"]) + table["new_tokens"],
                  max(map(len, few_shot["prompts"])) + few_shot["new_tokens"],
                  len(fork["prompt"]) + fork["new_tokens"], _longest_chat(work["chat"]))
    return -(-longest // 256) * 256


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated, from {', '.join(SYSTEMS)}; radixrt is the ratios' base")
    parser.add_argument("--runs", type=int, default=3, help="repetitions; the table shows medians")
    parser.add_argument("--quick", action="store_true", help="small workloads, 1 run: a smoke test of the script")
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    parser.add_argument("--vllm-python", default=sys.executable,
                        help="the python of the venv vLLM is installed in (not radixrt's: vLLM pins torch)")
    parser.add_argument("--llama-cpp-src", type=Path,
                        help="llama.cpp sources with convert_hf_to_gguf.py (default: unpack the installed "
                             "llama-cpp-python's source package, fetched with pip); only for a missing bf16 GGUF")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, from {', '.join(WORKLOADS)} (start-up always runs)")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads (n_threads and n_threads_batch)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one system's run may take")
    args = parser.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown or not args.systems:
        parser.error(f"--systems must name some of {', '.join(SYSTEMS)}; unknown: {', '.join(unknown)}")
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown or not args.workloads:
        parser.error(f"--workloads must name some of {', '.join(WORKLOADS)}; unknown: {', '.join(unknown)}")
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    if args.quick:
        args.runs = 1
    return args


def hf_folder() -> Path:
    """A clean Hugging Face folder of the bundled model, linked from radixrt's converted GGUF cache."""
    source = gguf_to_hf_folder(bundled_model_path())
    folder = cache_root() / "peers" / f"{source.name}-hf"
    folder.mkdir(parents=True, exist_ok=True)
    for name in HF_FILES:
        if (source / name).is_file() and not (folder / name).exists():
            (folder / name).symlink_to(source / name)
    return folder


def bf16_gguf(folder: Path, llama_cpp_src: Path | None) -> Path:
    """The bf16 GGUF llama.cpp's converter writes from `folder`, converted on first use."""
    target = folder.parent / "SmolLM2-135M-Instruct.bf16.gguf"
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        source = llama_cpp_src or _unpacked_llama_cpp_source(Path(tmp))
        partial = target.with_suffix(".partial")
        print(f"writing {target} with {source / 'convert_hf_to_gguf.py'}", file=sys.stderr)
        subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(folder), "--outtype", "bf16",
                        "--outfile", str(partial)], check=True, stdout=subprocess.DEVNULL)
        partial.rename(target)
    return target


def _unpacked_llama_cpp_source(tmp: Path) -> Path:
    """vendor/llama.cpp of the installed llama-cpp-python version's source package (pip download)."""
    import tarfile
    from importlib.metadata import PackageNotFoundError, version

    try:
        wanted = version("llama-cpp-python")
    except PackageNotFoundError:
        sys.exit("the bf16 GGUF is made with llama-cpp-python's converter: pip install radixrt[peers]")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(tmp),
                    f"llama-cpp-python=={wanted}"], check=True, stdout=subprocess.DEVNULL)
    (archive,) = tmp.glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
    return tmp / archive.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"


def run_worker(python: str, system: str, spec_path: Path, timeout_s: float) -> dict[str, Any] | str:
    """One system's results, or why it failed (the tail of its error output)."""
    out_path = spec_path.with_name(f"{system}.json")
    try:
        proc = subprocess.run([python, str(WORKER), system, str(spec_path), str(out_path)],
                              capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return f"no result within {timeout_s:.0f} s"
    except OSError as error:
        return f"cannot start {python}: {error}"
    if proc.returncode == MISSING_PACKAGE:
        return proc.stderr.strip().splitlines()[-1]
    if proc.returncode:
        tail = "\n".join(proc.stderr.strip().splitlines()[-12:])
        return f"exit status {proc.returncode}:\n{tail}"
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def report(results: dict[str, list[dict[str, Any]]], failures: dict[str, str], shapes: dict[str, str],
           runs: int, load: tuple[float, float]) -> str:
    """The markdown report: medians per workload and system, peer / radixrt ratios, reuse, raw runs."""
    systems = list(results)

    def median(system: str, key: str) -> float | None:
        values = [r[key] for r in results[system] if key in r]
        return statistics.median(values) if values else None

    lines = [f"| workload | shape | {' | '.join(systems)} |", "|---|---|" + "---:|" * len(systems)]
    for key, label in ROWS:
        reference = median("radixrt", key) if "radixrt" in results else None
        cells = []
        for system in systems:
            value = median(system, key)
            ratio = f" ({value / reference:.2f}x)" if value is not None and reference and system != "radixrt" else ""
            cells.append("-" if value is None else f"{value:.2f} s{ratio}")
        lines.append(f"| {label} | {shapes[key]} | {' | '.join(cells)} |")
    reuse = []
    for system in systems:
        reused, prompt = median(system, "chat_reused_tokens"), median(system, "chat_prompt_tokens")
        reuse.append("n/a" if reused is None or not prompt else f"{reused / prompt:.1%} of {prompt:,.0f}")
    lines.append(f"| chat: prompt tokens reused | | {' | '.join(reuse)} |")
    for label, key in (("", "structured"), (", one at a time", "structured_one_by_one")):
        throughput = []
        for system in systems:
            seconds, tokens = median(system, f"{key}_s"), median(system, f"{key}_tokens")
            throughput.append("-" if not seconds or tokens is None else f"{tokens / seconds:.0f} tok/s")
        lines.append(f"| JSON schema{label}: generated tokens / s | | {' | '.join(throughput)} |")
    kind = f"medians of {runs}" if runs > 1 else "1 run"
    note = (f"Seconds, {kind}; (Nx) = peer seconds / radixrt seconds, above 1 when radixrt is faster. "
            f"{os.cpu_count()} cores; 1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end "
            "(the benchmark itself adds up to about 2).")
    lines += ["", note, ""]
    for system in systems:
        runs_text = "; ".join(", ".join(f"{key.removesuffix('_s')} {r[key]:.2f}" for key, _ in ROWS if key in r)
                              for r in results[system])
        lines.append(f"- {results[system][0]['version'] if results[system] else system}: {runs_text}")
    for system, why in failures.items():
        lines.append(f"- {system} left out: {why}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    folder = hf_folder()
    sizes = QUICK if args.quick else FULL
    work, shapes = build_work(AutoTokenizer.from_pretrained(folder), sizes)
    spec = {"threads": args.threads, "context_tokens": context_tokens(work), "hf_folder": str(folder),
            "gguf_q4": str(bundled_model_path()), "work": work, "workloads": args.workloads}
    if "llamacpp-bf16" in args.systems:
        spec["gguf_bf16"] = str(bf16_gguf(folder, args.llama_cpp_src))
    results: dict[str, list[dict[str, Any]]] = {system: [] for system in args.systems}
    failures: dict[str, str] = {}
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for run in range(args.runs):
            for system in [s for s in args.systems if s not in failures]:
                python = args.vllm_python if system == "vllm" else sys.executable
                start = time.perf_counter()
                outcome = run_worker(python, system, spec_path, args.timeout)
                status = "failed" if isinstance(outcome, str) else "done"
                print(f"run {run + 1}/{args.runs} {system}: {status} in {time.perf_counter() - start:.0f} s",
                      file=sys.stderr)
                if isinstance(outcome, str):
                    failures[system] = outcome
                    del results[system]
                else:
                    results[system].append(outcome)
    if not results:
        print("\n".join(f"{system} failed: {why}" for system, why in failures.items()), file=sys.stderr)
        return 1
    text = report(results, failures, shapes, args.runs, (load_at_start, os.getloadavg()[0]))
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    # The tokenizer has run threads before each worker is forked; this silences its warning in every worker.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
