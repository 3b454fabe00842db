"""The suite's workloads: what each sends, built deterministically and tokenized exactly.

Every prompt is a list of token ids from the model's own tokenizer, so every
system runs exactly the same tokens and the report can state exact counts.
Texts are encoded whole (as a user's client would), so "shared prefix tokens"
is measured (the longest common token prefix), not assumed.

All requests generate exactly `max_new_tokens` (EOS does not stop them), so
every system does the same amount of work and throughputs compare directly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from radixrt.benchmarks import prompts
from radixrt.demo import table_prompt, table_rows

WORKLOAD_NAMES = ("table", "few-shot-64", "few-shot-32", "self-consistency", "chat", "tree-of-thought")
_TABLE_FIELDS = ("age", "occupation", "country", "phone number", "email")


@dataclass(frozen=True)
class Sampling:
    """Generation settings of a workload's requests; temperature 0 is greedy."""

    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0


@dataclass(frozen=True)
class Scale:
    """Sizes of every workload; FULL is the issue's specification, QUICK a smoke run on a tiny model."""

    table_rows: int
    table_questions: int
    table_new_tokens: int
    few_shot_prefix_tokens: int
    few_shot_questions: tuple[int, int]  # the throughput workload, the issue-4 variant
    few_shot_new_tokens: tuple[int, int]
    question_tokens: int
    num_samples: int
    sample_new_tokens: int
    chat_conversations: int
    chat_system_tokens: int
    chat_turns: int
    chat_new_tokens: int
    tree_root_tokens: int
    tree_branching: int
    tree_depth: int
    tree_new_tokens: int


FULL = Scale(
    table_rows=30, table_questions=32, table_new_tokens=10,
    few_shot_prefix_tokens=1000, few_shot_questions=(64, 32), few_shot_new_tokens=(16, 16),
    question_tokens=300, num_samples=8, sample_new_tokens=64,
    chat_conversations=16, chat_system_tokens=300, chat_turns=4, chat_new_tokens=32,
    tree_root_tokens=200, tree_branching=3, tree_depth=3, tree_new_tokens=64,
)
QUICK = Scale(
    table_rows=3, table_questions=4, table_new_tokens=4,
    few_shot_prefix_tokens=96, few_shot_questions=(6, 4), few_shot_new_tokens=(4, 4),
    question_tokens=64, num_samples=3, sample_new_tokens=4,
    chat_conversations=3, chat_system_tokens=48, chat_turns=2, chat_new_tokens=4,
    tree_root_tokens=48, tree_branching=2, tree_depth=2, tree_new_tokens=4,
)


@dataclass(frozen=True)
class Workload:
    """One workload. `kind` picks its driver (see drivers.py); the other fields are its inputs.

    kind        sends
    sequential  `prompts` one at a time, each after the previous finished (latency-bound)
    batch       all `prompts` at once (throughput-bound)
    fork        `prompts[0]` once with `num_samples` sampled continuations
    chat        `conversations` concurrently; turn t renders system + turns so far with the chat template
    tree        `prompts[0]` branching `branching` ways to `depth`; a child's prompt is its
                parent's prompt + the parent's generated tokens + the tokens of `step_markers[level]`
    prompt_text: fork and tree: the text whose tokens are `prompts[0]`, for systems that run
                them as radixrt.lang programs (a program tokenizes each text piece alone, as
                `build_workloads` does, so both ways give the same token ids)
    warm_prefix: before each repetition the cache holds the shared prefix (else it starts empty).
    """

    name: str
    kind: str
    description: str
    sampling: Sampling
    prompts: tuple[tuple[int, ...], ...] = ()
    num_samples: int = 1
    system_prompt: str = ""
    conversations: tuple[tuple[str, ...], ...] = ()
    branching: int = 0
    depth: int = 0
    step_markers: tuple[str, ...] = ()
    prompt_text: str = ""
    warm_prefix: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        if self.kind == "fork":
            return self.num_samples
        if self.kind == "chat":
            return sum(len(turns) for turns in self.conversations)
        if self.kind == "tree":
            return sum(self.branching ** level for level in range(1, self.depth + 1))
        return len(self.prompts)

    @property
    def shared_prefix(self) -> tuple[int, ...]:
        """The longest token prefix common to all prompts (all of the one prompt when alone)."""
        return self.prompts[0][: common_prefix_len(self.prompts)] if self.prompts else ()


