"""Structured generation: xgrammar against llguidance, measured on this machine (issue 37).

What a grammar library costs radixrt, for each library, on SmolLM2's 49,152-token
vocabulary and on a 150,000-token one built from it:

    tokenizer preparation   once per model (xgrammar: TokenizerInfo.from_huggingface + GrammarCompiler;
                            llguidance: llguidance.hf.from_tokenizer)
    compile, cold           per request: a fresh compiler (xgrammar) each run, a fresh LLMatcher
                            (llguidance); also "to first mask" (compile + matcher + the first bitmask)
    compile, warm           xgrammar's own compile cache; llguidance has none (a kept matcher's
                            deep_copy is given instead)
    mask per step           filling the next-token bitmask: one matcher walked over a valid document
                            of the schema, and 32 matchers at 32 different positions of it (one loop of
                            single fills, and each library's parallel batch call)
    accept / jump-forward / rollback per token, over the same walk
    GIL                     whether another Python thread runs while a thread fills a mask

The 150k vocabulary: SmolLM2's byte-level BPE plus 100,848 merges appended to its
model, each new token the concatenation of two tokens it already has (mostly a word
or word-start followed by a lower-case continuation; one in twenty punctuation,
digit and whitespace runs), each as long as a base token drawn at random. That is
what BPE training adds when asked for a larger vocabulary: more tokens over the
same byte alphabet with about the same lengths, so the token trie is wider where
a mask must look, without making the tokens longer. SmolLM2 has 1.6% tokens
without a letter; the new ones 5% (--symbol-share), as larger vocabularies carry
more code and whitespace runs. Appended to the BPE model, not as added tokens,
because both libraries treat added tokens apart (matched before pre-tokenization).

Every figure is a median over --runs runs; os.getloadavg() is recorded before each
measurement (the machine is shared). --check-stability repeats the whole set once
and prints both.

Run: PYTHONPATH=. python bench/grammar_libraries_bench.py [--runs N] [--json PATH] [--check-stability]
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WIDE_VOCAB_SIZE = 150_000
BATCH = 32

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999999},
        "name": {"type": "string", "minLength": 1, "maxLength": 64},
        "email": {"type": "string", "pattern": "^[a-z0-9._]+@[a-z0-9-]+\\.[a-z]{2,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "status": {"enum": ["active", "inactive", "pending", "banned"]},
        "verified": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["US", "CA", "MX"]},
            },
            "required": ["street", "city", "zip", "country"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 8},
        "notes": {"type": "string"},
    },
    "required": ["id", "name", "email", "age", "score", "status", "verified", "address", "tags"],
    "additionalProperties": False,
}
# A document of the schema, as a model would write it (", " and ": " separators; both libraries allow any whitespace).
DOCUMENT_TEXT = json.dumps({
    "id": 48213,
    "name": "Margaret Okonkwo-Hamilton",
    "email": "m.okonkwo@example.org",
    "age": 47,
    "score": 88.25,
    "status": "active",
    "verified": True,
    "address": {"street": "1427 Lighthouse Lane, Apartment 3B", "city": "Portland", "zip": "97205",
                "country": "US"},
    "tags": ["customer", "priority", "newsletter", "beta-tester"],
    "notes": "Prefers to be contacted by email in the morning; renewed her subscription twice this year.",
})
# (b) a contact field: an ISO date, a North-American phone number or an e-mail address.
REGEX = (r"(\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01]))"
         r"|(\+1 )?\(?\d{3}\)?[ .-]?\d{3}[ .-]?\d{4}"
         r"|[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}")
GRAMMARS = ("json_schema", "json_schema_no_lengths", "regex", "json_object")


def schema_without_string_lengths() -> dict[str, Any]:
    """SCHEMA less its minLength/maxLength keywords (xgrammar compiles a bounded string's repetition slowly)."""
    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k not in ("minLength", "maxLength")}
        return node
    return strip(SCHEMA)


