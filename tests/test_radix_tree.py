"""Unit tests of radixrt.tree.RadixTree: structure, LRU, pages, namespaces, bad input."""

from __future__ import annotations

import random
from array import array

import pytest
import torch

from radixrt.tree import MatchResult, RadixTree, TreeNode


def slots(start: int, count: int) -> torch.Tensor:
    return torch.arange(start, start + count, dtype=torch.int64)


def edges(node: TreeNode) -> dict[int, list[int]]:
    """First token -> edge tokens of each child of `node`."""
    return {child.tokens()[0]: child.tokens() for child in node.children.values()}


def test_empty_tree_matches_nothing():
    tree = RadixTree()
    match = tree.match_prefix([1, 2, 3])
    assert isinstance(match, MatchResult)
    assert match.length == 0
    assert match.indices.dtype == torch.int64 and match.indices.numel() == 0
    assert match.last_node.parent is None  # the root
    assert tree.total_tokens == 0
    tree.check_invariants()


def test_insert_then_match_whole_and_prefix():
    tree = RadixTree()
    assert tree.insert([1, 2, 3, 4], slots(10, 4)) == 0
    match = tree.match_prefix([1, 2, 3, 4, 5, 6])
    assert match.length == 4
    assert match.indices.tolist() == [10, 11, 12, 13]
    assert tree.insert([1, 2, 3, 4], slots(50, 4)) == 4
    assert tree.match_prefix([1, 2, 3, 4]).indices.tolist() == [10, 11, 12, 13]
    assert tree.total_tokens == 4
    tree.check_invariants()


def test_insert_splits_edge_where_it_diverges():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4, 5], slots(0, 5))
    cached = tree.insert([1, 2, 3, 9, 9], slots(100, 5))
    assert cached == 3
    root = tree.match_prefix([]).last_node
    assert edges(root) == {1: [1, 2, 3]}
    (upper,) = root.children.values()
    assert edges(upper) == {4: [4, 5], 9: [9, 9]}
    # The tree kept its own slots for the shared part.
    assert tree.match_prefix([1, 2, 3, 9, 9]).indices.tolist() == [0, 1, 2, 103, 104]
    assert tree.total_tokens == 7
    tree.check_invariants()


def test_match_ending_inside_an_edge_splits_there():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4, 5, 6], slots(0, 6))
    match = tree.match_prefix([1, 2, 3, 7])
    assert match.length == 3
    assert match.indices.tolist() == [0, 1, 2]
    assert match.last_node.tokens() == [1, 2, 3]
    assert edges(match.last_node) == {4: [4, 5, 6]}
    # A query that is a strict prefix of an edge splits it too.
    short = tree.match_prefix([1, 2, 3, 4])
    assert short.length == 4 and short.last_node.tokens() == [4]
    assert tree.total_tokens == 6
    tree.check_invariants()


def test_handle_stays_valid_when_a_later_split_cuts_its_edge():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4, 5, 6], slots(0, 6))
    handle = tree.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    tree.lock(handle)
    assert tree.protected_tokens == 6
    tree.insert([1, 2, 9], slots(20, 3))  # splits handle's edge after 2 tokens
    tree.match_prefix([1])  # and again after 1
    tree.check_invariants()
    assert handle.tokens() == [3, 4, 5, 6]  # still ends where it ended
    assert tree.protected_tokens == 6
    tree.unlock(handle)
    assert tree.protected_tokens == 0
    tree.check_invariants()
    assert tree.evict(100).numel() == 7


def test_lock_counts_nest_and_unlock_of_unlocked_node_raises():
    tree = RadixTree()
    tree.insert([1, 2, 3], slots(0, 3))
    node = tree.match_prefix([1, 2, 3]).last_node
    tree.lock(node)
    tree.lock(node)
    tree.unlock(node)
    assert tree.protected_tokens == 3
    tree.unlock(node)
    assert tree.protected_tokens == 0 and tree.evictable_tokens == 3
    before = tree.pretty()
    with pytest.raises(ValueError, match="not locked"):
        tree.unlock(node)
    assert tree.pretty() == before
    tree.check_invariants()


def test_unlock_refuses_a_node_locked_only_through_a_descendant():
    tree = RadixTree()
    tree.insert([1, 2, 3], slots(0, 3))
    parent = tree.match_prefix([1, 2]).last_node
    child = tree.match_prefix([1, 2, 3]).last_node
    root = parent.parent
    tree.lock(child)
    before = tree.pretty()
    for node in (parent, root):
        with pytest.raises(ValueError, match="not locked"):
            tree.unlock(node)
    assert tree.pretty() == before
    tree.unlock(child)
    tree.check_invariants()


