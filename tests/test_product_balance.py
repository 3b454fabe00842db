"""How the whole-step kernels' threads divide each kind of weight product
(kernels/cpu/product_balance.c): the tiles are always divided exactly, the shares follow measured
speeds, and no split changes a result."""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.kernels import cpu
from radixrt.model.llama import LlamaForCausalLM
from radixrt.sampling.params import SamplingParams
from radixrt.sampling.sampler import run_sampling
from tests.test_decode_run import deterministic_runner, sequences
from tests.test_decode_stack import VOCAB, both_paths, headed_model, make_batch  # noqa: F401 (a fixture)

KINDS = cpu.ProductBalance.KINDS


class Team(ctypes.Structure):
    """kernels.h's Team: a thread's place in its team (no barrier needed here)."""

    _fields_ = [("barrier", ctypes.c_void_p), ("thread", ctypes.c_int), ("threads", ctypes.c_int)]


@pytest.fixture(scope="module")
def library() -> ctypes.CDLL:
    if cpu.decode_stack() is None:
        pytest.skip("no C compiler or no AVX512-BF16 on this CPU: no whole-step kernels")
    library = cpu.load_library()
    assert library is not None
    library.radixrt_product_tiles.argtypes = [ctypes.c_void_p, ctypes.POINTER(Team), ctypes.c_int, ctypes.c_int64,
                                              ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)]
    library.radixrt_product_record.argtypes = [ctypes.c_void_p, ctypes.POINTER(Team), ctypes.c_int, ctypes.c_int64,
                                               ctypes.c_uint64]
    library.radixrt_product_rebalance.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return library


def divided(library: ctypes.CDLL, balance: cpu.ProductBalance, kind: int, threads: int, num_tiles: int):
    """Each thread's [first, last) of a product of `kind` over `num_tiles` tiles."""
    ranges = []
    for thread in range(threads):
        first, last = ctypes.c_int64(), ctypes.c_int64()
        library.radixrt_product_tiles(balance.pointer, Team(None, thread, threads), kind, num_tiles, first, last)
        ranges.append((first.value, last.value))
    return ranges


def record(library: ctypes.CDLL, balance: cpu.ProductBalance, kind: int, threads: int, tiles_and_ticks) -> None:
    for thread, (tiles, ticks) in enumerate(tiles_and_ticks):
        library.radixrt_product_record(balance.pointer, Team(None, thread, threads), kind, tiles, ticks)


@settings(max_examples=200, deadline=None)
@given(weights=st.lists(st.integers(1, 1000), min_size=2, max_size=8), num_tiles=st.integers(0, 5000),
       kind=st.integers(0, len(KINDS) - 1))  # fmt: skip
def test_any_shares_divide_the_tiles_into_consecutive_runs_that_cover_them_once(library, weights, num_tiles, kind):
    balance = cpu.ProductBalance(library)
    threads = len(weights)
    shares = [w / sum(weights) for w in weights]
    balance.set_shares([shares] * len(KINDS))
    ranges = divided(library, balance, kind, threads, num_tiles)
    assert ranges[0][0] == 0 and ranges[-1][1] == num_tiles
    assert all(first <= last for first, last in ranges)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), "each thread starts where the one before ended"
    for (first, last), share in zip(ranges, shares):
        assert abs((last - first) - share * num_tiles) <= 2, "a thread's run is its share of the tiles, rounded"


def test_without_learnt_shares_a_team_divides_equally(library):
    balance = cpu.ProductBalance(library)
    assert balance.shares() is None
    assert divided(library, balance, 0, 3, 10) == [(0, 3), (3, 6), (6, 10)]


def test_shares_move_halfway_to_the_measured_speeds(library):
    balance = cpu.ProductBalance(library)
    library.radixrt_product_rebalance(balance.pointer, 2)  # a first step of two threads: equal shares
    assert balance.shares() == {kind: [0.5, 0.5] for kind in KINDS}
    record(library, balance, KINDS.index("gate_up"), 2, [(100, 1000), (100, 3000)])  # thread 1 a third as fast
    library.radixrt_product_rebalance(balance.pointer, 2)
    shares = balance.shares()
    assert shares["gate_up"] == pytest.approx([0.5 * 0.5 + 0.5 * 0.75, 0.5 * 0.5 + 0.5 * 0.25])
    assert all(shares[kind] == [0.5, 0.5] for kind in KINDS if kind != "gate_up"), "kinds not measured stay"
    assert divided(library, balance, KINDS.index("gate_up"), 2, 96) == [(0, 60), (60, 96)]
    library.radixrt_product_rebalance(balance.pointer, 2)
    assert balance.shares() == shares, "what was recorded counts once"


