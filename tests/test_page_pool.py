"""Tests of radixrt.memory.PagePool, alone and as the radix tree's backing pool."""

from __future__ import annotations

import random

import pytest
import torch

from radixrt.memory.page_pool import OutOfPages, PagePool
from radixrt.tree import RadixTree


def test_alloc_free_round_trip():
    pool = PagePool(num_pages=10)
    first = pool.alloc(3)
    second = pool.alloc(7)
    assert first.dtype == torch.int64
    assert sorted(first.tolist() + second.tolist()) == list(range(10))
    assert pool.available == 0
    pool.free(first)
    pool.free(second)
    assert pool.available == 10
    pool.check_invariants()
    again = pool.alloc(10)
    assert sorted(again.tolist()) == list(range(10))


def test_alloc_zero_gives_nothing():
    pool = PagePool(num_pages=2, page_size=4)
    assert pool.alloc(0).numel() == 0
    assert pool.available == 8
    pool.free(torch.empty(0, dtype=torch.int64))
    pool.check_invariants()


@pytest.mark.parametrize("page_size", [2, 16])
def test_whole_pages_with_page_size_above_one(page_size):
    pool = PagePool(num_pages=8, page_size=page_size)
    slots = pool.alloc(page_size + 1)  # rounds up to two pages
    assert slots.numel() == 2 * page_size
    pages = slots.view(-1, page_size)
    assert torch.equal(pages, pages[:, :1] + torch.arange(page_size))
    assert bool((pages[:, 0] % page_size == 0).all())
    assert pool.available == 6 * page_size
    assert pool.pages_for(page_size + 1) == 2
    with pytest.raises(ValueError, match="whole"):
        pool.free(slots[:1])  # part of a page
    with pytest.raises(ValueError, match="whole"):
        pool.free(slots.flip(0))  # pages out of order inside
    pool.free(slots)
    assert pool.available == 8 * page_size
    pool.check_invariants()


def test_double_free_raises_and_changes_nothing():
    pool = PagePool(num_pages=4)
    slots = pool.alloc(2)
    pool.free(slots)
    with pytest.raises(ValueError, match="double free"):
        pool.free(slots)
    assert pool.available == 4
    other = pool.alloc(1)
    with pytest.raises(ValueError, match="twice"):
        pool.free(torch.cat((other, other)))
    assert pool.available == 3
    pool.check_invariants()


def test_bad_arguments():
    for num_pages, page_size in ((0, 1), (-1, 1), (4, 0), (2.0, 1)):
        with pytest.raises(ValueError):
            PagePool(num_pages, page_size)
    pool = PagePool(num_pages=4)
    for count in (-1, 1.5, "2"):
        with pytest.raises(ValueError):
            pool.alloc(count)
    for slots in ([0], torch.tensor([0], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int64)):
        with pytest.raises(ValueError):
            pool.free(slots)
    with pytest.raises(ValueError, match="range"):
        pool.free(torch.tensor([4]))
    with pytest.raises(ValueError, match="range"):
        pool.free(torch.tensor([-1]))
    assert pool.available == 4


def test_out_of_pages_never_over_allocates():
    pool = PagePool(num_pages=5, page_size=4)
    held = pool.alloc(13)  # 4 pages
    with pytest.raises(OutOfPages) as caught:
        pool.alloc(5)  # needs 2 pages, 1 left
    assert caught.value.requested_tokens == 5 and caught.value.available_tokens == 4
    assert pool.available == 4
    assert pool.alloc(4).numel() == 4
    with pytest.raises(OutOfPages):
        pool.alloc(1)
    assert pool.available == 0
    pool.free(held)
    pool.check_invariants()


def test_reset_frees_everything():
    pool = PagePool(num_pages=3, page_size=2)
    pool.alloc(5)
    pool.reset()
    assert pool.available == 6
    pool.check_invariants()


def test_random_alloc_free_against_a_set():
    rng = random.Random(0)
    pool = PagePool(num_pages=64, page_size=4)
    held: list[torch.Tensor] = []
    used: set[int] = set()
    for _ in range(400):
        if held and rng.random() < 0.45:
            slots = held.pop(rng.randrange(len(held)))
            pool.free(slots)
            used -= set(slots.tolist())
        else:
            count = rng.randint(0, 30)
            if pool.pages_for(count) > pool.available_pages:
                with pytest.raises(OutOfPages):
                    pool.alloc(count)
                continue
            slots = pool.alloc(count)
            assert not used & set(slots.tolist()), "handed out a slot in use"
            used |= set(slots.tolist())
            held.append(slots)
        assert pool.available + len(used) == pool.num_slots
    pool.check_invariants()


@pytest.mark.parametrize("page_size", [1, 4])
def test_tree_evictions_return_each_slot_exactly_once(page_size):
    """Scheduler-shaped loop: every slot is free, in the tree, or held; never two."""
    rng = random.Random(page_size)
    pool = PagePool(num_pages=40, page_size=page_size)
    tree = RadixTree(page_size=page_size)
    for _ in range(300):
        tokens = [rng.randrange(3) for _ in range(rng.randint(1, 30))]
        match = tree.match_prefix(tokens)
        tree.lock(match.last_node)
        needed = pool.pages_for(len(tokens) - match.length)
        if needed > pool.available_pages:
            freed = tree.evict((needed - pool.available_pages) * page_size)
            assert freed.numel() % page_size == 0
            pool.free(freed)  # raises on a double free
        if needed > pool.available_pages:
            tree.unlock(match.last_node)
            continue
        new = pool.alloc(len(tokens) - match.length)
        cached = tree.insert(tokens, torch.cat((match.indices, new))[: len(tokens)])
        whole = len(tokens) - len(tokens) % page_size
        pool.free(new[: cached - match.length])  # duplicates
        pool.free(new[whole - match.length :])  # the tail that is not a whole page
        tree.unlock(match.last_node)
        assert pool.available + tree.total_tokens == pool.num_slots
        tree.check_invariants()
        pool.check_invariants()
    pool.free(tree.evict(10**18))
    assert tree.total_tokens == 0 and pool.available == pool.num_slots
    pool.check_invariants()