def test_lock_and_unlock_of_the_root_are_allowed():
    tree = RadixTree()
    tree.insert([1, 2], slots(0, 2))
    root = tree.match_prefix([7]).last_node
    tree.lock(root)
    assert tree.protected_tokens == 0
    assert tree.evict(10).numel() == 2  # the root protects nothing below it
    tree.unlock(root)
    with pytest.raises(ValueError):
        tree.unlock(root)
    tree.check_invariants()


def test_lru_evicts_least_recent_leaves_first_and_keeps_locked_paths():
    tree = RadixTree()
    tree.insert([1, 1, 1], slots(0, 3))
    tree.insert([2, 2], slots(3, 2))
    tree.insert([3, 3, 3, 3], slots(5, 4))
    tree.match_prefix([1, 1, 1])  # now [2 2] is the least recently used
    locked = tree.match_prefix([3, 3, 3, 3]).last_node
    tree.lock(locked)
    assert tree.evict(1).tolist() == [3, 4]
    assert tree.evict(1).tolist() == [0, 1, 2]
    assert tree.evict(100).numel() == 0  # only the locked path is left
    assert tree.total_tokens == tree.protected_tokens == 4
    tree.unlock(locked)
    assert tree.evict(100).tolist() == [5, 6, 7, 8]
    tree.check_invariants()


def test_evict_takes_leaves_before_parents_and_parent_becomes_candidate():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], slots(0, 4))
    tree.insert([1, 2, 5, 6], slots(10, 4))
    tree.insert([7], slots(20, 1))  # newest
    freed = tree.evict(5)
    # [3 4] is the oldest leaf, then [5 6]; that leaves the shared [1 2] a
    # leaf, older than [7], so it goes next.
    assert freed.tolist() == [2, 3, 12, 13, 0, 1]
    tree.check_invariants()
    assert tree.evict(10**18).tolist() == [20]
    assert tree.total_tokens == 0
    tree.check_invariants()


def test_evict_zero_frees_nothing_and_flush_empties():
    tree = RadixTree()
    tree.insert([1, 2, 3], slots(0, 3))
    assert tree.evict(0).numel() == 0
    assert tree.total_tokens == 3
    assert tree.evict(10**18).tolist() == [0, 1, 2]
    tree.check_invariants()


def test_size_accounting():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], slots(0, 4))
    tree.insert([1, 2, 5], slots(4, 3))
    assert (tree.total_tokens, tree.evictable_tokens, tree.protected_tokens) == (5, 5, 0)
    node = tree.match_prefix([1, 2, 5]).last_node
    tree.lock(node)
    assert (tree.total_tokens, tree.evictable_tokens, tree.protected_tokens) == (5, 2, 3)
    tree.evict(10)
    assert (tree.total_tokens, tree.evictable_tokens, tree.protected_tokens) == (3, 0, 3)
    tree.check_invariants()


@pytest.mark.parametrize(
    "as_type",
    [list, tuple, lambda t: array("q", t), lambda t: torch.tensor(t, dtype=torch.int64),
     lambda t: torch.tensor(t, dtype=torch.int32), lambda t: array("I", t)],
)
def test_every_accepted_token_type_behaves_the_same(as_type):
    tree = RadixTree()
    tree.insert(as_type([5, 6, 7, 8]), slots(0, 4))
    assert tree.insert([5, 6, 9], slots(10, 3)) == 2
    assert tree.match_prefix(as_type([5, 6, 7, 8, 1])).length == 4
    assert tree.match_prefix(as_type([5, 6, 9])).indices.tolist() == [0, 1, 12]
    tree.check_invariants()


def test_large_token_ids_are_fine():
    tree = RadixTree()
    big = [2**63 - 1, 2**40, 0]
    tree.insert(big, slots(0, 3))
    assert tree.match_prefix(array("q", big)).length == 3


def test_tree_copies_slots_in_and_out():
    tree = RadixTree()
    mine = slots(0, 3)
    tree.insert([1, 2, 3], mine)
    mine[:] = -1  # the caller reuses its tensor
    got = tree.match_prefix([1, 2, 3]).indices
    assert got.tolist() == [0, 1, 2]
    got[:] = 99  # and scribbles on what it got
    assert tree.match_prefix([1, 2, 3]).indices.tolist() == [0, 1, 2]


def test_namespaces_never_match_each_other():
    tree = RadixTree()
    tree.insert([1, 2, 3], slots(0, 3), namespace="tenant-a")
    assert tree.match_prefix([1, 2, 3]).length == 0
    assert tree.match_prefix([1, 2, 3], namespace="tenant-b").length == 0
    assert tree.insert([1, 2, 3], slots(10, 3), namespace="tenant-b") == 0
    a = tree.match_prefix([1, 2, 3], namespace="tenant-a")
    b = tree.match_prefix([1, 2, 3], namespace="tenant-b")
    assert a.indices.tolist() == [0, 1, 2] and b.indices.tolist() == [10, 11, 12]
    empty = tree.match_prefix([9], namespace="tenant-c")
    assert empty.length == 0 and empty.last_node.namespace == "tenant-c"
    assert tree.total_tokens == 6
    tree.check_invariants()


