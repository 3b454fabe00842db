"""Benchmark of radixrt.tree.RadixTree on seeded scheduler traces.

Five workloads (chat, few-shot, tree-of-thought, random, long-context) are
generated from fixed seeds and run as a scheduler issues them: per request
match_prefix -> lock -> alloc from a PagePool (evicting from the tree when
short); once the batch of 8 is full, or the pool is dry with nothing left to
evict, each of its requests does insert -> free duplicate slots -> unlock. The
pool holds 25% of the trace's distinct tokens.

That run records every tree call (an operation is one match_prefix, lock,
unlock, insert or evict; reading MatchResult.indices belongs to the match).
The timed part replays exactly those calls on a fresh tree, so the PagePool
and the trace bookkeeping are not timed, and it counts CPU time
(time.process_time, torch on one thread), so other jobs on the machine blur
the figures less. The anchor is SGLang 0.5.23's pure-Python RadixCache on
traces of the same kinds, measured on this machine class.

Run: python bench/tree_bench.py [--quick] [--runs N] [--page-size P]
[--input array|list]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from array import array
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixrt.memory.page_pool import PagePool  # noqa: E402
from radixrt.tree import RadixTree  # noqa: E402

ANCHOR_US_PER_OP = {
    "chat": 21.0,
    "few-shot": 29.0,
    "tree-of-thought": 63.0,
    "random": 50.0,
    "long-context": 36.0,
}
DEEP_MATCH_TOKENS, DEEP_MATCH_EDGE = 100_000, 64
ANCHOR_DEEP_MATCH_MS = {"1 node": 0.24, "1563 nodes": 34.0}
VOCAB = 32_000
WINDOW = 8


@dataclass
class Request:
    prompt: list[int]
    output: list[int]


def _tokens(rng: random.Random, low: int, high: int, vocab: int = VOCAB) -> list[int]:
    return [rng.randrange(vocab) for _ in range(rng.randint(low, high))]


def chat(rng: random.Random, scale: float) -> list[Request]:
    """Multi-turn chat: 300-token system prompt, 8 turns, ~16 conversations active."""
    system = _tokens(rng, 300, 300)
    histories = [list(system) for _ in range(int(200 * scale))]
    turns_left = {conversation: 8 for conversation in range(len(histories))}
    waiting = deque(turns_left)
    active: list[int] = []
    trace = []
    while active or waiting:
        while waiting and len(active) < 16:
            active.append(waiting.popleft())
        conversation = rng.choice(active)
        history = histories[conversation]
        history += _tokens(rng, 20, 150)
        output = _tokens(rng, 50, 300)
        trace.append(Request(list(history), output))
        history += output
        turns_left[conversation] -= 1
        if not turns_left[conversation]:
            active.remove(conversation)
    return trace


def few_shot(rng: random.Random, scale: float) -> list[Request]:
    """2,000-token shared few-shot prefix, then one short question each."""
    prefix = _tokens(rng, 2000, 2000)
    return [
        Request(prefix + _tokens(rng, 30, 120), _tokens(rng, 10, 60))
        for _ in range(int(2000 * scale))
    ]


def tree_of_thought(rng: random.Random, scale: float) -> list[Request]:
    """Branching 3, depth 6, 64 tokens per thought, breadth first per problem."""
    trace = []
    for _ in range(max(1, int(4 * scale))):
        level = [_tokens(rng, 100, 200)]
        for _depth in range(6):
            next_level = []
            for path in level:
                for _branch in range(3):
                    thought = _tokens(rng, 64, 64)
                    trace.append(Request(list(path), thought))
                    next_level.append(path + thought)
            level = next_level
    return trace


def random_overlap(rng: random.Random, scale: float) -> list[Request]:
    """Vocabulary 50, lengths up to 2,000; half extend a prefix of an earlier one."""
    seen: list[list[int]] = []
    trace = []
    for _ in range(int(1500 * scale)):
        length = rng.randint(1, 2000)
        if seen and rng.random() < 0.5:
            base = rng.choice(seen)
            tokens = base[: rng.randint(1, len(base))]
            tokens += _tokens(rng, max(0, length - len(tokens)), max(0, length - len(tokens)), 50)
        else:
            tokens = _tokens(rng, length, length, 50)
        seen.append(tokens)
        trace.append(Request(tokens, _tokens(rng, 1, 32, 50)))
    return trace


def long_context(rng: random.Random, scale: float) -> list[Request]:
    """30k-token documents, questions skewed towards a few of them."""
    documents = [_tokens(rng, 30_000, 30_000) for _ in range(max(8, int(16 * scale)))]
    weights = [1.0 / (rank + 1) for rank in range(len(documents))]
    return [
        Request(rng.choices(documents, weights)[0] + _tokens(rng, 20, 80), _tokens(rng, 20, 100))
        for _ in range(int(300 * scale))
    ]


WORKLOADS = {
    "chat": chat,
    "few-shot": few_shot,
    "tree-of-thought": tree_of_thought,
    "random": random_overlap,
    "long-context": long_context,
}


MATCH, LOCK, UNLOCK, INSERT, EVICT = range(5)


@dataclass
class Recording:
    calls: list[tuple]
    """(MATCH, tokens) | (LOCK or UNLOCK, match number) | (INSERT, tokens,
    indices) | (EVICT, num_tokens), in the order the scheduler made them."""
    hit_rate: float
    results: list
    """What each insert and evict returned, to check the replay against."""


def record(trace: list[tuple], distinct_tokens: int, page_size: int) -> Recording:
    """Run the scheduler over (prompt, full, length) requests; record its tree calls."""
    tree = RadixTree(page_size)
    pool = PagePool(max(1, distinct_tokens // 4 // page_size), page_size)
    calls: list[tuple] = []
    results: list = []
    batch: list[tuple] = []
    matched = prompt_tokens = 0

    def run_batch() -> None:
        for full, length, match_number, match, slots in batch:
            indices = torch.cat((match.indices, slots))[:length]
            cached = tree.insert(full, indices)
            tree.unlock(match.last_node)
            calls.extend([(INSERT, full, indices), (UNLOCK, match_number)])
            results.append(cached)
            whole = length - length % page_size
            pool.free(slots[: cached - match.length])
            pool.free(slots[whole - match.length :])
        batch.clear()

    for match_number, (prompt, full, length) in enumerate(trace):
        match = tree.match_prefix(prompt)
        tree.lock(match.last_node)
        calls.extend([(MATCH, prompt), (LOCK, match_number)])
        matched += match.length
        prompt_tokens += len(prompt)
        needed_pages = pool.pages_for(length - match.length)
        while needed_pages > pool.available_pages:
            if tree.evictable_tokens:
                num_tokens = (needed_pages - pool.available_pages) * page_size
                freed = tree.evict(num_tokens)
                calls.append((EVICT, num_tokens))
                results.append(freed)
                pool.free(freed)
            elif batch:
                run_batch()
            else:
                raise RuntimeError("a request does not fit in the pool")
        batch.append((full, length, match_number, match, pool.alloc(length - match.length)))
        if len(batch) >= WINDOW:
            run_batch()
    run_batch()
    tree.check_invariants()
    assert tree.protected_tokens == 0
    assert pool.available + tree.total_tokens == pool.num_slots
    return Recording(calls, matched / prompt_tokens, results)


def replay(recording: Recording, page_size: int) -> float:
    """CPU seconds to make the recorded calls on a fresh tree."""
    tree = RadixTree(page_size)
    matches = []
    results: list = []
    gc.collect()
    start = time.process_time()
    for call in recording.calls:
        kind = call[0]
        if kind == MATCH:
            match = tree.match_prefix(call[1])
            _ = match.indices  # building the slot tensor is part of a match
            matches.append(match)
        elif kind == LOCK:
            tree.lock(matches[call[1]].last_node)
        elif kind == UNLOCK:
            tree.unlock(matches[call[1]].last_node)
        elif kind == INSERT:
            results.append(tree.insert(call[1], call[2]))
        else:
            results.append(tree.evict(call[1]))
    seconds = time.process_time() - start
    assert len(results) == len(recording.results)
    for got, expected in zip(results, recording.results):
        assert got == expected if isinstance(got, int) else torch.equal(got, expected)
    return seconds


def prepare(requests: list[Request], as_array: bool) -> tuple[list[tuple], int]:
    """Requests as (prompt, prompt + output, length) in the chosen input type."""
    convert = (lambda tokens: array("q", tokens)) if as_array else list
    trace = []
    for request in requests:
        full = request.prompt + request.output
        trace.append((convert(request.prompt), convert(full), len(full)))
    # Distinct tokens = nodes of an uncompressed trie over all full sequences.
    trie: dict = {}
    distinct_tokens = 0
    for _, full, _ in trace:
        node = trie
        for token in full:
            child = node.get(token)
            if child is None:
                child = node[token] = {}
                distinct_tokens += 1
            node = child
    return trace, distinct_tokens


def deep_match(as_array: bool, runs: int) -> dict[str, float]:
    """Median ms of match_prefix(100k tokens).indices, stored as 1 or 1563 nodes."""
    rng = random.Random(7)
    key = [rng.randrange(VOCAB) for _ in range(DEEP_MATCH_TOKENS)]
    query = array("q", key) if as_array else key
    results = {}
    for label, edge in (("1 node", DEEP_MATCH_TOKENS), ("1563 nodes", DEEP_MATCH_EDGE)):
        tree = RadixTree()
        slots = torch.arange(DEEP_MATCH_TOKENS, dtype=torch.int64)
        for end in range(edge, DEEP_MATCH_TOKENS + edge, edge):
            end = min(end, DEEP_MATCH_TOKENS)
            tree.insert(array("q", key[:end]), slots[:end])
        times = []
        for _ in range(runs):
            start = time.process_time()
            match = tree.match_prefix(query)
            _ = match.indices  # building the slot tensor is part of a match
            times.append((time.process_time() - start) * 1e3)
        assert match.length == DEEP_MATCH_TOKENS
        results[label] = statistics.median(times)
    return results


def run_all(as_array: bool, scale: float, runs: int, page_size: int) -> None:
    """Print the per-workload table and the deep-match figures for one input type."""
    print(f"\ntokens given as {'array(q)' if as_array else 'list'}; page_size {page_size}, "
          f"scale {scale}, median of {runs} replays")
    print(f"{'workload':16} {'requests':>8} {'ops':>7} {'us/op':>7} {'anchor':>7} "
          f"{'speed-up':>8} {'tokens/s':>11} {'hit rate':>8}")
    for seed, (name, generate) in enumerate(WORKLOADS.items()):
        requests = generate(random.Random(seed), scale)
        trace, distinct_tokens = prepare(requests, as_array)
        recording = record(trace, distinct_tokens, page_size)
        seconds = statistics.median(replay(recording, page_size) for _ in range(runs))
        ops = len(recording.calls)
        us_per_op = seconds / ops * 1e6
        tokens = sum(length for _, _, length in trace)
        print(f"{name:16} {len(trace):8d} {ops:7d} {us_per_op:7.2f} "
              f"{ANCHOR_US_PER_OP[name]:7.1f} {ANCHOR_US_PER_OP[name] / us_per_op:7.1f}x "
              f"{tokens / seconds:11.3e} {recording.hit_rate:8.1%}")
    for label, ms in deep_match(as_array, max(runs, 9)).items():
        anchor = ANCHOR_DEEP_MATCH_MS[label]
        print(f"match_prefix of a 100,000-token key stored as {label} (page_size 1): {ms:.3f} ms "
              f"(anchor {anchor} ms, {anchor / ms:.1f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="quarter-size traces, 3 replays")
    parser.add_argument("--runs", type=int, default=None, help="replays per workload (median)")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--input", choices=("array", "list", "both"), default="both",
                        help="token type given to the tree: array('q'), list, or each in turn")
    args = parser.parse_args()
    scale = 0.25 if args.quick else 1.0
    runs = args.runs or (3 if args.quick else 5)
    torch.set_num_threads(1)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}; "
          "time = CPU seconds inside tree calls / tree calls")
    for as_array in (True, False):
        if args.input in ("both", "array" if as_array else "list"):
            run_all(as_array, scale, runs, args.page_size)


if __name__ == "__main__":
    main()
