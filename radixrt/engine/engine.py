"""The step loop: schedule, run the model, sample, post-process, report.

    Scheduler.schedule ─► ForwardBatch ─► ModelRunner.forward (logit rows of the LogitPlan)
        ─► LogitPlan: prompt log-probs, Sampler ─► Scheduler.postprocess ─► Request.take_output

When the batch is steady (every request decoding, none waiting but for a
running place) and the runner can, a step is a decode run instead: `decode_steps` steps in one call
of the C kernels, sampling included (`Scheduler.run_length`), then
`Scheduler.postprocess_run` appends each request's tokens as single steps would.

The engine is synchronous and single-threaded: `step()` does one model
forward (or run) for whatever the scheduler picked. `radixrt.Runtime` drives it from a
background thread; requests arrive already validated (in the caller's
thread), and each reports its outputs through its own `on_output`.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from radixrt.config import RuntimeConfig
from radixrt.engine.cache_manager import CacheManager
from radixrt.engine.logits import LogitPlan, fill_row_mask, needs_mask
from radixrt.engine.request import Request, stop_token_ids
from radixrt.engine.scheduler import ScheduledBatch, Scheduler
from radixrt.kernels.forward_batch import ForwardBatch
from radixrt.model.runner import ModelRunner
from radixrt.sampling.grammar import new_bitmask
from radixrt.sampling.run_data import RunMasks
from radixrt.sampling.sampler import Sampler, run_sampling

logger = logging.getLogger("radixrt.engine")


class Engine:
    def __init__(self, runner: ModelRunner, cache: CacheManager, config: RuntimeConfig):
        self.runner = runner
        self.config = config
        self.device = runner.device
        self.scheduler = Scheduler(cache, config)
        self.sampler = Sampler(runner.row_kernels)
        self._runs_decodes = runner.runs_decodes
        self._vocab_size = runner.model.config.vocab_size
        # Set from any thread by `interrupt_run`: a decode run stops after its current step.
        self._interrupt = ctypes.c_int32(0)
        self.num_steps = 0
        self.num_decode_runs = 0
        self.num_computed_tokens = 0  # tokens the model actually ran, all requests together
        self.num_generated_tokens = 0
        self.num_retracted = 0
        self.num_draft_tokens = 0  # jump-forward tokens computed as drafts, and those the sampler confirmed
        self.num_confirmed_draft_tokens = 0
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0

    @property
    def cache(self) -> CacheManager:
        return self.scheduler.cache

    # --- requests ------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a validated request (see `radixrt.runtime.inputs`)."""
        self.scheduler.add(req)
        _report(req)  # a request the scheduler refused reports its end now

    def abort(self, rid: str) -> bool:
        """Stop a request (or all requests of a group id) and free what it holds; False if unknown or done."""
        aborted = self.scheduler.abort(rid, "aborted by the caller")
        for req in aborted:
            _report(req)
        return bool(aborted)

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
            "generated_tokens": self.num_generated_tokens,
            "retracted_requests": self.num_retracted,
            "draft_tokens": self.num_draft_tokens,
            "confirmed_draft_tokens": self.num_confirmed_draft_tokens,
            "running_requests": len(self.scheduler.running),
            "waiting_requests": len(self.scheduler.waiting),
        }
        stats.update(self.cache.stats())
        return stats

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # --- one step ----------------------------------------------------------------
    def step(self) -> None:
        batch = self.scheduler.schedule()
        self.num_retracted += len(batch.retracted)
        for req in batch.retracted:
            logger.debug("retracted %s (%d output tokens kept)", req.rid, len(req.output_ids))
        if not batch.items:
            return
        self._log_step(batch)
        if self._runs_decodes:
            num_steps = self.scheduler.run_length(batch, self.config.decode_steps)
            if num_steps > 1:
                self._decode_run(batch, num_steps)
                return
        self.num_steps += 1
        forward_batch = ForwardBatch.build(
            [r.fill_slice(r.num_computed, r.num_computed + n) for r, n in batch.items],
            [r.num_computed for r, _ in batch.items],
            [r.slots[: r.num_computed + n] for r, n in batch.items],
            device=self.device,
        )
        plan = LogitPlan.build(batch.items, forward_batch.qo_offsets)
        logits = self.runner.forward(forward_batch, torch.tensor(plan.rows, dtype=torch.int64, device=self.device))
        self.num_computed_tokens += forward_batch.num_tokens
        for req in batch.admitted:
            if req.num_retractions == 0:
                self.prompt_tokens += len(req.prompt_ids)
                self.cached_prompt_tokens += req.cached_len
        plan.record_prompt_logprobs(logits)
        next_tokens = plan.sample(logits, self.sampler, self._vocab_size)
        self.num_generated_tokens += sum(map(len, next_tokens))
        self.num_draft_tokens += sum(map(len, plan.drafts))
        self.num_confirmed_draft_tokens += sum(max(len(tokens) - 1, 0) for tokens in next_tokens)
        self.scheduler.postprocess(batch, next_tokens)
        for req, _ in batch.items:
            _report(req)
        if self.config.check_invariants:
            self.check_invariants()

    def interrupt_run(self, interrupt: bool = True) -> None:
        """Ask a decode run in progress (or the next one) to stop after its current step, so that
        what a caller posted (a new request, an abort) waits one step rather than a whole run;
        False withdraws the request once the caller's actions are taken. Safe from any thread."""
        self._interrupt.value = int(interrupt)

    def _decode_run(self, batch: ScheduledBatch, num_steps: int) -> None:
        """Up to `num_steps` decode steps of a steady batch in one call (`ModelRunner.decode_run`):
        the tokens, log-probabilities and K/V of as many `step`s, without the engine between them."""
        reqs = [req for req, _ in batch.items]
        grammars = _RunGrammars.of(reqs, self._vocab_size, self.config.jump_forward)
        masks = None if grammars is None else grammars.masks
        sampling = run_sampling(
            [r.params for r in reqs], [r.seed for r in reqs], [r.prompt_ids for r in reqs], [r.output_ids for r in reqs],
            [stop_token_ids(r.params, r.eos_token_ids) for r in reqs], num_steps, self._vocab_size, masks,
        )  # fmt: skip
        try:
            out = self.runner.decode_run(
                [r.fill_slice(r.num_computed, r.num_computed + 1)[0] for r in reqs], [r.num_computed for r in reqs],
                [r.slots[: r.num_computed + num_steps] for r in reqs], sampling, num_steps, self._interrupt,
            )  # fmt: skip
        finally:
            if grammars is not None:
                grammars.rewind()
        self.num_steps += out.tokens.shape[0]
        self.num_decode_runs += 1
        self.num_computed_tokens += out.tokens.numel()
        self.num_generated_tokens += self.scheduler.postprocess_run(batch, out.tokens.tolist(), out.logprobs.tolist(),
                                                                    out.top_lists())
        for req in reqs:
            _report(req)
        if self.config.check_invariants:
            self.check_invariants()

    # --- introspection -------------------------------------------------------------
    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    def _log_step(self, batch: ScheduledBatch) -> None:
        if not logger.isEnabledFor(logging.DEBUG):
            return
        pool = self.cache.pool
        logger.debug(
            "step %d: #new-seq %d, #new-token %d, #cached-token %d, token usage %.2f, #running-req %d, #queue-req %d",
            self.num_steps, len(batch.admitted), batch.num_new_tokens, sum(r.cached_len for r in batch.admitted),
            1 - pool.available / pool.num_slots, len(self.scheduler.running), len(self.scheduler.waiting),
        )


