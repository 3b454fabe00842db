"""A tree's events keep a mirror exact: the router's copy of a replica's cache never drifts.

The replica tree runs random inserts, matches (which split edges), locks,
unlocks and evictions with events recorded; a mirror applies the drained
events at random points. Whenever it has caught up, both hold exactly the
same token sequences (compared leaf path by leaf path, per namespace, since
split points may differ), and both invariant checkers pass.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.tree import RadixTree
from radixrt.tree.events import CacheEvent

tokens = st.lists(st.integers(0, 3), min_size=1, max_size=10)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), tokens, st.sampled_from([None, "t"])),
        st.tuples(st.just("match_lock"), tokens, st.sampled_from([None, "t"])),
        st.tuples(st.just("unlock"), st.integers(0, 20)),
        st.tuples(st.just("evict"), st.integers(0, 12)),
        st.tuples(st.just("drain"),),
    ),
    max_size=40,
)


def leaf_paths(tree: RadixTree) -> set[tuple]:
    """Every (namespace, root-to-leaf token sequence): the token set, whatever the split points."""
    paths = set()
    for namespace, root in tree._roots.items():
        stack = [(root, ())]
        while stack:
            node, prefix = stack.pop()
            here = prefix + tuple(node.tokens())
            if not node.children and node.parent is not None:
                paths.add((namespace, here))
            stack.extend((child, here) for child in node.children.values())
    return paths


@settings(max_examples=300, deadline=None)
@given(ops=operations, page_size=st.sampled_from([1, 2, 4]))
def test_a_mirror_fed_the_events_holds_exactly_what_the_replica_holds(ops, page_size):
    replica, mirror = RadixTree(page_size), RadixTree(1)
    replica.record_events()
    locked = []
    slot = 0
    for op in ops + [("drain",)]:
        if op[0] == "insert":
            replica.insert(op[1], torch.arange(slot, slot + len(op[1])), op[2])
            slot += len(op[1])
        elif op[0] == "match_lock":
            node = replica.match_prefix(op[1], op[2]).last_node
            replica.lock(node)
            locked.append(node)
        elif op[0] == "unlock" and locked:
            replica.unlock(locked.pop(op[1] % len(locked)))
        elif op[0] == "evict":
            replica.evict(op[1])
        elif op[0] == "drain":
            mirror.apply_events(replica.drain_events())
            assert leaf_paths(mirror) == leaf_paths(replica)
            mirror.check_invariants()
            replica.check_invariants()


def test_recording_starts_with_what_is_already_cached():
    tree = RadixTree(page_size=2)
    tree.insert([1, 2, 3, 4], torch.arange(4))
    tree.insert([1, 2, 5, 6, 7], torch.arange(4, 9), namespace="t")
    tree.match_prefix([1, 2, 3])  # a split: not a change of the token set
    tree.record_events()
    mirror = RadixTree()
    mirror.apply_events(tree.drain_events())
    assert leaf_paths(mirror) == leaf_paths(tree)


def test_events_are_recorded_only_when_asked_and_drained_once():
    tree = RadixTree()
    tree.insert([1, 2, 3], torch.arange(3))
    assert tree.drain_events() == []
    tree.record_events()  # starts with what is cached: [1, 2, 3]
    tree.insert([1, 2, 3], torch.arange(3))  # nothing new: no event
    tree.insert([1, 2, 4], torch.arange(3, 6))
    tree.evict(100)
    events = tree.drain_events()
    assert [(e.kind, e.keep) for e in events] == [("insert", 0)] * 2 + [("evict", 2)] * 2 + [("evict", 0)]
    assert tree.drain_events() == []


def test_forget_drops_one_branch_and_respects_locks():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], torch.arange(4))
    tree.insert([1, 2, 7, 7], torch.arange(4, 8))
    assert tree.forget([1, 2, 3, 4, 5], 3) == 1  # splits [3, 4] and drops [4]
    assert tree.forget([1, 2, 9], 2) == 0  # nothing cached along it past 2
    assert tree.forget([8, 8], 0) == 0
    tree.check_invariants()
    assert sorted(p for _, p in leaf_paths(tree)) == [(1, 2, 3), (1, 2, 7, 7)]
    tree.lock(tree.match_prefix([1, 2, 7, 7]).last_node)
    assert tree.forget([1, 2, 7, 7], 2) == 0  # in use: it stays
    with pytest.raises(ValueError, match="keep"):
        tree.forget([1, 2], 5)
    assert tree.evict(100).tolist() == [2]  # the forgotten node's stale LRU entry is skipped
    tree.check_invariants()


def test_forgotten_nodes_do_not_pile_up_in_a_mirror_that_never_evicts():
    mirror = RadixTree()
    for i in range(2_000):
        mirror.apply_events([CacheEvent("insert", None, torch.tensor([5, i], dtype=torch.int64).numpy().tobytes())])
        mirror.apply_events([CacheEvent("evict", None, torch.tensor([5, i], dtype=torch.int64).numpy().tobytes(), 1)])
    assert len(mirror._lru) < 50
    mirror.check_invariants()
