"""The step loop: schedule, run the model, sample, cache, report.

The engine is synchronous and single-threaded: `step()` does one model
forward for whatever the scheduler picked. `radixrt.Runtime` drives it from a
background thread and turns its per-request outputs into return values and
streams.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import torch

from radixrt.config import RuntimeConfig
from radixrt.engine.cache_manager import CacheManager
from radixrt.engine.detokenizer import OutputText
from radixrt.engine.request import Request, RequestOutput, RequestStatus
from radixrt.engine.scheduler import ScheduledBatch, Scheduler
from radixrt.model.forward_batch import ForwardBatch
from radixrt.model.runner import ModelRunner
from radixrt.sampling import Sampler

logger = logging.getLogger("radixrt.engine")


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        cache: CacheManager,
        config: RuntimeConfig,
        tokenizer: Any,
        eos_token_ids: Sequence[int],
        vocab_size: int,
        context_len: int,
        device: torch.device | str = "cpu",
    ):
        self.runner = runner
        self.cache = cache
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.device = torch.device(device)
        self.scheduler = Scheduler(cache, config)
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self._texts: dict[str, OutputText] = {}
        self.num_steps = 0
        self.num_computed_tokens = 0  # tokens the model actually ran, all requests together
        self.num_retracted = 0
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0

    # --- requests ------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request, or raise ValueError if it can never run."""
        self.validate(req)
        if req.rid in self.requests:
            raise ValueError(f"request id {req.rid!r} is already in use")
        self.requests[req.rid] = req
        self._texts[req.rid] = OutputText(self.tokenizer, req.params, req.prompt_ids)
        self.scheduler.add(req)

    def validate(self, req: Request) -> None:
        prompt = req.prompt_ids
        if not prompt:
            raise ValueError("prompt is empty: give at least one token")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            bad = next(t for t in prompt if not 0 <= t < self.vocab_size)
            raise ValueError(f"input_ids: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        total = len(prompt) + req.params.max_new_tokens
        if total > self.context_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({req.params.max_new_tokens}) = {total} "
                f"exceeds the model's context length {self.context_len}"
            )
        pool = self.cache.pool
        if pool.pages_for(total) > pool.num_pages:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({req.params.max_new_tokens}) = {total} "
                f"exceeds the KV pool ({pool.num_slots} tokens); raise max_total_tokens"
            )

    def abort(self, rid: str) -> bool:
        """Stop a request and free everything it holds; False if it is unknown or done."""
        req = self.requests.get(rid)
        if req is None or req.status is RequestStatus.FINISHED:
            return False
        self.scheduler.abort(req)
        req.finish_reason = {"type": "abort", "message": "aborted by the caller"}
        self._finish(req)
        return True

    def flush_cache(self) -> None:
        """Drop every cached prefix and reset the hit counters (only when idle)."""
        if self.has_work:
            raise RuntimeError("flush_cache needs an idle runtime: requests are still running")
        self.cache.flush()
        self.prompt_tokens = self.cached_prompt_tokens = 0

    def stats(self) -> dict[str, float | int]:
        """Prompt-token hit rate since start or the last flush, work done, and the cache's own stats."""
        stats: dict[str, float | int] = {
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "hit_rate": self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "computed_tokens": self.num_computed_tokens,
            "retracted_requests": self.num_retracted,
        }
        stats.update(self.cache.stats())
        return stats

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def run_until_idle(self) -> None:
        while self.has_work:
            self.step()

    # --- one step ----------------------------------------------------------------
    def step(self) -> None:
        batch = self.scheduler.schedule()
        self.num_retracted += len(batch.retracted)
        for req in batch.retracted:
            logger.debug("retracted %s (%d output tokens kept)", req.rid, len(req.output_ids))
        if not batch.items:
            return
        self.num_steps += 1
        self._log_step(batch)
        forward_batch = ForwardBatch.build(
            [r.fill_slice(r.num_computed, r.num_computed + n) for r, n in batch.items],
            [r.num_computed for r, _ in batch.items],
            [r.slots[: r.num_computed + n] for r, n in batch.items],
            device=self.device,
        )
        plan = _LogitPlan.build(batch.items, forward_batch)
        logits = self.runner.forward(forward_batch, plan.rows.to(self.device))
        self.num_computed_tokens += forward_batch.num_tokens
        for req in batch.admitted:
            if req.num_retractions == 0:
                self.prompt_tokens += len(req.prompt_ids)
                self.cached_prompt_tokens += req.cached_len
        self._record_prompt_logprobs(plan, logits)
        sampled = self._sample(plan, logits)
        for (req, num), token in zip(batch.items, sampled):
            self._advance(req, num, token)
        if self.config.check_invariants:
            self.check_invariants()

    def _sample(self, plan: "_LogitPlan", logits: torch.Tensor) -> list[int | None]:
        """Next token of every request that completed its pending tokens and may still generate."""
        rows, reqs = [], []
        for index, (req, row) in enumerate(zip(plan.reqs, plan.last_rows)):
            if row is not None and req.remaining_new_tokens > 0:
                rows.append(row)
                reqs.append((index, req))
        tokens: list[int | None] = [None] * len(plan.reqs)
        if not rows:
            return tokens
        out = self.sampler.sample(
            logits[torch.tensor(rows, device=logits.device)],
            [r.params for _, r in reqs],
            [r.seed for _, r in reqs],
            [r.prompt_ids for _, r in reqs],
            [r.output_ids for _, r in reqs],
        )
        token_ids = out.token_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else [None] * len(reqs)
        for (index, req), token, logprob in zip(reqs, token_ids, logprobs):
            tokens[index] = token
            if req.params.return_logprob:
                req.output_logprobs.append(logprob)
        return tokens

    def _advance(self, req: Request, num: int, token: int | None) -> None:
        just_admitted = req.num_computed == req.cached_len
        req.num_computed += num
        if req.num_pending > 0:  # a chunk of a long prompt
            self.cache.cache_computed(req)
            return
        text = self._texts[req.rid]
        delta_ids: list[int] = []
        if token is None:  # nothing left to generate (max_new_tokens reached, e.g. 0 for scoring)
            req.finish_reason = {"type": "length", "length": req.params.max_new_tokens}
        else:
            req.output_ids.append(token)
            delta_ids.append(token)
            if req.first_token_s is None:
                req.first_token_s = time.perf_counter()
            req.finish_reason = text.append(token, self.eos_token_ids, len(req.output_ids))
            if req.finish_reason is None and req.fill_len >= self.context_len:
                req.finish_reason = {"type": "length", "length": len(req.output_ids)}
        if req.finish_reason is not None:
            self.scheduler.finish(req)
            self._finish(req, delta_ids)
            return
        if num > 1 or just_admitted:
            self.cache.cache_computed(req)  # the prompt is computed: let others hit it now
        delta = text.take_delta()
        if req.on_output is not None and (delta or delta_ids):
            req.on_output(RequestOutput(req.rid, delta, delta_ids, finished=False))

    def _finish(self, req: Request, delta_ids: Sequence[int] = ()) -> None:
        req.finished_s = time.perf_counter()
        if req.first_token_s is None:
            req.first_token_s = req.finished_s
        text = self._texts.pop(req.rid)
        self.requests.pop(req.rid, None)
        if req.on_output is not None:
            result = self.result(req, text.final_text())
            req.on_output(RequestOutput(req.rid, text.take_delta(final=True), list(delta_ids), True, result))

    def result(self, req: Request, text: str) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": len(req.prompt_ids),
            "cached_tokens": req.cached_tokens or 0,
            "completion_tokens": len(req.output_ids),
            "finish_reason": req.finish_reason,
            "ttft": (req.first_token_s or req.finished_s) - req.created_s,
            "e2e_latency": req.finished_s - req.created_s,
        }
        if req.params.return_logprob:
            meta["output_token_logprobs"] = list(req.output_logprobs)
        if req.logprob_start_len is not None:
            meta["input_token_logprobs"] = list(req.prompt_logprobs)
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}

    def _record_prompt_logprobs(self, plan: "_LogitPlan", logits: torch.Tensor) -> None:
        if not plan.prompt_rows:
            return
        rows = torch.tensor([row for _, row, _ in plan.prompt_rows], device=logits.device)
        targets = torch.tensor([t for _, _, t in plan.prompt_rows], device=logits.device)
        logprobs = torch.log_softmax(logits[rows], dim=-1).gather(1, targets[:, None]).squeeze(1).tolist()
        for (req, _, _), logprob in zip(plan.prompt_rows, logprobs):
            req.prompt_logprobs.append(logprob)

    # --- introspection -------------------------------------------------------------
    def check_invariants(self) -> None:
        self.cache.check_invariants(self.scheduler.running)
        for req in self.scheduler.waiting:
            assert req.slots.numel() == 0 and req.last_node is None, f"{req.rid} waits holding KV"

    def _log_step(self, batch: ScheduledBatch) -> None:
        if not logger.isEnabledFor(logging.DEBUG):
            return
        pool = self.cache.pool
        logger.debug(
            "step %d: #new-seq %d, #new-token %d, #cached-token %d, token usage %.2f, #running-req %d, #queue-req %d",
            self.num_steps, len(batch.admitted), batch.num_new_tokens, sum(r.cached_len for r in batch.admitted),
            1 - pool.available / pool.num_slots, len(self.scheduler.running), len(self.scheduler.waiting),
        )


