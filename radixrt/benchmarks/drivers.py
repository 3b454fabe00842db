"""How each workload kind issues its requests to a system, timed from the first request to the last result.

The drivers express a workload's flow once, over the `System` interface, so
every system runs the same requests in the same order. Where a workload is
concurrent (chat), a system that batches concurrent callers (radixrt) gets
one thread per conversation, each sending its next turn as soon as its last
answer is back; the transformers baseline gets one padded batch per turn.
On radixrt, fork and tree workloads run as radixrt.lang programs
(`programs.py`); elsewhere as batched `generate` calls, level by level.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable

from radixrt.benchmarks import programs
from radixrt.benchmarks.system_api import Completion, System
from radixrt.benchmarks.workloads import Workload, chat_prompt


@dataclass(frozen=True)
class Run:
    """One repetition of a workload on a system: wall time, every completion (in request order),
    and the prompt tokens the system processed and found cached (its own counts, else the completions')."""

    wall_s: float
    completions: list[Completion]
    prompt_tokens: int
    cached_tokens: int


def run_workload(workload: Workload, system: System, tokenizer: Any) -> Run:
    program = system.runtime is not None
    drivers: dict[str, Callable[[], list[Completion]]] = {
        "sequential": lambda: _sequential(workload, system),
        "batch": lambda: _flatten(system.generate(workload.prompts, workload.sampling)),
        "fork": lambda: (programs.self_consistency(system.runtime, workload) if program else
                         _flatten(system.generate(workload.prompts, workload.sampling, n=workload.num_samples))),
        "chat": lambda: _chat(workload, system, tokenizer),
        "tree": lambda: (programs.tree_of_thought(system.runtime, workload) if program else
                         _tree(workload, system, tokenizer)),
    }
    counts_before = system.cache_counts()
    started = time.perf_counter()
    completions = drivers[workload.kind]()
    wall_s = time.perf_counter() - started
    counts_after = system.cache_counts()
    if counts_before is None or counts_after is None:
        prompt_tokens = sum(c.prompt_tokens for c in completions)
        cached_tokens = sum(c.cached_tokens for c in completions)
    else:
        prompt_tokens, cached_tokens = (after - before for after, before in zip(counts_after, counts_before))
    return Run(wall_s, completions, prompt_tokens, cached_tokens)


def prime(workload: Workload, system: System) -> None:
    """Put a warm workload's shared prefix in the system's cache (untimed; skipped without a cache)."""
    prefix = workload.shared_prefix
    runtime = system.runtime
    if workload.warm_prefix and prefix and runtime is not None and not runtime.config.disable_radix_cache:
        system.generate([prefix], replace(workload.sampling, max_new_tokens=1))


def _flatten(groups: list[list[Completion]]) -> list[Completion]:
    return [c for group in groups for c in group]


def _sequential(workload: Workload, system: System) -> list[Completion]:
    return [system.generate([prompt], workload.sampling)[0][0] for prompt in workload.prompts]


def _tree(workload: Workload, system: System, tokenizer: Any) -> list[Completion]:
    """Level by level: every node of a level branches into `branching` sampled children at once."""
    frontier = [tuple(workload.prompts[0])]
    completions: list[Completion] = []
    for level in range(workload.depth):
        sampling = replace(workload.sampling, seed=workload.sampling.seed + 1000 * level)
        groups = system.generate(frontier, sampling, n=workload.branching)
        marker = tuple(tokenizer.encode(workload.step_markers[level], add_special_tokens=False))
        frontier = [parent + c.output_ids + marker for parent, group in zip(frontier, groups) for c in group]
        completions += _flatten(groups)
    return completions


def _chat(workload: Workload, system: System, tokenizer: Any) -> list[Completion]:
    conversations = workload.conversations
    results: list[list[Completion]] = [[] for _ in conversations]
    answers: list[list[tuple[str, str | None]]] = [[] for _ in conversations]

    def prompt_for(index: int, turn: int) -> tuple[int, ...]:
        answers[index].append((conversations[index][turn], None))
        return chat_prompt(tokenizer, workload.system_prompt, answers[index])

    def record(index: int, completion: Completion) -> None:
        results[index].append(completion)
        user, _ = answers[index][-1]
        answers[index][-1] = (user, answer_text(tokenizer, completion.output_ids))

    if system.concurrent:
        def conversation(index: int) -> None:
            for turn in range(len(conversations[index])):
                record(index, system.generate([prompt_for(index, turn)], workload.sampling)[0][0])

        with ThreadPoolExecutor(max_workers=len(conversations)) as pool:
            for future in [pool.submit(conversation, i) for i in range(len(conversations))]:
                future.result()  # re-raises a conversation's error here
    else:
        for turn in range(len(conversations[0])):
            batch = [prompt_for(i, turn) for i in range(len(conversations))]
            for index, group in enumerate(system.generate(batch, workload.sampling)):
                record(index, group[0])
    return _flatten(results)


def answer_text(tokenizer: Any, output_ids: tuple[int, ...]) -> str:
    """The answer as the next turn's history holds it: up to the first special token (EOS), as text."""
    special = set(tokenizer.all_special_ids)
    end = next((i for i, t in enumerate(output_ids) if t in special), len(output_ids))
    return tokenizer.decode(list(output_ids[:end]), skip_special_tokens=True).strip()