def load_avg() -> str:
    return "%.2f %.2f %.2f" % os.getloadavg()


def median_of(runs: int, measure: Callable[[], float]) -> float:
    return statistics.median(measure() for _ in range(runs))


# ---------------------------------------------------------------- tokenizers

def smollm2_tokenizer() -> Any:
    """SmolLM2's transformers tokenizer, from the folder radixrt converts the bundled GGUF into."""
    from transformers import AutoTokenizer

    from radixrt.model.gguf_cache import gguf_to_hf_folder
    from radixrt.model.loader import bundled_model_path

    return AutoTokenizer.from_pretrained(gguf_to_hf_folder(bundled_model_path()))


def _by_length(tokens: list[str]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for token in tokens:
        out.setdefault(len(token), []).append(token)
    return out


def widened_tokenizer(base: Any, vocab_size: int, symbol_share: float) -> Any:
    """`base` with BPE merges appended until it has `vocab_size` tokens (see the module docstring)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    data = json.loads(base.backend_tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges: list[Any] = data["model"]["merges"]
    special = {t["content"] for t in data["added_tokens"]}
    tokens = [t for t in vocab if t not in special]
    # a new token is as long as a base token drawn at random: BPE's longer vocabularies are not longer tokens
    lengths = [len(t) for t in tokens if len(t) >= 2]
    word_parts = ([t for t in tokens if t[0] == "Ġ" and t[1:].isalpha() or t.isalpha()],
                  [t for t in tokens if t.isalpha() and t.islower()])
    symbol_parts = ([t for t in tokens if not any(c.isalpha() for c in t)],) * 2
    by_length = [[_by_length(part) for part in parts] for parts in (word_parts, symbol_parts)]
    rng = random.Random(0)
    next_id = len(vocab)
    while next_id < vocab_size:
        left_parts, right_parts = by_length[rng.random() < symbol_share]
        length = rng.choice(lengths)
        left_length = rng.randint(1, length - 1)
        lefts, rights = left_parts.get(left_length), right_parts.get(length - left_length)
        if not lefts or not rights:
            continue
        left, right = rng.choice(lefts), rng.choice(rights)
        merged = left + right
        if merged in vocab:
            continue
        vocab[merged] = next_id
        merges.append([left, right])
        next_id += 1
    backend = Tokenizer.from_str(json.dumps(data))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=base.eos_token, bos_token=base.bos_token)


# ---------------------------------------------------------------- the two libraries behind one shape

class XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer: Any):
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = len(hf_tokenizer)
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=self.vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info)
        self.batch_matcher = xgr.BatchGrammarMatcher()

    @staticmethod
    def prepare(hf_tokenizer: Any) -> None:
        import xgrammar as xgr

        xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=len(hf_tokenizer)))

    def compile(self, kind: str, compiler: Any = None) -> Any:
        compiler = compiler or self.compiler
        if kind == "json_schema":
            return compiler.compile_json_schema(json.dumps(SCHEMA))
        if kind == "json_schema_no_lengths":
            return compiler.compile_json_schema(json.dumps(schema_without_string_lengths()))
        if kind == "regex":
            return compiler.compile_regex(REGEX)
        return compiler.compile_builtin_json_grammar()

    def fresh_compiler(self) -> Any:
        return self.xgr.GrammarCompiler(self.info)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def new_matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, batch: int) -> Any:
        return self.xgr.allocate_token_bitmask(batch, self.vocab_size)

    def fill(self, matcher: Any, bitmask: Any, index: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, index)

    def fill_batch(self, matchers: list[Any], bitmask: Any) -> None:
        self.batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def rollback(self, matcher: Any, num_tokens: int) -> None:
        matcher.rollback(num_tokens)

    def jump_forward(self, matcher: Any) -> Any:
        return matcher.find_jump_forward_string()

    def copy(self, matcher: Any) -> Any:
        return matcher.fork()

    def reset(self, matcher: Any) -> None:
        matcher.reset()

    def ok(self, matcher: Any) -> bool:
        return True


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer: Any):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.llg_torch = llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=len(hf_tokenizer))
        self.vocab_size = len(hf_tokenizer)
        self.executor = llguidance.LLExecutor()

    @staticmethod
    def prepare(hf_tokenizer: Any) -> None:
        import llguidance.hf

        llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=len(hf_tokenizer))

    def compile(self, kind: str, compiler: Any = None) -> Any:
        LLMatcher = self.llg.LLMatcher
        if kind == "json_schema":
            grammar = LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
        elif kind == "json_schema_no_lengths":
            grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema_without_string_lengths()))
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(REGEX)
        else:  # what llguidance's docs give for "any JSON object"
            grammar = LLMatcher.grammar_from_json_schema('{"type": "object"}')
        matcher = LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise RuntimeError(f"llguidance: {kind}: {matcher.get_error()}")
        return matcher  # llguidance compiles into the matcher; there is no separate compiled object

    def fresh_compiler(self) -> Any:
        return None

    def matcher(self, compiled: Any) -> Any:
        return compiled

    def new_matcher(self, compiled: Any) -> Any:
        return self.compile("json_schema")  # a request's own compile: llguidance keeps nothing between them

    def bitmask(self, batch: int) -> Any:
        return self.llg_torch.allocate_token_bitmask(batch, self.vocab_size)

    def fill(self, matcher: Any, bitmask: Any, index: int) -> None:
        self.llg_torch.fill_next_token_bitmask(matcher, bitmask, index)

    def fill_batch(self, matchers: list[Any], bitmask: Any) -> None:
        self.llg_torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def rollback(self, matcher: Any, num_tokens: int) -> None:
        matcher.rollback(num_tokens)

    def jump_forward(self, matcher: Any) -> Any:
        return matcher.compute_ff_bytes()

    def jump_forward_tokens(self, matcher: Any) -> Any:
        return matcher.compute_ff_tokens()

    def copy(self, matcher: Any) -> Any:
        return matcher.deep_copy()

    def reset(self, matcher: Any) -> None:
        matcher.reset()

    def ok(self, matcher: Any) -> bool:
        return not matcher.is_error()


LIBRARIES: tuple[Any, ...] = (XGrammar, LLGuidance)


# ---------------------------------------------------------------- measurements

def measure_prepare(hf_tokenizer: Any, runs: int) -> dict[str, Any]:
    out: dict[str, Any] = {"load": load_avg()}
    for library in LIBRARIES:
        def once(library: Any = library) -> float:
            started = time.perf_counter()
            library.prepare(hf_tokenizer)
            return time.perf_counter() - started
        out[library.name] = median_of(runs, once)
    return out


def measure_compile(lib: Any, runs: int) -> dict[str, Any]:
    out: dict[str, Any] = {"load": load_avg()}
    for kind in GRAMMARS:
        cold, first_mask = [], []
        bitmask = lib.bitmask(1)
        for _ in range(runs):
            compiler = lib.fresh_compiler()
            started = time.perf_counter()
            compiled = lib.compile(kind, compiler)
            compiled_at = time.perf_counter()
            lib.fill(lib.matcher(compiled), bitmask, 0)
            cold.append(compiled_at - started)
            first_mask.append(time.perf_counter() - started)
        # warm: xgrammar's cache (same compiler, same grammar again); llguidance has none: a kept matcher's copy
        warm = []
        if isinstance(lib, XGrammar):
            compiler = lib.fresh_compiler()
            lib.compile(kind, compiler)
            for _ in range(runs):
                started = time.perf_counter()
                lib.compile(kind, compiler)
                warm.append(time.perf_counter() - started)
        else:
            kept = lib.compile(kind)
            for _ in range(runs):
                started = time.perf_counter()
                lib.copy(kept)
                warm.append(time.perf_counter() - started)
        out[kind] = {"cold_s": statistics.median(cold), "to_first_mask_s": statistics.median(first_mask),
                     "warm_s": statistics.median(warm)}
    return out


def walk_document(lib: Any, tokens: list[int], runs: int) -> dict[str, Any]:
    """Batch 1: one matcher over the document; per token: fill, accept, jump-forward query, rollback(1) + re-accept.

    Each run's matcher is what a request gets: xgrammar's from the cached compiled grammar, llguidance's
    compiled afresh (it has no cache, and builds its lexer states lazily, during the first fills)."""
    compiled = lib.compile("json_schema")
    bitmask = lib.bitmask(1)
    load = load_avg()
    per_run: dict[str, list[float]] = {"fill": [], "accept": [], "jump_forward": [], "rollback": []}
    if isinstance(lib, LLGuidance):
        per_run["jump_forward_tokens"] = []
    fills_last: list[float] = []
    forced_seen = 0
    for _ in range(runs):
        matcher = lib.new_matcher(compiled)
        sums = dict.fromkeys(per_run, 0.0)
        fills_last = []
        forced_seen = 0
        for token in tokens:
            t0 = time.perf_counter()
            lib.fill(matcher, bitmask, 0)
            t1 = time.perf_counter()
            forced = lib.jump_forward(matcher)
            t2 = time.perf_counter()
            if isinstance(lib, LLGuidance):
                lib.jump_forward_tokens(matcher)
                sums["jump_forward_tokens"] += time.perf_counter() - t2
            forced_seen += bool(forced)
            t3 = time.perf_counter()
            if not lib.accept(matcher, token):
                raise RuntimeError(f"{lib.name} rejected token {token} of the document")
            t4 = time.perf_counter()
            lib.rollback(matcher, 1)
            t5 = time.perf_counter()
            lib.accept(matcher, token)
            sums["fill"] += t1 - t0
            sums["jump_forward"] += t2 - t1
            sums["accept"] += t4 - t3
            sums["rollback"] += t5 - t4
            fills_last.append(t1 - t0)
        if not lib.ok(matcher):
            raise RuntimeError(f"{lib.name}: matcher in error after the document")
        for key, total in sums.items():
            per_run[key].append(total / len(tokens))
    out: dict[str, Any] = {"load": load, "tokens": len(tokens), "positions_with_forced_text": forced_seen}
    out.update({f"{key}_mean_s": statistics.median(values) for key, values in per_run.items()})
    out["fill_p50_s"] = statistics.median(fills_last)
    out["fill_max_s"] = max(fills_last)
    return out


def batch_matchers(lib: Any, compiled: Any, tokens: list[int]) -> tuple[list[Any], list[int]]:
    """BATCH matchers at evenly spread positions of the document (the last one near its end)."""
    matchers, positions = [], []
    for i in range(BATCH):
        position = i * (len(tokens) - 1) // BATCH
        matcher = lib.new_matcher(compiled)
        for token in tokens[:position]:
            lib.accept(matcher, token)
        matchers.append(matcher)
        positions.append(position)
    return matchers, positions


def advance(lib: Any, matchers: list[Any], positions: list[int], tokens: list[int]) -> None:
    for i, matcher in enumerate(matchers):
        if positions[i] == len(tokens) - 1:  # wrap: start the document again
            lib.reset(matcher)
            positions[i] = 0
        lib.accept(matcher, tokens[positions[i]])
        positions[i] += 1


def measure_batch(lib: Any, tokens: list[int], runs: int, steps: int) -> dict[str, Any]:
    """32 matchers at 32 positions, advanced a token a step; the loop of single fills and the parallel
    batch call each fill their own set of matchers (llguidance's lazy lexer states are per matcher)."""
    compiled = lib.compile("json_schema")
    loop_set, positions = batch_matchers(lib, compiled, tokens)
    par_set, par_positions = batch_matchers(lib, compiled, tokens)
    bitmask, bitmask_par = lib.bitmask(BATCH), lib.bitmask(BATCH)
    load = load_avg()
    loop_runs, par_runs = [], []
    for _ in range(runs):
        loop_total = par_total = 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            for i, matcher in enumerate(loop_set):
                lib.fill(matcher, bitmask, i)
            t1 = time.perf_counter()
            lib.fill_batch(par_set, bitmask_par)
            t2 = time.perf_counter()
            loop_total += t1 - t0
            par_total += t2 - t1
            if not bool((bitmask == bitmask_par).all()):
                raise RuntimeError(f"{lib.name}: the batch fill differs from single fills")
            advance(lib, loop_set, positions, tokens)
            advance(lib, par_set, par_positions, tokens)
        loop_runs.append(loop_total / steps)
        par_runs.append(par_total / steps)
    return {"load": load, "loop_s": statistics.median(loop_runs), "parallel_s": statistics.median(par_runs)}


def measure_gil(lib: Any, tokens: list[int], min_fill_s: float = 0.5e-3) -> dict[str, Any]:
    """Whether a fill lets other Python threads run: a fresh matcher walks the document (fill, accept) while a
    second thread spins recording perf_counter(); a fill of >= min_fill_s counts as "ran beside" if a spinner
    timestamp falls well inside it. GIL held for the call: never (0 of n), whatever the machine's load."""
    compiled = lib.compile("json_schema")
    matcher, bitmask = lib.new_matcher(compiled), lib.bitmask(1)
    stamps: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())

    load = load_avg()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    spinner = threading.Thread(target=spin)
    spinner.start()
    fills = []
    try:
        time.sleep(0.005)
        for token in tokens:
            started = time.perf_counter()
            lib.fill(matcher, bitmask, 0)
            fills.append((started, time.perf_counter()))
            lib.accept(matcher, token)
    finally:
        stop.set()
        spinner.join()
        sys.setswitchinterval(interval)
    long_fills = [(a, b) for a, b in fills if b - a >= min_fill_s]
    margin = 50e-6
    beside = sum(bisect.bisect_left(stamps, end - margin) > bisect.bisect_right(stamps, start + margin)
                 for start, end in long_fills)
    return {"load": load, "long_fills": len(long_fills), "other_thread_ran_during": beside}


def measure_concurrent_compile(lib: Any) -> dict[str, Any]:
    """Two different grammars compiled at once from two threads on one compiler/tokenizer: no crash, and the time."""
    kinds = ("json_schema", "regex")
    results: dict[str, Any] = {}
    errors: list[str] = []

    def work(kind: str) -> None:
        try:
            results[kind] = lib.compile(kind, compiler)
        except Exception as error:  # reported, not raised: this is a probe
            errors.append(repr(error))

    compiler = lib.fresh_compiler()
    started = time.perf_counter()
    for kind in kinds:
        lib.compile(kind, compiler)
    sequential = time.perf_counter() - started
    compiler = lib.fresh_compiler()
    threads = [threading.Thread(target=work, args=(kind,)) for kind in kinds]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    concurrent = time.perf_counter() - started
    return {"sequential_s": sequential, "concurrent_s": concurrent, "errors": errors}


def features(lib: Any) -> dict[str, Any]:
    """Each capability tried, not read from documentation."""
    out: dict[str, Any] = {}

    def attempt(name: str, action: Callable[[], Any]) -> None:
        try:
            action()
            out[name] = True
        except Exception as error:
            out[name] = f"no ({type(error).__name__}: {str(error)[:80]})"

    if isinstance(lib, XGrammar):
        xgr = lib.xgr
        attempt("ebnf", lambda: lib.compiler.compile_grammar('root ::= "yes" | "no" | [0-9]+'))
        attempt("lark", lambda: lib.compiler.compile_lark('start: "yes" | "no" | /[0-9]+/'))
        tag = xgr.StructuralTagItem(begin="<function=get>", schema={"type": "object"}, end="</function>")
        attempt("structural_tag", lambda: lib.compiler.compile_structural_tag(
            xgr.StructuralTag.from_legacy_structural_tag([tag], ["<function="])))
    else:
        LLMatcher = lib.llg.LLMatcher

        def lark(text: str) -> None:
            matcher = LLMatcher(lib.tokenizer, LLMatcher.grammar_from_lark(text))
            if matcher.is_error():
                raise RuntimeError(matcher.get_error())

        def gbnf() -> None:
            matcher = LLMatcher(lib.tokenizer, lib.llg.grammar_from("gbnf", 'root ::= "yes" | "no" | [0-9]+'))
            if matcher.is_error():
                raise RuntimeError(matcher.get_error())

        def struct_tag() -> None:
            tag = lib.llg.StructTag(trigger="<function=", begin="<function=get>", grammar={"type": "object"},
                                    end="</function>")
            lark = lib.llg.StructTag.to_grammar([tag], assume_special=False)  # "<function=" is text here
            matcher = LLMatcher(lib.tokenizer, LLMatcher.grammar_from_lark(lark))
            if matcher.is_error():
                raise RuntimeError(matcher.get_error())

        attempt("ebnf", gbnf)
        attempt("lark", lambda: lark('start: "yes" | "no" | /[0-9]+/'))
        attempt("structural_tag", struct_tag)
    return out


def jump_forward_sample(lib: Any, hf_tokenizer: Any) -> list[str]:
    """What the forced-text query answers at a few points of the schema (for the report)."""
    compiled = lib.compile("json_schema")
    matcher = lib.new_matcher(compiled)
    samples: list[str] = []
    tokens = hf_tokenizer.encode(DOCUMENT_TEXT, add_special_tokens=False)
    for index, token in enumerate(tokens):
        forced = lib.jump_forward(matcher)
        if forced and len(samples) < 4:
            entry = f"after {hf_tokenizer.decode(tokens[:index])[-12:]!r}: {forced!r}"
            if isinstance(lib, LLGuidance):
                entry += f" tokens {hf_tokenizer.decode(lib.jump_forward_tokens(matcher))!r}"
            samples.append(entry)
        lib.accept(matcher, token)
    return samples


def run_all(tokenizers: dict[str, Any], runs: int) -> dict[str, Any]:
    """Every per-vocabulary figure, both libraries, in one pass."""
    results: dict[str, Any] = {}
    for vocab_name, hf_tokenizer in tokenizers.items():
        tokens = hf_tokenizer.encode(DOCUMENT_TEXT, add_special_tokens=False)
        entry: dict[str, Any] = {"document_tokens": len(tokens), "prepare_s": measure_prepare(hf_tokenizer, runs)}
        for library in LIBRARIES:
            lib = library(hf_tokenizer)
            entry[lib.name] = {
                "compile": measure_compile(lib, runs),
                "walk_batch1": walk_document(lib, tokens, runs),
                "batch32": measure_batch(lib, tokens, runs, steps=8),
                "gil": measure_gil(lib, tokens),
            }
            print(f"  {vocab_name} {lib.name} done (load {load_avg()})", flush=True)
        results[vocab_name] = entry
    return results


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}" if seconds < 10e-3 else f"{seconds * 1e3:.1f}"


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f}"