def test_pretty_shows_tokens_sizes_and_locks():
    tree = RadixTree()
    tree.insert(list(range(100, 120)), slots(0, 20))
    tree.insert([100, 101, 7], slots(20, 3))
    node = tree.match_prefix([100, 101, 7]).last_node
    tree.lock(node)
    text = tree.pretty()
    assert "21 tokens, 18 evictable, 3 protected" in text
    assert "namespace None: root lock=1" in text
    assert "[100 101] len=2 lock=1" in text
    assert "[7] len=1 lock=1" in text
    assert "[102 103 104 105 ... 118 119] len=18 lock=0" in text


def test_page_size_16_stores_whole_pages_only():
    page = 16
    tree = RadixTree(page_size=page)
    tokens = list(range(40))  # 2 whole pages and a tail of 8
    assert tree.insert(tokens, slots(0, 40)) == 0
    assert tree.total_tokens == 32
    match = tree.match_prefix(tokens)
    assert match.length == 32 and match.indices.tolist() == list(range(32))
    # Diverging inside the second page: only the first page matches.
    other = tokens[:20] + [999] * 20
    assert tree.match_prefix(other).length == 16
    assert tree.insert(other, slots(100, 40)) == 16
    root = tree.match_prefix([]).last_node
    (upper,) = root.children.values()
    assert upper.num_tokens == 16 and len(upper.children) == 2
    # The two children share their first token but not their first page.
    assert sorted(child.tokens()[0] for child in upper.children.values()) == [16, 16]
    # Shorter than a page: nothing to match, nothing to insert.
    assert tree.match_prefix(tokens[:15]).length == 0
    assert tree.insert([5] * 15, slots(200, 15)) == 0
    assert tree.total_tokens == 48
    freed = tree.evict(1)
    assert freed.numel() % page == 0 and freed.numel() > 0
    tree.check_invariants()


def test_page_size_16_checks_the_tail_too():
    tree = RadixTree(page_size=16)
    with pytest.raises(ValueError):
        tree.insert(list(range(16)) + [-1], slots(0, 17))
    with pytest.raises(ValueError, match="one slot per token"):
        tree.insert(list(range(20)), slots(0, 16))
    assert tree.total_tokens == 0


def test_reset_drops_everything_and_kills_handles():
    tree = RadixTree()
    tree.insert([1, 2, 3], slots(0, 3))
    node = tree.match_prefix([1, 2, 3]).last_node
    locked = tree.match_prefix([1, 2]).last_node
    tree.lock(locked)
    tree.reset()
    assert tree.total_tokens == 0 and tree.match_prefix([1, 2, 3]).length == 0
    with pytest.raises(ValueError, match="not in this tree"):
        tree.lock(node)
    with pytest.raises(ValueError, match="not in this tree"):
        tree.unlock(locked)
    assert tree.protected_tokens == tree.evictable_tokens == 0
    tree.check_invariants()


def test_lock_of_an_evicted_node_or_a_foreign_node_raises():
    tree, other = RadixTree(), RadixTree()
    tree.insert([1, 2, 3], slots(0, 3))
    other.insert([1, 2, 3], slots(0, 3))
    node = tree.match_prefix([1, 2, 3]).last_node
    foreign = other.match_prefix([1, 2, 3]).last_node
    before = tree.pretty()
    with pytest.raises(ValueError, match="not in this tree"):
        tree.lock(foreign)
    assert tree.pretty() == before
    tree.evict(10)
    with pytest.raises(ValueError, match="not in this tree"):
        tree.lock(node)
    tree.check_invariants()
    other.check_invariants()


def _populated_tree() -> tuple[RadixTree, TreeNode]:
    """A tree with a locked path [1 2][5] and an unlocked leaf [3 4] (returned)."""
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], slots(0, 4))
    tree.insert([1, 2, 5], slots(4, 3))
    unlocked = tree.match_prefix([1, 2, 3, 4]).last_node
    tree.lock(tree.match_prefix([1, 2, 5]).last_node)
    return tree, unlocked


