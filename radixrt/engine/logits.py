"""Which logits a step needs, and what is done with them: next tokens and prompt log-probabilities.

The model computes hidden states for every new token of a step, but only a
few rows need the LM head: the last new token of each request that finished
its pending tokens (its next token is sampled there) and, for a request that
scores its prompt (`logprob_start_len`), every prompt position from there on
(position p scores prompt token p + 1).

    new tokens:  [ r0 r0 r0 r0 | r1 | r2 r2 r2 ]      r0: a prompt chunk, scored from position 1
    logit rows:    ^  ^  ^  ^    ^          ^          r1: a decode; r2: the end of a prompt
                   prompt rows   last rows
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch

from radixrt.engine.request import Request
from radixrt.sampling.sampler import Sampler


class NextToken(NamedTuple):
    token_id: int
    logprob: float  # under the penalised distribution at temperature 1 (see SampleOutput)
    top_logprobs: list[tuple[int, float]] | None = None  # (token, logprob), most likely first


@dataclass
class LogitPlan:
    """The logit rows of one step, per request in the step's order."""

    requests: list[Request] = field(default_factory=list)
    last_rows: list[int | None] = field(default_factory=list)  # index into the logits, per request
    prompt_rows: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, logits index, target)
    rows: list[int] = field(default_factory=list)  # rows of the step's new tokens, in logits order

    @classmethod
    def build(cls, items: Sequence[tuple[Request, int]], token_starts: Sequence[int]) -> LogitPlan:
        """`items`: (request, tokens computed this step); `token_starts[i]`: item i's first new-token row."""
        plan = cls()
        for (req, num), offset in zip(items, token_starts):
            plan.requests.append(req)
            start = req.logprob_start_len
            if start is not None:
                prompt = req.prompt_ids
                first = max(req.num_computed, start - 1)
                last = min(req.num_computed + num, len(prompt) - 1)
                for position in range(first, last):
                    plan.prompt_rows.append((req, len(plan.rows), prompt[position + 1]))
                    plan.rows.append(offset + position - req.num_computed)
            if req.num_computed + num == req.fill_len:
                plan.last_rows.append(len(plan.rows))
                plan.rows.append(offset + num - 1)
            else:
                plan.last_rows.append(None)
        return plan

    def record_prompt_logprobs(self, logits: torch.Tensor) -> None:
        """Append each scored prompt token's log-probability to its request."""
        if not self.prompt_rows:
            return
        rows = torch.tensor([row for _, row, _ in self.prompt_rows], device=logits.device)
        targets = torch.tensor([t for _, _, t in self.prompt_rows], device=logits.device)
        logprobs = torch.log_softmax(logits[rows], dim=-1).gather(1, targets[:, None]).squeeze(1).tolist()
        for (req, _, _), logprob in zip(self.prompt_rows, logprobs):
            req.prompt_logprobs.append(logprob)

    def sample(self, logits: torch.Tensor, sampler: Sampler) -> list[NextToken | None]:
        """The next token of every request that completed its pending tokens and may still generate."""
        rows, chosen = [], []
        for index, (req, row) in enumerate(zip(self.requests, self.last_rows)):
            if row is not None and req.remaining_new_tokens > 0:
                rows.append(row)
                chosen.append(index)
        tokens: list[NextToken | None] = [None] * len(self.requests)
        if not rows:
            return tokens
        reqs = [self.requests[i] for i in chosen]
        every_row = rows == list(range(logits.shape[0]))  # the usual decode step: no copy
        out = sampler.sample(
            logits if every_row else logits[torch.tensor(rows, device=logits.device)],
            [r.params for r in reqs],
            [r.seed for r in reqs],
            [r.prompt_ids for r in reqs],
            [r.output_ids for r in reqs],
        )
        top: Sequence[list[tuple[int, float]] | None] = out.top_logprobs or [None] * len(reqs)
        for index, token_id, logprob, alternatives in zip(chosen, out.token_ids.tolist(), out.logprobs.tolist(), top):
            tokens[index] = NextToken(token_id, logprob, alternatives)
        return tokens