class _RunGrammars:
    """A decode run's `advance` call back: between two steps, each masked row (a grammar's, or one
    short of `min_new_tokens`: `needs_mask`) takes the row's token and writes the row's next mask.
    `rewind` then takes the grammars' tokens back, so that `Scheduler.postprocess_run` appends them
    to the requests as single steps would. With jump-forward, the run ends at a step after which a
    grammar forces its next text, so that the next step computes it as a draft."""

    def __init__(self, rows: list[tuple[int, Request]], allowed: torch.Tensor, jump_forward: bool):
        self._rows = [(row, req, len(req.output_ids)) for row, req in rows]
        self._allowed = allowed
        self._jump_forward = jump_forward
        self._taken = 0
        masked = torch.zeros(allowed.shape[0], dtype=torch.uint8)
        masked[[row for row, _ in rows]] = 1
        self.masks = RunMasks(allowed, masked, self)

    @classmethod
    def of(cls, reqs: list[Request], vocab_size: int, jump_forward: bool) -> _RunGrammars | None:
        """The masked rows of a run, their first step's masks written; None without any."""
        rows = [(row, req) for row, req in enumerate(reqs) if needs_mask(req, len(req.output_ids))]
        if not rows:
            return None
        allowed = new_bitmask(len(reqs), vocab_size)
        for row, req in rows:
            fill_row_mask(req, allowed, row, len(req.output_ids))
        return cls(rows, allowed, jump_forward)

    def __call__(self, step: int, tokens: list[int]) -> bool:
        self._taken += 1
        end = False
        for row, req, num_output in self._rows:
            grammar = req.grammar
            if grammar is not None and not grammar.accept(tokens[row]):
                raise RuntimeError(f"token {tokens[row]} of row {row} is outside its grammar, which allowed it")
            fill_row_mask(req, self._allowed, row, num_output + self._taken)
            end = end or (self._jump_forward and grammar is not None and grammar.forces_text)
        return end

    def rewind(self) -> None:
        for _, req, _ in self._rows:
            if req.grammar is not None:
                req.grammar.rollback(self._taken)
        self._taken = 0


def _report(req: Request) -> None:
    """Hand the request's new output, if any, to whoever submitted it."""
    output = req.take_output()
    if output is not None and req.on_output is not None and (req.stream or output.finished):
        req.on_output(output)
