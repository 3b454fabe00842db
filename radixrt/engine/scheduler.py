"""Which requests compute which tokens in the next step.

Each step the scheduler
  1. keeps every running request decoding (one token each), retracting the
     least advanced ones when even eviction cannot free a page for them;
  2. continues the request whose prompt is being prefilled in chunks;
  3. admits waiting requests in policy order while the step's prompt-token
     budget, the running-request cap and memory allow.
Memory for admission is "obtainable now" (free + evictable) minus a reserve
for the running requests' future decode tokens.

Policies:
  lpm        longest cached prefix first (SGLang's default); falls back to
             fcfs when the queue is longer than LPM_QUEUE_LIMIT, where
             matching every waiting request each step costs more than it saves.
  dfs-weight walk the tree of waiting requests' cached prefixes depth-first,
             heaviest subtree first, so requests sharing a prefix run together.
  fcfs       arrival order.

In-batch prefix sharing: a waiting request whose uncached part shares at
least IN_BATCH_SHARE_MIN_TOKENS tokens with a prompt being computed right now
waits one step, and then finds that shared part in the tree instead of
computing it a second time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

from radixrt.config import RuntimeConfig
from radixrt.engine.cache_manager import CacheManager
from radixrt.engine.request import Request, RequestStatus

LPM_QUEUE_LIMIT = 128
IN_BATCH_SHARE_MIN_TOKENS = 32
RESERVE_CLIP_TOKENS = 4096


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
    def __init__(self, cache: CacheManager, config: RuntimeConfig):
        self.cache = cache
        self.config = config
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._order: Callable[[list[Request]], list[Request]] = {
            "lpm": self._order_lpm,
            "dfs-weight": self._order_dfs_weight,
            "fcfs": self._order_fcfs,
        }[config.schedule_policy]

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step -----------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        decoding = [r for r in self.running if r.num_pending == 1]
        batch.retracted = self._fit_decodes(decoding)
        batch.items = [(r, 1) for r in decoding]

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

        for req in self._order(self.waiting) if self.waiting else []:
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
            self.running.append(req)
            batch.items.append((req, num))
            batch.admitted.append(req)
            budget -= num
            in_flight.append(req)
            if num < req.num_pending:
                break  # it continues next step; one chunked prefill at a time
        return batch

    def finish(self, req: Request) -> None:
        """A running request is done: give its KV to the tree and forget it."""
        self.cache.release(req)
        self.running.remove(req)
        req.status = RequestStatus.FINISHED

    def abort(self, req: Request) -> None:
        if req.status is RequestStatus.RUNNING:
            self.cache.release(req)
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED

    # --- memory pressure ------------------------------------------------------
    def _fit_decodes(self, decoding: list[Request]) -> list[Request]:
        """Reserve a slot for each decoding request, retracting the least advanced ones if short.

        Retraction victims: fewest output tokens first, then longest prompt
        (least work lost, most memory won). A retracted request keeps its
        outputs, its computed tokens stay in the tree as evictable entries,
        and it recomputes from what remains when readmitted.
        """
        retracted: list[Request] = []
        while True:
            need = sum(self.cache.pages_needed(r, 1) for r in decoding)
            if self.cache.make_room(need) or len(self.running) <= 1:
                break
            victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)))
            self._retract(victim)
            retracted.append(victim)
            if victim in decoding:
                decoding.remove(victim)
        for req in decoding:
            if not self.cache.reserve(req, 1):
                raise RuntimeError(f"KV pool too small to decode even one request ({req.rid})")
        return retracted

    def _retract(self, req: Request) -> None:
        self.cache.release(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_retractions += 1
        self.waiting.append(req)

    def _future_tokens(self, req: Request) -> int:
        return int(min(req.remaining_new_tokens, RESERVE_CLIP_TOKENS) * self.config.new_token_reserve_ratio)

    def _decode_reserve(self, requests: Sequence[Request]) -> int:
        return sum(self._future_tokens(r) for r in requests)

    # --- in-batch prefix sharing ------------------------------------------------
    def _shares_uncomputed_prefix(self, req: Request, in_flight: Sequence[Request]) -> bool:
        if self.cache.tree is None or not in_flight:
            return False
        matched = self._match_length(req)
        tokens = req.fill_ids
        for other in in_flight:
            if other.namespace == req.namespace:
                shared = common_prefix_length(tokens, other.fill_ids)
                if shared - matched >= max(IN_BATCH_SHARE_MIN_TOKENS, self.cache.page_size):
                    return True
        return False

    # --- policies ----------------------------------------------------------------
    def _match_length(self, req: Request) -> int:
        if self.cache.tree is None:
            return 0
        tokens = req.fill_ids[: req.max_prefix_match()]
        return self.cache.tree.match_prefix(tokens, namespace=req.namespace).length

    def _order_fcfs(self, waiting: list[Request]) -> list[Request]:
        return sorted(waiting, key=lambda r: r.arrival_index)

    def _order_lpm(self, waiting: list[Request]) -> list[Request]:
        if len(waiting) > LPM_QUEUE_LIMIT or self.cache.tree is None:
            return self._order_fcfs(waiting)
        lengths = {id(r): self._match_length(r) for r in waiting}
        return sorted(waiting, key=lambda r: (-lengths[id(r)], r.arrival_index))

    def _order_dfs_weight(self, waiting: list[Request]) -> list[Request]:
        """Depth-first over the tree nodes the waiting requests' prefixes end at.

        A node's weight is the number of waiting requests at or below it;
        heavier children are visited first, so a popular prefix's requests run
        back to back while it is still cached.
        """
        tree = self.cache.tree
        if tree is None:
            return self._order_fcfs(waiting)
        at_node: dict[int, list[Request]] = {}
        weight: dict[int, int] = {}
        children: dict[int, list] = {}
        roots: dict[int, object] = {}
        for req in sorted(waiting, key=lambda r: r.arrival_index):
            tokens = req.fill_ids[: req.max_prefix_match()]
            node = tree.match_prefix(tokens, namespace=req.namespace).last_node
            at_node.setdefault(id(node), []).append(req)
            while node is not None:
                first_visit = id(node) not in weight
                weight[id(node)] = weight.get(id(node), 0) + 1
                parent = node.parent
                if parent is None:
                    roots[id(node)] = node
                elif first_visit:
                    children.setdefault(id(parent), []).append(node)
                node = parent
        ordered: list[Request] = []
        stack = sorted(roots.values(), key=lambda n: weight[id(n)])
        while stack:
            node = stack.pop()
            ordered.extend(at_node.get(id(node), ()))
            stack.extend(sorted(children.get(id(node), ()), key=lambda n: weight[id(n)]))
        return ordered


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