def print_table(results: dict[str, Any]) -> None:
    names = [library.name for library in LIBRARIES]
    print(f"\n| figure | vocab | {' | '.join(names)} |")
    print(f"|---|---|{'---|' * len(names)}")
    for vocab, entry in results.items():
        def row(label: str, values: list[str]) -> None:
            print(f"| {label} | {vocab} | {' | '.join(values)} |")

        row("tokenizer preparation, ms", [ms(entry["prepare_s"][n]) for n in names])
        for kind in GRAMMARS:
            row(f"compile {kind}, cold, ms", [ms(entry[n]["compile"][kind]["cold_s"]) for n in names])
            row(f"compile {kind} + matcher + first mask, ms",
                [ms(entry[n]["compile"][kind]["to_first_mask_s"]) for n in names])
            row(f"compile {kind}, warm (xgr cache / llg deep_copy), ms",
                [ms(entry[n]["compile"][kind]["warm_s"]) for n in names])
        row("mask fill, batch 1, mean per step, us", [us(entry[n]["walk_batch1"]["fill_mean_s"]) for n in names])
        row("mask fill, batch 1, p50 / max, us",
            [f"{us(entry[n]['walk_batch1']['fill_p50_s'])} / {us(entry[n]['walk_batch1']['fill_max_s'])}"
             for n in names])
        row("mask fill, batch 32, loop of single fills, ms", [ms(entry[n]["batch32"]["loop_s"]) for n in names])
        row("mask fill, batch 32, parallel batch call, ms", [ms(entry[n]["batch32"]["parallel_s"]) for n in names])
        row("accept token, us", [us(entry[n]["walk_batch1"]["accept_mean_s"]) for n in names])
        row("jump-forward query (xgr string / llg bytes), us",
            [us(entry[n]["walk_batch1"]["jump_forward_mean_s"]) for n in names])
        row("llg compute_ff_tokens, us",
            ["-" if "jump_forward_tokens_mean_s" not in entry[n]["walk_batch1"]
             else us(entry[n]["walk_batch1"]["jump_forward_tokens_mean_s"]) for n in names])
        row("rollback(1), us", [us(entry[n]["walk_batch1"]["rollback_mean_s"]) for n in names])
        row("GIL: fills >= 0.5 ms during which another Python thread ran",
            [f"{entry[n]['gil']['other_thread_ran_during']} of {entry[n]['gil']['long_fills']}" for n in names])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", help="write every figure (with the load averages) to this file")
    parser.add_argument("--symbol-share", type=float, default=0.05,
                        help="share of the 150k vocabulary's new tokens that have no letter (default 0.05)")
    parser.add_argument("--check-stability", action="store_true", help="repeat the measurements once at the end")
    args = parser.parse_args()

    from importlib.metadata import version

    started = time.perf_counter()
    print(f"{platform.machine()}, {os.cpu_count()} cpus, "
          + ", ".join(f"{name} {version(name)}" for name in ("torch", "transformers", "xgrammar", "llguidance"))
          + f"; load {load_avg()}", flush=True)
    base = smollm2_tokenizer()
    wide = widened_tokenizer(base, WIDE_VOCAB_SIZE, args.symbol_share)
    tokenizers = {f"{len(base) // 1000}k": base, f"{len(wide) // 1000}k": wide}
    print(f"tokenizers ready in {time.perf_counter() - started:.1f} s: {[len(t) for t in tokenizers.values()]} tokens; "
          f"document {len(DOCUMENT_TEXT)} chars", flush=True)

    report: dict[str, Any] = {"features": {}, "concurrent_compile": {}, "jump_forward_samples": {}}
    for library in LIBRARIES:
        lib = library(base)
        report["features"][lib.name] = features(lib)
        report["concurrent_compile"][lib.name] = measure_concurrent_compile(lib)
        report["jump_forward_samples"][lib.name] = jump_forward_sample(lib, base)
    print(json.dumps(report, indent=1), flush=True)

    report["runs"] = [run_all(tokenizers, args.runs)]
    print_table(report["runs"][0])
    if args.check_stability:
        print("\nagain, to check the figures are stable:", flush=True)
        report["runs"].append(run_all(tokenizers, args.runs))
        print_table(report["runs"][1])
    print(f"\ntotal {time.perf_counter() - started:.0f} s; load now {load_avg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