class _LogitPlan:
    """Which rows of the step's new tokens need logits, and what each is for."""

    def __init__(self) -> None:
        self.reqs: list[Request] = []
        self.last_rows: list[int | None] = []  # index into the gathered logits, per item
        self.prompt_rows: list[tuple[Request, int, int]] = []  # (request, logits index, target token)
        self._rows: list[int] = []

    @property
    def rows(self) -> torch.Tensor:
        return torch.tensor(self._rows, dtype=torch.int64)

    @classmethod
    def build(cls, items: Sequence[tuple[Request, int]], batch: ForwardBatch) -> "_LogitPlan":
        plan = cls()
        offsets = batch.qo_indptr.tolist()
        for (req, num), offset in zip(items, offsets):
            plan.reqs.append(req)
            start = req.logprob_start_len
            if start is not None:
                prompt = req.prompt_ids
                first = max(req.num_computed, start - 1)
                last = min(req.num_computed + num, len(prompt) - 1)  # position p scores token p + 1
                for position in range(first, last):
                    plan.prompt_rows.append((req, len(plan._rows), prompt[position + 1]))
                    plan._rows.append(offset + position - req.num_computed)
            if req.num_computed + num == req.fill_len:
                plan.last_rows.append(len(plan._rows))
                plan._rows.append(offset + num - 1)
            else:
                plan.last_rows.append(None)
        return plan