def common_prefix_len(sequences: Sequence[Sequence[int]]) -> int:
    first = sequences[0]
    length = len(first)
    for other in sequences[1:]:
        length = min(length, len(other))
        length = next((i for i in range(length) if first[i] != other[i]), length)
    return length


def build_workloads(tokenizer: Any, scale: Scale, seed: int, names: tuple[str, ...] = WORKLOAD_NAMES) -> list[Workload]:
    """The named workloads, in the given order, for this tokenizer at this scale."""
    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    def count(text: str) -> int:
        return len(encode(text))

    builders: dict[str, Callable[[], Workload]] = {
        "table": lambda: _table(encode, scale),
        "few-shot-64": lambda: _few_shot(encode, count, scale, seed, 0),
        "few-shot-32": lambda: _few_shot(encode, count, scale, seed, 1),
        "self-consistency": lambda: _self_consistency(encode, count, scale, seed),
        "chat": lambda: _chat(tokenizer, count, scale, seed),
        "tree-of-thought": lambda: _tree(encode, count, scale, seed),
    }
    unknown = [n for n in names if n not in builders]
    if unknown:
        raise ValueError(f"unknown workload(s) {unknown}; choose from {list(WORKLOAD_NAMES)}")
    return [_with_token_info(builders[name]()) for name in names]


def _with_token_info(workload: Workload) -> Workload:
    if workload.prompts:
        lengths = [len(p) for p in workload.prompts]
        workload.info.update(
            num_prompts=len(lengths), prompt_tokens_min=min(lengths), prompt_tokens_max=max(lengths),
            prompt_tokens_total=sum(lengths), shared_prefix_tokens=len(workload.shared_prefix),
        )
    workload.info.update(kind=workload.kind, requests=workload.num_requests, description=workload.description,
                         max_new_tokens=workload.sampling.max_new_tokens, temperature=workload.sampling.temperature,
                         warm_prefix=workload.warm_prefix)
    return workload


def _table(encode: Callable[[str], tuple[int, ...]], scale: Scale) -> Workload:
    rows = [row["Name"] for row in table_rows()][: scale.table_rows]
    first, second = rows[0], "Zack Blue" if "Zack Blue" in rows else rows[-1]
    others = [n for n in rows if n not in (first, second)] + [first, second]
    questions = [(first, "age"), (second, "age")]
    questions += [(name, _TABLE_FIELDS[i % len(_TABLE_FIELDS)]) for i, name in enumerate(others)]
    questions = questions[: scale.table_questions]
    texts = [_table_question(name, column, scale.table_rows) for name, column in questions]
    return Workload(
        name="table", kind="sequential", sampling=Sampling(scale.table_new_tokens),
        description=(f"radixrt.demo's {scale.table_rows}-row table and {len(texts)} questions about its rows "
                     "(John Doe's and Zack Blue's ages first), one at a time; greedy"),
        prompts=tuple(encode(t) for t in texts),
    )


def _table_question(name: str, column: str, num_rows: int) -> str:
    """radixrt.demo.table_prompt with the column asked about, over the table's first num_rows rows."""
    text = table_prompt(name)
    head, _ = text.split("Question: ", 1)
    if num_rows < len(table_rows()):
        lines = head.split("\n")
        start = next(i for i, line in enumerate(lines) if line.startswith("|"))
        head = "\n".join(lines[: start + 2 + num_rows] + lines[start + 2 + len(table_rows()):])
    return f"{head}Question: what is the {column} of {name}? Your answer: The {column} of {name} is "


