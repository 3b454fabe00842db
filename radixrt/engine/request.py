"""A request as the engine sees it: tokens, KV slots it holds, and its progress.

A request's KV slots, in token order:

    slots:  [ 0 .......... cached_len | cached_len ..... num_computed | ... len(slots) ]
              tree-owned, locked via     private: computed here,        private: allocated,
              last_node (borrowed)       not yet in the tree            not yet written

`fill_ids = prompt_ids + output_ids` are the tokens whose KV the request needs.
Both are int64 `array`s: the radix tree reads an array's buffer in place,
where a list would be converted token by token on every match and insert.
A step computes `fill_ids[num_computed : num_computed + k]`; when it reaches
the end of fill_ids the last logits give the next token. A decode is the case
k = 1, a chunk of a long prompt is a k that stops short of the end, and a
retracted request simply starts over from whatever the tree still holds.
"""

from __future__ import annotations

import enum
import itertools
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch

from radixrt.sampling import SamplingParams

_request_counter = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What a request reports after a step: the new text and, at the end, the result."""

    rid: str
    text_delta: str
    token_ids_delta: list[int]
    finished: bool
    result: dict[str, Any] | None = None


@dataclass(eq=False)
class Request:
    prompt_ids: array  # int64; a list given here is converted
    params: SamplingParams
    rid: str = ""
    namespace: Hashable = None
    # Positions from which the prompt's own token log-probabilities are wanted
    # (scoring); None when not wanted.
    logprob_start_len: int | None = None
    on_output: Callable[[RequestOutput], None] | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_ids: array = field(default_factory=lambda: array("q"))
    output_logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    seed: int = 0
    arrival_index: int = field(default_factory=lambda: next(_request_counter))

    # KV state (see the module docstring).
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    cached_len: int = 0
    num_computed: int = 0
    last_node: Any = None
    cached_tokens: int | None = None  # prefix hit at first admission, reported to the user
    num_retractions: int = 0

    created_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finished_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_ids, array) or self.prompt_ids.typecode != "q":
            try:
                self.prompt_ids = array("q", self.prompt_ids)
            except (TypeError, OverflowError):
                raise ValueError("input_ids: token ids must be ints in [0, 2**63)") from None
        if not self.rid:
            self.rid = f"req-{self.arrival_index}"

    @property
    def fill_ids(self) -> array:
        return self.prompt_ids + self.output_ids

    def fill_slice(self, start: int, end: int) -> array:
        """fill_ids[start:end] without building fill_ids (the per-step path)."""
        num_prompt = len(self.prompt_ids)
        if end <= num_prompt:
            return self.prompt_ids[start:end]
        if start >= num_prompt:
            return self.output_ids[start - num_prompt : end - num_prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - num_prompt]

    @property
    def fill_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens whose KV must be computed before the next token can be sampled."""
        return self.fill_len - self.num_computed

    @property
    def private_slots(self) -> int:
        return self.slots.numel() - self.cached_len

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.params.max_new_tokens - len(self.output_ids), 0)

    def max_prefix_match(self) -> int:
        """How much of fill_ids may come from the cache.

        At least one token is always recomputed, since the next token needs
        the last token's logits; and a prompt being scored must recompute from
        the position whose logits score its first scored token.
        """
        limit = self.fill_len - 1
        if self.logprob_start_len is not None:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return limit