def test_a_stalled_thread_keeps_a_quarter_of_an_equal_share(library):
    balance = cpu.ProductBalance(library)
    library.radixrt_product_rebalance(balance.pointer, 4)
    for _ in range(30):
        record(library, balance, 0, 4, [(50, 100), (50, 100), (50, 100), (1, 10**9)])
        library.radixrt_product_rebalance(balance.pointer, 4)
    shares = balance.shares()["qkv"]
    assert sum(shares) == pytest.approx(1.0)
    assert shares[3] >= 0.25 / 4 - 1e-6
    assert shares[3] < 0.5 / 4, "the stalled thread lost more than half its equal share"


def test_a_new_team_size_starts_from_equal_shares(library):
    balance = cpu.ProductBalance(library)
    balance.set_shares([[0.2, 0.8]] * len(KINDS))
    library.radixrt_product_rebalance(balance.pointer, 3)
    assert balance.shares() == {kind: [pytest.approx(1 / 3)] * 3 for kind in KINDS}


@pytest.mark.parametrize("shares, field", [([[0.5, 0.5]] * 4, "rows"), ([[1.0]] * 5, "per-thread"),
                                           ([[0.7, 0.7]] * 5, "sum to 1"), ([[1.5, -0.5]] * 5, "positive")])
def test_shares_that_do_not_divide_a_product_are_refused(library, shares, field):
    balance = cpu.ProductBalance(library)
    with pytest.raises(ValueError, match=field):
        balance.set_shares(shares)
    assert balance.shares() is None, "nothing was set"


@pytest.fixture
def threads(request) -> int:
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


SKEWED = {2: [[0.2, 0.8], [0.9, 0.1], [0.35, 0.65], [0.6, 0.4], [0.15, 0.85]],
          3: [[0.1, 0.3, 0.6], [0.5, 0.25, 0.25], [0.3, 0.3, 0.4], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]}  # fmt: skip


@pytest.mark.parametrize("threads", [2, 3], indirect=True)
def test_a_step_gives_the_same_bits_however_its_products_are_divided(headed_model, threads):
    batch, num_slots = make_batch([(300, 1), (5, 1), (0, 1), (700, 1)], shared=0, seed=4)
    kernel = cpu.decode_stack()
    (equal, equal_k), _ = both_paths(headed_model, batch, num_slots, seed=1)
    kernel.balance.set_shares(SKEWED[threads])
    (skewed, skewed_k), _ = both_paths(headed_model, batch, num_slots, seed=1)
    assert torch.equal(equal, skewed)
    assert all(torch.equal(a, b) for a, b in zip(equal_k, skewed_k))
    learnt = kernel.balance.shares()
    assert learnt is not None and all(len(shares) == threads for shares in learnt.values())
    assert all(sum(shares) == pytest.approx(1.0) and min(shares) > 0 for shares in learnt.values())


@pytest.mark.parametrize("threads", [2, 3], indirect=True)
def test_a_run_gives_the_same_tokens_however_its_products_are_divided(headed_model, threads):
    contexts, steps = [300, 5, 1, 700], 6
    slots, num_slots = sequences(contexts, shared=0, steps=steps, seed=2)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9, seed=5),
              SamplingParams(temperature=0, repetition_penalty=1.3), SamplingParams(temperature=1.1, seed=6)]
    kernel = cpu.decode_run()
    results = []
    for shares in (None, SKEWED[threads]):
        if shares is not None:
            kernel.balance.set_shares(shares)
        runner = deterministic_runner(headed_model, num_slots)
        sampling = run_sampling(params, [0, 5, 0, 6], [[1, 2, 3]] * 4, [[]] * 4, [[]] * 4, steps, VOCAB)
        tokens, logprobs, _, _ = runner.decode_run([7, 8, 9, 10], [c - 1 for c in contexts], slots, sampling, steps)
        results.append((tokens, logprobs, [pool.clone() for pool in runner.kv_cache.k]))
    (tokens, logprobs, k), (skewed_tokens, skewed_logprobs, skewed_k) = results
    assert torch.equal(tokens, skewed_tokens) and torch.equal(logprobs, skewed_logprobs)
    assert all(torch.equal(a, b) for a, b in zip(k, skewed_k))

