"""The fork and tree workloads as radixrt.lang programs, the way a radixrt user writes them.

A program appends text and `gen`s to a state and branches with `fork`; the
state keeps token ids, tokenizing each text piece alone, so these programs
send exactly the token ids that `drivers` builds for the other systems:
prompt, then a branch's generated ids, then the next step marker's ids.

fork computes the shared prefix once before branching (a prompt-only
request); the engine counts those requests' prompt tokens too, which is why
hit rates come from the runtime's own counters (`System.cache_counts`).
"""

from __future__ import annotations

from typing import Any

from radixrt.benchmarks.system_api import Completion, completion_of_meta
from radixrt.benchmarks.workloads import Workload
from radixrt.lang import ProgramState, function, gen


@function
def _self_consistency(s: ProgramState, question: str, k: int, max_tokens: int, temperature: float,
                      seed: int) -> None:
    s += question
    paths = s.fork(k)
    for i, path in enumerate(paths):
        path += gen("path", max_tokens=max_tokens, temperature=temperature, seed=seed + i, ignore_eos=True)
    s.join(paths)


@function
def _tree_of_thought(s: ProgramState, root: str, markers: tuple[str, ...], branching: int, max_tokens: int,
                     temperature: float, seed: int, levels: list[list[ProgramState]]) -> None:
    """Each node forks `branching` children that each generate a step; a node's fork waits only for
    that node, so a subtree starts as soon as its parent is done, while its cousins still run."""
    s += root
    frontier = [s]
    for level, marker in enumerate(markers):
        children: list[ProgramState] = []
        for node in frontier:
            branches = node.fork(branching)
            for i, branch in enumerate(branches):
                branch += gen("step", max_tokens=max_tokens, temperature=temperature,
                              seed=seed + 1000 * level + branching * len(children) + i, ignore_eos=True)
                branch += marker
            children += branches
        levels.append(children)
        frontier = children


def self_consistency(runtime: Any, workload: Workload) -> list[Completion]:
    sampling = workload.sampling
    state = _self_consistency.run(question=workload.prompt_text, k=workload.num_samples,
                                  max_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                  seed=sampling.seed, runtime=runtime)
    return [completion_of_meta(meta) for meta in state.get_meta_info("path")]


def tree_of_thought(runtime: Any, workload: Workload) -> list[Completion]:
    sampling = workload.sampling
    levels: list[list[ProgramState]] = []
    _tree_of_thought.run(root=workload.prompt_text, markers=workload.step_markers, branching=workload.branching,
                         max_tokens=sampling.max_new_tokens, temperature=sampling.temperature, seed=sampling.seed,
                         levels=levels, runtime=runtime)
    return [completion_of_meta(node.get_meta_info("step")) for level in levels for node in level]
