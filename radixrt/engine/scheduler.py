"""Which requests compute which tokens in the next step, and what follows from the step.

Each step the scheduler
  1. keeps every running request decoding (one token each), retracting the
     least advanced ones when even eviction cannot free a page for them;
  2. continues the request whose prompt is being prefilled in chunks;
  3. admits waiting requests in policy order (`policies`) while the step's
     prompt-token budget, the running-request cap and memory allow.
Memory for admission is "obtainable now" (free + evictable) minus a reserve
for the running requests' future decode tokens.

After the model ran, `postprocess` advances every request of the step by
what was computed: a finished prompt chunk or prompt is cached so others hit
it while it runs, a sampled token is appended, and a finished request gives
its KV to the cache. The scheduler is the cache manager's only caller.

In-batch prefix sharing: a waiting request whose uncached part shares at
least `in_batch_share_min_tokens` tokens with a prompt being computed right
now waits one step, and then finds that shared part in the cache instead of
computing it a second time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable, Iterator, Sequence

from radixrt.config import RuntimeConfig
from radixrt.engine.cache_manager import CacheManager
from radixrt.engine.logits import NextToken
from radixrt.engine.policies import order_waiting
from radixrt.engine.request import FinishReason, Request, RequestStatus


# The most tokens of a jump-forward draft: a longer forced text is drafted again after them.
MAX_DRAFT_TOKENS = 32


@dataclass
class ScheduledBatch:
    """Requests and how many of their pending tokens each computes this step."""

    items: list[tuple[Request, int]] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    retracted: list[Request] = field(default_factory=list)

    @property
    def num_new_tokens(self) -> int:
        return sum(num for _, num in self.items)


class Scheduler:
    """Owns the queues (`waiting`, `running`) and every request's path through them."""

    def __init__(self, cache: CacheManager, config: RuntimeConfig):
        self.cache = cache
        self.config = config
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._by_id: dict[str, Request] = {}

    def add(self, req: Request) -> None:
        """Queue a request; a request id already in use ends the new request at once (an abort)."""
        if req.rid in self._by_id:
            req.finish(FinishReason.abort(f"request id {req.rid!r} is already in use"))
            req.status = RequestStatus.FINISHED
            return
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        self._by_id[req.rid] = req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def requests(self) -> Iterator[Request]:
        """Every request not finished yet, waiting or running."""
        return iter(list(self._by_id.values()))

    # --- one step -----------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        decoding = [r for r in self.running if r.num_pending == 1]
        batch.retracted = self._fit_decodes(decoding)
        batch.items = [(r, 1 + len(r.draft_ids)) for r in decoding]

        budget = self.config.max_prefill_tokens
        in_flight: list[Request] = []
        for req in [r for r in self.running if r.num_pending > 1]:
            num = min(req.num_pending, self.config.chunked_prefill_size, budget)
            if num == 0 or not self.cache.reserve(req, num):
                continue
            batch.items.append((req, num))
            budget -= num
            in_flight.append(req)
        if any(num < r.num_pending for r, num in batch.items):
            return batch  # one chunked prefill at a time

        for req in self.order_waiting():
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if self._shares_uncomputed_prefix(req, in_flight):
                continue
            self.cache.admit(req)
            num = min(req.num_pending, self.config.chunked_prefill_size, budget)
            room = self.cache.obtainable_tokens - self._decode_reserve(self.running) - self._future_tokens(req)
            if self.cache.pages_needed(req, num) > room or not self.cache.reserve(req, num):
                self.cache.release(req, keep_computed=False)
                break
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            if req.admitted_s is None:
                req.admitted_s = time.perf_counter()
            self.running.append(req)
            batch.items.append((req, num))
            batch.admitted.append(req)
            budget -= num
            in_flight.append(req)
            if num < req.num_pending:
                break  # it continues next step; one chunked prefill at a time
        return batch

    def order_waiting(self) -> list[Request]:
        if not self.waiting:
            return []
        return order_waiting(self.config.schedule_policy, self.waiting, self.cache, self.config.lpm_queue_limit)

    def postprocess(self, batch: ScheduledBatch, next_tokens: Sequence[Sequence[NextToken]]) -> None:
        """Advance the step's requests: `next_tokens[i]` were sampled for `batch.items[i]` (empty:
        not sampled), the first after its last token, each later one after a draft token it
        confirmed (`LogitPlan.sample`).

        A request that completed its pending tokens without a sampled token
        has nothing left to generate (max_new_tokens = 0: it only scored its
        prompt). A draft token is computed only once confirmed: the K/V of
        the others stay in the request's private slots, unwritten as far as
        anyone reads, and are written over by the tokens that follow.
        """
        for (req, num), tokens in zip(batch.items, next_tokens):
            # Only a step that computed prompt tokens has something new for others to hit; a decode
            # step's one token waits for the request's end (inserting it every step would grow the
            # tree by a one-token node per generated token).
            computed_prompt = req.num_computed < len(req.prompt_ids)
            drafted = max(req.num_computed + num - req.fill_len, 0)
            req.num_computed += num - drafted
            req.draft_ids = []
            if req.num_pending > 0:  # a chunk of a long prompt
                self.cache.cache_computed(req)
                continue
            if not tokens:
                req.finish(FinishReason.at_length(req.params.token_limit))
            for index, token in enumerate(tokens):
                req.num_computed += index > 0  # the draft token this one follows was confirmed
                req.append_token(token.token_id, token.logprob, token.top_logprobs, token.ids_logprobs)
                if req.finish_reason is not None:
                    break
            if req.finish_reason is not None:
                self._finish(req)
                continue
            if num - drafted > 1 or computed_prompt:
                self.cache.cache_computed(req)  # the prompt is computed: let others hit it now
            self._plan_draft(req)

    def _plan_draft(self, req: Request) -> None:
        """The tokens a request's grammar forces next, for its next step to check (`jump_forward`);
        one fewer than it may still generate, since the step picks a token after them too."""
        if req.grammar is not None and self.config.jump_forward:
            req.draft_ids = req.grammar.forced_tokens(min(req.remaining_new_tokens - 1, MAX_DRAFT_TOKENS))

    def run_length(self, batch: ScheduledBatch, max_steps: int) -> int:
        """How many decode steps `batch` runs back to back in one call (1: this step alone), with
        slots reserved for all of them.

        Only a steady batch runs: every request of it decoding, and none waiting unless the
        running requests are at `max_running_requests` (then only a request's end lets one in,
        and a run ends at the step where a request draws a stop token or reaches its limit; one
        ended by a stop string lets it in after the run). Requests waiting for memory or the
        prefill budget are admitted step by step (a decode frees reserved room as it goes), and
        a request posted during a run ends it (`Engine.interrupt_run`). At most as many steps as
        the request closest to its token limit may still take.
        """
        if max_steps < 2 or batch.retracted or batch.admitted:
            return 1
        if self.waiting and len(self.running) < self.config.max_running_requests:
            return 1
        if any(num != 1 or not r.params.decodes_in_runs for r, num in batch.items):
            return 1
        steps = min(max_steps, *(r.remaining_new_tokens for r, _ in batch.items))
        if steps < 2 or not all(self.cache.reserve(r, steps) for r, _ in batch.items):
            return 1  # slots already reserved stay with their requests for the next steps
        return steps

    def postprocess_run(
        self, batch: ScheduledBatch, tokens: list[list[int]], logprobs: list[list[float]],
        top_logprobs: list[list[list[tuple[int, float]]]] | None = None,
    ) -> int:
        """Advance the requests of a decode run (`run_length`) by its steps: `tokens[s][i]`, of
        log-probability `logprobs[s][i]`, was sampled for `batch.items[i]` in step s, with its
        row's most likely tokens `top_logprobs[s][i]` (as many as any request asked for). A request
        that a token ends (a stop token, a stop string, its limit) keeps nothing after it: the
        later steps' K/V sit in slots it gives back. Returns how many tokens were appended."""
        appended = 0
        for i, (req, _) in enumerate(batch.items):
            wanted = req.params.top_logprobs_num
            for s, (step_tokens, step_logprobs) in enumerate(zip(tokens, logprobs)):
                req.num_computed += 1
                top = top_logprobs[s][i][:wanted] if top_logprobs is not None and wanted else None
                req.append_token(step_tokens[i], step_logprobs[i], top)
                appended += 1
                if req.finish_reason is not None:
                    self._finish(req)
                    break
            else:
                self._plan_draft(req)
        return appended

    def abort(self, rid: str, message: str) -> list[Request]:
        """End the unfinished requests with this id or group id and free what they hold.

        Returns them (none when the id is unknown or its requests are done),
        so an abort is idempotent.
        """
        aborted = [r for r in self._by_id.values() if r.rid == rid or r.group == rid]
        for req in aborted:
            if req.status is RequestStatus.RUNNING:
                self.cache.release(req)
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.finish(FinishReason.abort(message))
            req.status = RequestStatus.FINISHED
            del self._by_id[req.rid]
        return aborted

    def _finish(self, req: Request) -> None:
        """A running request is done: give its KV to the cache and forget it."""
        self.cache.release(req)
        self.running.remove(req)
        req.status = RequestStatus.FINISHED
        del self._by_id[req.rid]

    # --- memory pressure ------------------------------------------------------
    def _fit_decodes(self, decoding: list[Request]) -> list[Request]:
        """Reserve a slot for each decoding request, retracting the least advanced ones if short.

        Retraction victims: fewest output tokens first, then longest prompt
        (least work lost, most memory won). A retracted request keeps its
        outputs, its computed tokens stay cached as evictable entries, and it
        recomputes from what remains when readmitted.
        """
        retracted: list[Request] = []
        while True:
            need = sum(self.cache.pages_needed(r, 1 + len(r.draft_ids)) for r in decoding)
            if self.cache.make_room(need):
                break
            if any(r.draft_ids for r in decoding):  # drafts are the first thing to give up
                for req in decoding:
                    req.draft_ids = []
                continue
            if len(self.running) <= 1:
                break
            victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)))
            self._retract(victim)
            retracted.append(victim)
            if victim in decoding:
                decoding.remove(victim)
        for req in decoding:
            if not self.cache.reserve(req, 1 + len(req.draft_ids)):
                raise RuntimeError(f"KV pool too small to decode even one request ({req.rid})")
        return retracted

    def _retract(self, req: Request) -> None:
        self.cache.release(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_retractions += 1
        self.waiting.append(req)

    def _future_tokens(self, req: Request) -> int:
        clipped = min(req.remaining_new_tokens, self.config.new_token_reserve_clip)
        return int(clipped * self.config.new_token_reserve_ratio)

    def _decode_reserve(self, requests: Sequence[Request]) -> int:
        return sum(self._future_tokens(r) for r in requests)

    # --- in-batch prefix sharing ------------------------------------------------
    def _shares_uncomputed_prefix(self, req: Request, in_flight: Sequence[Request]) -> bool:
        if not self.cache.caches_prefixes or not in_flight:
            return False
        matched = self.cache.match_length(req)
        tokens = req.fill_ids
        threshold = max(self.config.in_batch_share_min_tokens, self.cache.page_size)
        for other in in_flight:
            if other.namespace == req.namespace:
                if common_prefix_length(tokens, other.fill_ids) - matched >= threshold:
                    return True
        return False

    # --- integrity ----------------------------------------------------------------
    def check_invariants(self) -> None:
        self.cache.check_invariants(self.running)
        for req in self.waiting:
            assert req.slots.numel() == 0 and req.last_node is None, f"{req.rid} waits holding KV"
        assert {r.rid for r in self.waiting} | {r.rid for r in self.running} == set(self._by_id), "queues and ids differ"


def common_prefix_length(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Length of the common prefix of two token lists, by bisection over C-speed slice compares."""
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low
