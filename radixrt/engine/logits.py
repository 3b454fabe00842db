"""Which logits a step needs, and what is done with them: next tokens and prompt log-probabilities.

The model computes hidden states for every new token of a step, but only a
few rows need the LM head: the last new token of each request that finished
its pending tokens (its next token is sampled there) and, for a request that
scores its prompt (`logprob_start_len`), every prompt position from there on
(position p scores prompt token p + 1).

    new tokens:  [ r0 r0 r0 r0 | r1 | r2 r2 r2 | r3 d1 d2 ]   r0: a prompt chunk, scored from position 1
    logit rows:    ^  ^  ^  ^    ^          ^    ^  ^  ^      r1: a decode; r2: the end of a prompt
                   prompt rows   last rows       last + draft rows

r3 is a decode with a jump-forward draft (d1 d2: tokens its grammar forces):
the sampler picks a token at each of its rows as single steps would (the same
mask, penalties over the same history, the same draw), and the request keeps
the draft's longest prefix it confirms plus the token picked after it.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch

from radixrt.engine.request import Request
from radixrt.sampling.grammar import disallow, new_bitmask
from radixrt.sampling.sampler import Sampler, TokenMasks, top_tokens


class NextToken(NamedTuple):
    token_id: int
    logprob: float  # under the penalised distribution at temperature 1 (see SampleOutput)
    top_logprobs: list[tuple[int, float]] | None = None  # (token, logprob), most likely first
    ids_logprobs: list[float] | None = None  # of params.token_ids_logprob, in their order


def needs_mask(req: Request, num_output: int) -> bool:
    """Whether the request's token number `num_output` is drawn under a mask: its grammar's, or
    EOS and stop tokens taken out while it is short of `min_new_tokens`."""
    return req.grammar is not None or num_output < req.params.min_new_tokens


def fill_row_mask(req: Request, allowed: torch.Tensor, row: int, num_output: int) -> None:
    """Write into `allowed[row]` the tokens the request may draw as its token number `num_output`
    (its grammar at its current state; every token without one), less EOS and its stop tokens
    while it is short of `min_new_tokens`: unless that leaves nothing (a complete grammar that
    allows only EOS), where the grammar wins."""
    if req.grammar is not None:
        req.grammar.fill_mask(allowed, row)
    else:
        allowed[row] = -1
    if num_output >= req.params.min_new_tokens:
        return
    before = allowed[row].clone() if req.grammar is not None else None
    disallow(allowed[row], (*req.params.stop_token_ids, *req.eos_token_ids))
    if before is not None and not bool(allowed[row].any()):
        allowed[row] = before


@dataclass
class LogitPlan:
    """The logit rows of one step, per request in the step's order."""

    requests: list[Request] = field(default_factory=list)
    last_rows: list[int | None] = field(default_factory=list)  # index into the logits, per request
    drafts: list[list[int]] = field(default_factory=list)  # per request, its draft (rows last_row + 1 ...)
    prompt_rows: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, logits index, target)
    rows: list[int] = field(default_factory=list)  # rows of the step's new tokens, in logits order

    @classmethod
    def build(cls, items: Sequence[tuple[Request, int]], token_starts: Sequence[int]) -> LogitPlan:
        """`items`: (request, tokens computed this step); `token_starts[i]`: item i's first new-token row."""
        plan = cls()
        for (req, num), offset in zip(items, token_starts):
            plan.requests.append(req)
            start = req.scored_from
            if start is not None:
                prompt = req.prompt_ids
                first = max(req.num_computed, start - 1)
                last = min(req.num_computed + num, len(prompt) - 1)
                for position in range(first, last):
                    plan.prompt_rows.append((req, len(plan.rows), prompt[position + 1]))
                    plan.rows.append(offset + position - req.num_computed)
            drafted = max(req.num_computed + num - req.fill_len, 0)  # draft tokens computed this step
            if req.num_computed + num == req.fill_len + drafted:
                plan.last_rows.append(len(plan.rows))
                plan.rows.extend(range(offset + num - 1 - drafted, offset + num))
                plan.drafts.append(req.draft_ids[:drafted])
            else:
                plan.last_rows.append(None)
                plan.drafts.append([])
        return plan

    def record_prompt_logprobs(self, logits: torch.Tensor) -> None:
        """Append each scored prompt token's log-probability to its request, with its position's
        top-k and asked-for token ids where the request wants them: all from one log-softmax, so a
        prompt token that is its position's argmax has exactly its top-1 log-probability."""
        if not self.prompt_rows:
            return
        rows = torch.tensor([row for _, row, _ in self.prompt_rows], device=logits.device)
        targets = torch.tensor([t for _, _, t in self.prompt_rows], device=logits.device)
        table = torch.log_softmax(logits[rows].float(), dim=-1)
        logprobs = table.gather(1, targets[:, None]).squeeze(1).tolist()
        k = max(req.params.top_logprobs_num for req, _, _ in self.prompt_rows)
        top_values, top_ids = top_tokens(table, k) if k else (None, None)
        for index, ((req, _, _), logprob) in enumerate(zip(self.prompt_rows, logprobs)):
            req.prompt_logprobs.append(logprob)
            wanted = req.params.top_logprobs_num
            if wanted and top_values is not None and top_ids is not None:
                req.prompt_top_logprobs.append(
                    list(zip(top_ids[index, :wanted].tolist(), top_values[index, :wanted].tolist()))
                )
            if req.params.token_ids_logprob is not None:
                ids = torch.tensor(req.params.token_ids_logprob, dtype=torch.int64, device=table.device)
                req.prompt_ids_logprobs.append(table[index, ids].tolist())

    def sample(self, logits: torch.Tensor, sampler: Sampler, vocab_size: int) -> list[list[NextToken]]:
        """The new tokens of every request that completed its pending tokens and may still generate:
        one, or with a draft its confirmed draft tokens and the token picked after them (empty: not
        sampled). `vocab_size` is the width of the output constraints' masks."""
        rows: list[int] = []
        owners: list[int] = []  # the request of each sampled row
        histories: list[Sequence[int]] = []  # each row's output so far, its draft's tokens before it included
        masked: list[int] = []
        num_masked = sum(len(draft) + 1 for req, row, draft in zip(self.requests, self.last_rows, self.drafts)
                         if row is not None and needs_mask(req, len(req.output_ids)))  # fmt: skip
        allowed = new_bitmask(num_masked, vocab_size) if num_masked else None
        for index, (req, row, draft) in enumerate(zip(self.requests, self.last_rows, self.drafts)):
            if row is None or req.remaining_new_tokens <= 0:
                continue
            grammar = req.grammar
            masks_rows = needs_mask(req, len(req.output_ids))  # drafts come with grammars only
            for j in range(len(draft) + 1):
                if masks_rows and allowed is not None:
                    fill_row_mask(req, allowed, len(masked), len(req.output_ids) + j)
                    masked.append(len(rows))
                    if grammar is not None and j < len(draft) and not grammar.accept(draft[j]):
                        raise RuntimeError(f"{req.rid}: its draft left its grammar at token {j}")
                rows.append(row + j)
                owners.append(index)
                histories.append(req.output_ids if j == 0 else req.output_ids + array("q", draft[:j]))
            if grammar is not None:
                grammar.rollback(len(draft))
        tokens: list[list[NextToken]] = [[] for _ in self.requests]
        if not rows:
            return tokens
        reqs = [self.requests[i] for i in owners]
        every_row = rows == list(range(logits.shape[0]))  # the usual decode step: no copy
        out = sampler.sample(
            logits if every_row else logits[torch.tensor(rows, device=logits.device)],
            [r.params for r in reqs],
            [r.seed for r in reqs],
            [r.prompt_ids for r in reqs],
            histories,
            None if allowed is None else TokenMasks(masked, allowed[: len(masked)]),
        )
        top: Sequence[list[tuple[int, float]] | None] = out.top_logprobs or [None] * len(reqs)
        asked: Sequence[list[float] | None] = out.ids_logprobs or [None] * len(reqs)
        for index, token_id, logprob, alternatives, ids_logprobs in zip(
            owners, out.token_ids.tolist(), out.logprobs.tolist(), top, asked
        ):
            picked, draft = tokens[index], self.drafts[index]
            if picked and picked[-1].token_id != draft[len(picked) - 1]:
                continue  # an earlier position of this request did not confirm its draft token
            picked.append(NextToken(token_id, logprob, alternatives, ids_logprobs))
        return tokens