def _few_shot(encode: Callable[[str], tuple[int, ...]], count: Callable[[str], int], scale: Scale, seed: int,
              variant: int) -> Workload:
    rng = random.Random(seed * 1000 + 2)
    prefix = prompts.few_shot_prefix(rng, count, scale.few_shot_prefix_tokens)
    num_questions, new_tokens = scale.few_shot_questions[variant], scale.few_shot_new_tokens[variant]
    questions = [prompts.few_shot_question(rng) for _ in range(num_questions)]
    warm = variant == 1
    return Workload(
        name=("few-shot-64", "few-shot-32")[variant],
        kind="batch", sampling=Sampling(new_tokens),
        description=(f"a 5-shot prefix, then {num_questions} different questions submitted together; greedy"
                     + ("; the prefix is cached before each repetition (warm)" if warm else "")),
        prompts=tuple(encode(prefix + q) for q in questions), warm_prefix=warm,
    )


def _self_consistency(encode: Callable[[str], tuple[int, ...]], count: Callable[[str], int], scale: Scale,
                      seed: int) -> Workload:
    question = prompts.reasoning_question(random.Random(seed * 1000 + 3), count, scale.question_tokens)
    return Workload(
        name="self-consistency", kind="fork", sampling=Sampling(scale.sample_new_tokens, 0.7, seed),
        description=f"one long question, {scale.num_samples} sampled reasoning paths (fork), temperature 0.7",
        prompts=(encode(question),), num_samples=scale.num_samples, prompt_text=question,
    )


def _chat(tokenizer: Any, count: Callable[[str], int], scale: Scale, seed: int) -> Workload:
    rng = random.Random(seed * 1000 + 4)
    system = prompts.system_prompt(rng, count, scale.chat_system_tokens)
    conversations = tuple(
        tuple(prompts.user_message(rng, turn) for turn in range(scale.chat_turns))
        for _ in range(scale.chat_conversations)
    )
    first_turns = [chat_prompt(tokenizer, system, [(c[0], None)]) for c in conversations]
    return Workload(
        name="chat", kind="chat", sampling=Sampling(scale.chat_new_tokens),
        description=(f"{scale.chat_conversations} concurrent conversations sharing a system prompt, "
                     f"{scale.chat_turns} turns each; every turn appends the previous answer and a new "
                     "user message (chat template); greedy"),
        system_prompt=system, conversations=conversations,
        info={"system_prompt_tokens": count(system), "first_turn_prompt_tokens": len(first_turns[0]),
              "shared_prefix_tokens": common_prefix_len(first_turns)},
    )


def chat_prompt(tokenizer: Any, system: str, turns: list[tuple[str, str | None]]) -> tuple[int, ...]:
    """Token ids of system + (user, answer) turns, the last answer open, via the tokenizer's chat template."""
    messages = [{"role": "system", "content": system}]
    for user, answer in turns:
        messages.append({"role": "user", "content": user})
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def _tree(encode: Callable[[str], tuple[int, ...]], count: Callable[[str], int], scale: Scale, seed: int) -> Workload:
    root = prompts.tree_root(random.Random(seed * 1000 + 5), count, scale.tree_root_tokens)
    markers = tuple(f"\nStep {level + 2}:" for level in range(scale.tree_depth))
    num_nodes = sum(scale.tree_branching ** d for d in range(1, scale.tree_depth + 1))
    return Workload(
        name="tree-of-thought", kind="tree", sampling=Sampling(scale.tree_new_tokens, 0.7, seed),
        description=(f"a program branching {scale.tree_branching} ways to depth {scale.tree_depth} "
                     f"({num_nodes} generations of {scale.tree_new_tokens} tokens), each branch extending "
                     "its parent's history; temperature 0.7"),
        prompts=(encode(root),), branching=scale.tree_branching, depth=scale.tree_depth, step_markers=markers,
        prompt_text=root,
    )