BAD_CALLS = {
    "negative token": lambda tree, node: tree.match_prefix([1, 2, -3]),
    "negative token past a match": lambda tree, node: tree.match_prefix(array("q", [1, 2, 3, 4, -1])),
    "negative token in tensor": lambda tree, node: tree.insert(torch.tensor([1, 2, 3, -4]), slots(9, 4)),
    "negative token in array": lambda tree, node: tree.insert(array("q", [1, 2, 9, -4]), slots(9, 4)),
    "token too big": lambda tree, node: tree.insert([1, 2, 2**63], slots(9, 3)),
    "float token": lambda tree, node: tree.match_prefix([1, 2.0]),
    "float tensor": lambda tree, node: tree.match_prefix(torch.tensor([1.0, 2.0])),
    "bool tensor": lambda tree, node: tree.match_prefix(torch.tensor([True])),
    "2-D tensor": lambda tree, node: tree.insert(torch.ones(2, 2, dtype=torch.int64), slots(9, 4)),
    "nested list": lambda tree, node: tree.match_prefix([[1, 2]]),
    "string": lambda tree, node: tree.match_prefix("12"),
    "float array": lambda tree, node: tree.match_prefix(array("d", [1.0])),
    "none tokens": lambda tree, node: tree.insert(None, slots(0, 0)),
    "indices too short": lambda tree, node: tree.insert([1, 2, 9, 9], slots(9, 3)),
    "indices too long": lambda tree, node: tree.insert([1, 2, 9], slots(9, 4)),
    "indices int32": lambda tree, node: tree.insert([1, 2, 9], slots(9, 3).int()),
    "indices 2-D": lambda tree, node: tree.insert([1, 2], slots(9, 2)[None]),
    "indices a list": lambda tree, node: tree.insert([1, 2, 9], [9, 10, 11]),
    "unhashable namespace": lambda tree, node: tree.match_prefix([1, 2], namespace=["a"]),
    "unhashable namespace insert": lambda tree, node: tree.insert([8], slots(9, 1), namespace={}),
    "negative evict": lambda tree, node: tree.evict(-1),
    "float evict": lambda tree, node: tree.evict(1.5),
    "bool evict": lambda tree, node: tree.evict(True),
    "unlock unlocked": lambda tree, node: tree.unlock(node),
    "lock a non-node": lambda tree, node: tree.lock("node"),
    "unlock a non-node": lambda tree, node: tree.unlock(None),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_input_raises_value_error_and_leaves_tree_unchanged(case):
    tree, node = _populated_tree()
    before = tree.pretty()
    with pytest.raises(ValueError):
        BAD_CALLS[case](tree, node)
    tree.check_invariants()
    assert tree.pretty() == before
    assert (tree.total_tokens, tree.protected_tokens) == (5, 3)


def test_bad_page_size():
    for page_size in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            RadixTree(page_size=page_size)


def test_long_queries_read_in_place_behave_like_short_ones():
    """Sequences of 8192+ tokens are walked through a byte view, not a copy.

    Replays the same random operations with tensors (always copied) and with
    arrays (viewed when long) and requires the same results and structure.
    """
    rng = random.Random(5)
    base = [rng.randrange(1000) for _ in range(20_000)]
    copied, viewed = RadixTree(), RadixTree()
    next_slot = 0
    for _ in range(60):
        cut = rng.randrange(1, len(base))
        tokens = base[:cut] + [rng.randrange(3) for _ in range(rng.randrange(0, 9000))]
        if rng.random() < 0.5:
            results = [
                tree.match_prefix(as_type(tokens))
                for tree, as_type in ((copied, torch.tensor), (viewed, lambda t: array("q", t)))
            ]
            assert results[0].length == results[1].length
            assert torch.equal(results[0].indices, results[1].indices)
        else:
            indices = slots(next_slot, len(tokens))
            next_slot += len(tokens)
            assert copied.insert(torch.tensor(tokens), indices) == viewed.insert(
                array("q", tokens), indices
            )
        if rng.random() < 0.2:
            assert torch.equal(copied.evict(5000), viewed.evict(5000))
        assert copied.pretty() == viewed.pretty()
    viewed.check_invariants()
    before = viewed.pretty()
    with pytest.raises(ValueError):
        viewed.insert(array("q", base + [-1]), slots(0, len(base) + 1))
    with pytest.raises(ValueError):
        viewed.match_prefix(base[:100] + [-1] * 9000)
    assert viewed.pretty() == before


def test_a_kept_exception_does_not_pin_a_long_array():
    """Long arrays are read through a view; the view must not outlive the call."""
    tree = RadixTree()
    tokens = array("q", range(10_000))
    tree.insert(tokens, slots(0, 10_000))
    bad = array("q", list(range(10_000)) + [-1])
    kept = []
    for call in (
        lambda: tree.match_prefix(bad),
        lambda: tree.insert(bad, slots(0, 10_001)),
        lambda: tree.insert(bad, slots(0, 3)),
    ):
        with pytest.raises(ValueError) as caught:
            call()
        kept.append(caught.value)
        bad.append(1)  # would raise BufferError while a view is alive
    tokens.append(1)
