"""Scheduler decisions, driven without a model: a step 'computes' what was scheduled."""

from __future__ import annotations

import pytest

from radixrt.config import RuntimeConfig
from radixrt.engine.cache_manager import NoPrefixCache
from radixrt.engine.logits import NextToken
from radixrt.engine.radix_cache import RadixCacheManager
from radixrt.engine.request import Request, RequestStatus
from radixrt.engine.scheduler import ScheduledBatch, Scheduler, common_prefix_length
from radixrt.memory import PagePool
from radixrt.sampling import SamplingParams


def make_scheduler(num_tokens: int = 4096, page_size: int = 1, **config) -> Scheduler:
    cache = RadixCacheManager(PagePool(num_tokens // page_size, page_size))
    return Scheduler(cache, RuntimeConfig(page_size=page_size, **config))


def request(tokens: list[int], max_new_tokens: int = 4) -> Request:
    return Request(list(tokens), SamplingParams(max_new_tokens=max_new_tokens, temperature=0))


def sevens(batch: ScheduledBatch) -> list[list[NextToken]]:
    """Token 7 for every request that completes its pending tokens in this step."""
    return [[NextToken(7, 0.0)] if r.num_computed + num == r.fill_len else [] for r, num in batch.items]


def fake_step(scheduler: Scheduler) -> list[tuple[Request, int]]:
    """A step without a model: everything scheduled is 'computed' and 7 is every sampled token."""
    batch = scheduler.schedule()
    scheduler.postprocess(batch, sevens(batch))
    scheduler.check_invariants()
    return batch.items


def run_all(scheduler: Scheduler) -> int:
    computed = 0
    while scheduler.has_work:
        computed += sum(num for _, num in fake_step(scheduler))
    return computed


def warm(scheduler: Scheduler, tokens: list[int]) -> None:
    scheduler.add(request(tokens, max_new_tokens=1))
    run_all(scheduler)


def test_lpm_admits_longest_cached_prefix_first():
    scheduler = make_scheduler(max_prefill_tokens=64)
    warm(scheduler, list(range(100, 160)))
    short = request(list(range(100, 110)) + [1] * 40)
    none = request([2] * 40)
    longest = request(list(range(100, 150)) + [3] * 5)
    for req in (short, none, longest):
        scheduler.add(req)
    admitted = [req for req, _ in scheduler.schedule().items]
    assert admitted[0] is longest
    assert admitted[0].cached_len == 50


def test_fcfs_keeps_arrival_order():
    scheduler = make_scheduler(schedule_policy="fcfs")
    warm(scheduler, list(range(100, 160)))
    reqs = [request([2] * 40), request(list(range(100, 150)) + [3])]
    for req in reqs:
        scheduler.add(req)
    assert [req for req, _ in scheduler.schedule().items] == reqs


def test_dfs_weight_groups_requests_of_the_heaviest_prefix():
    scheduler = make_scheduler(schedule_policy="dfs-weight")
    warm(scheduler, [1] * 40)
    warm(scheduler, [2] * 40)
    lone = request([1] * 40 + [5])
    group = [request([2] * 40 + [6 + i]) for i in range(3)]
    scheduler.add(lone)
    for req in group:
        scheduler.add(req)
    order = scheduler.order_waiting()
    assert order[:3] == group and order[3] is lone


def test_shared_uncached_prefix_is_computed_once():
    shared = list(range(1000, 1200))
    reqs = [request(shared + [i, i + 1, i + 2]) for i in range(4)]
    scheduler = make_scheduler()
    for req in reqs:
        scheduler.add(req)
    first = scheduler.schedule()
    assert [r for r, _ in first.items] == [reqs[0]], "the others wait for the shared prefix"
    # Finish that step, then the others find the prefix in the tree.
    scheduler.postprocess(first, sevens(first))
    computed = run_all(scheduler)
    assert all(r.cached_tokens == len(shared) for r in reqs[1:])
    # After the first prompt's 203 tokens: 3 new prompt tokens for each other
    # request, then 3 decode steps for each of the 4 requests.
    assert computed == 3 * 3 + 4 * 3


def test_without_radix_cache_every_prompt_is_computed():
    reqs = [request(list(range(1000, 1200)) + [i]) for i in range(3)]
    cache = NoPrefixCache(PagePool(4096, 1))
    scheduler = Scheduler(cache, RuntimeConfig(disable_radix_cache=True))
    for req in reqs:
        scheduler.add(req)
    assert run_all(scheduler) == 3 * 201 + 3 * 3
    assert cache.pool.available == 4096


def test_long_prompt_is_prefilled_in_chunks():
    scheduler = make_scheduler(chunked_prefill_size=256)
    req = request(list(range(1000)), max_new_tokens=2)
    other = request([5] * 10)
    scheduler.add(req)
    scheduler.add(other)
    chunks = []
    while req.status is not RequestStatus.FINISHED:
        items = fake_step(scheduler)
        chunks.append([num for r, num in items if r is req])
        assert scheduler.cache.tree.total_tokens >= min(req.num_computed, 1000) - 1
    assert chunks[:4] == [[256], [256], [256], [232]]
    assert other.cached_tokens == 0 and other.status is not RequestStatus.WAITING


def test_page_size_16_caches_whole_pages_only():
    scheduler = make_scheduler(page_size=16)
    warm(scheduler, list(range(40)))
    assert scheduler.cache.tree.total_tokens == 32
    req = request(list(range(40)) + [99])
    scheduler.add(req)
    scheduler.schedule()
    assert req.cached_len == 32 and req.slots.numel() % 16 == 0


def test_memory_pressure_retracts_fewest_outputs_longest_prompt_first():
    scheduler = make_scheduler(num_tokens=64, new_token_reserve_ratio=0.0)
    reqs = [request([i] * 12, max_new_tokens=30) for i in range(1, 4)]
    reqs.append(request([9] * 16, max_new_tokens=30))
    for req in reqs:
        scheduler.add(req)
    fake_step(scheduler)  # all four prefilled: 52 of 64 slots
    retracted = []
    while not retracted:
        batch = scheduler.schedule()
        retracted = batch.retracted
        scheduler.postprocess(batch, sevens(batch))
    assert retracted[0] is reqs[3], "same output count: the longest prompt goes first"
    assert retracted[0].status is RequestStatus.WAITING and retracted[0].slots.numel() == 0
    scheduler.check_invariants()


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length(list(range(1000)), list(range(999)) + [-1]) == 999


@pytest.mark.parametrize("policy", ["lpm", "fcfs", "dfs-weight"])
def test_every_request_completes_under_each_policy(policy):
    scheduler = make_scheduler(num_tokens=256, schedule_policy=policy, chunked_prefill_size=32)
    reqs = [request([i % 5] * (20 + i * 3) + [i], max_new_tokens=8) for i in range(20)]
    for req in reqs:
        scheduler.add(req)
    run_all(scheduler)
    assert all(r.status is RequestStatus.FINISHED and len(r.output_ids) == 8 for r in reqs)
    assert scheduler.cache.tree.protected_tokens == 0
    assert scheduler.cache.pool.available + scheduler.cache.tree.total_tokens == 256


def test_a_request_id_in_use_ends_the_new_request_and_nothing_else():
    scheduler = make_scheduler()
    first = request([1, 2, 3])
    second = Request([4, 5, 6], first.params, rid=first.rid)
    scheduler.add(first)
    scheduler.add(second)
    assert second.status is RequestStatus.FINISHED and second.finish_reason.type == "abort"
    assert "already in use" in second.finish_reason.message
    output = second.take_output()
    assert output.finished and output.result["meta_info"]["finish_reason"]["type"] == "abort"
    run_all(scheduler)
    assert first.status is RequestStatus.FINISHED and len(first.output_ids) == 4


def test_abort_frees_a_running_and_a_waiting_request():
    scheduler = make_scheduler(max_running_requests=1)
    running, waiting = request(list(range(50)), max_new_tokens=20), request(list(range(100, 150)))
    scheduler.add(running)
    scheduler.add(waiting)
    fake_step(scheduler)
    assert running.status is RequestStatus.RUNNING and waiting.status is RequestStatus.WAITING
    assert scheduler.abort(running.rid, "stop") == [running]
    assert scheduler.abort(waiting.rid, "stop") == [waiting]
    assert scheduler.abort(waiting.rid, "stop") == [], "a finished request is not aborted twice"
    assert not scheduler.has_work and scheduler.cache.protected_tokens == 0
    scheduler.check_invariants()
    assert running.take_output().result["meta_info"]["finish_reason"] == {"type": "abort", "message": "stop"}


def test_abort_by_group_id_ends_every_sample_of_a_prompt():
    scheduler = make_scheduler()
    params = SamplingParams(max_new_tokens=8, temperature=0)
    samples = [Request([1, 2, 3], params, rid=f"job-{i}", group="job") for i in range(3)]
    other = Request([1, 2, 3], params, rid="other")
    for req in samples + [other]:
        scheduler.add(req)
    fake_step(scheduler)
    assert set(scheduler.abort("job", "stop")) == set(samples)
    assert list(scheduler.requests()) == [other]
    scheduler.check_invariants()


def decoding_batch(scheduler: Scheduler) -> ScheduledBatch:
    """Step until the next batch is decodes only (the prompts computed), and return it unrun."""
    while True:
        batch = scheduler.schedule()
        if batch.items and all(num == 1 for _, num in batch.items) and not batch.admitted:
            return batch
        scheduler.postprocess(batch, sevens(batch))


def test_a_steady_batch_runs_up_to_the_limit_closest_to_its_end():
    scheduler = make_scheduler()
    for tokens, limit in (([1, 2, 3], 20), ([4, 5, 6], 6)):
        scheduler.add(request(tokens, max_new_tokens=limit))
    batch = decoding_batch(scheduler)
    assert scheduler.run_length(batch, 8) == 5, "the second request has 5 tokens left"
    assert scheduler.run_length(batch, 1) == 1


def test_requests_waiting_for_a_running_place_do_not_stop_a_run_but_waiting_for_memory_does():
    """At `max_running_requests` only a request's end admits the next one, which a run stops at;
    a request waiting for memory may fit after any step, so the batch steps one at a time."""
    scheduler = make_scheduler(max_running_requests=2)
    for tokens in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        scheduler.add(request(tokens, max_new_tokens=20))
    batch = decoding_batch(scheduler)
    assert len(scheduler.waiting) == 1 and len(scheduler.running) == 2
    assert scheduler.run_length(batch, 8) == 8
    scheduler.check_invariants()

    scheduler = make_scheduler(num_tokens=64)
    for tokens in ([1] * 20, [2] * 20, [3] * 20):
        scheduler.add(request(tokens, max_new_tokens=20))
    batch = decoding_batch(scheduler)
    assert scheduler.waiting and len(scheduler.running) < scheduler.config.max_running_requests
    assert scheduler.run_length(batch, 8) == 1
