"""The cache explains itself: where a prompt leaves the tree, and the tree's picture.

Tree level: `RadixTree.explain` against a reference (the stored sequences as
plain lists), by hypothesis, and proof that explaining changes nothing (the
eviction order of a twin tree that was never asked stays identical).
Snapshot: bounded, every token accounted for by a kept node or a fold.
Runtime level: the report's position and texts on a tiny model, namespaces,
bad input, and an SVG that parses and shows the branch point.
"""

from __future__ import annotations

import random
import xml.etree.ElementTree as ET

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt import Runtime
from radixrt.tree import RadixTree, render_svg

SVG = "{http://www.w3.org/2000/svg}"

sequences = st.lists(st.integers(0, 3), min_size=0, max_size=14)


def common_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def build(stored: list[list[int]], page_size: int) -> tuple[RadixTree, list[list[int]]]:
    """A tree holding `stored` and the whole-page parts it really keeps."""
    tree = RadixTree(page_size)
    kept = []
    next_slot = 0
    for tokens in stored:
        tree.insert(tokens, torch.arange(next_slot, next_slot + len(tokens)))
        next_slot += len(tokens)
        kept.append(tokens[: len(tokens) // page_size * page_size])
    return tree, kept


@settings(max_examples=200, deadline=None)
@given(stored=st.lists(sequences, max_size=8), query=sequences, page_size=st.sampled_from([1, 2, 4]))
def test_explain_matches_a_reference_of_stored_sequences(stored, query, page_size):
    tree, kept = build(stored, page_size)
    divergence = tree.explain(query, branch_tokens=64)
    expected = max((common_prefix(query, seq) for seq in kept), default=0)
    assert divergence.matched_tokens == expected
    assert divergence.whole_page_tokens == expected // page_size * page_size
    # The closest branch is real: the matched part followed by it is a stored prefix ...
    continued = query[:expected] + divergence.branch
    assert any(seq[: len(continued)] == continued for seq in kept) or not continued
    # ... and it is empty only when nothing stored runs past the matched part.
    if not divergence.branch:
        assert not any(len(seq) > expected and seq[:expected] == query[:expected] for seq in kept)
    tree.check_invariants()


@settings(max_examples=100, deadline=None)
@given(
    stored=st.lists(sequences, min_size=1, max_size=8),
    queries=st.lists(sequences, max_size=6),
    page_size=st.sampled_from([1, 2]),
)
def test_explain_changes_nothing_not_even_the_eviction_order(stored, queries, page_size):
    asked, _ = build(stored, page_size)
    never_asked, _ = build(stored, page_size)
    before = asked.pretty()
    for query in queries:
        asked.explain(query)
    assert asked.pretty() == before
    order = [asked.evict(1).tolist() for _ in range(asked.total_tokens + 1)]
    assert order == [never_asked.evict(1).tolist() for _ in range(never_asked.total_tokens + 1)]


def random_tree(num_sequences: int, seed: int) -> RadixTree:
    rng = random.Random(seed)
    tree = RadixTree()
    slot = 0
    for _ in range(num_sequences):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        tree.insert(tokens, torch.arange(slot, slot + len(tokens)))
        slot += len(tokens)
    return tree


@pytest.mark.parametrize("max_nodes", [1, 2, 5, 40, 10_000])
def test_snapshot_is_bounded_and_accounts_for_every_token(max_nodes):
    tree = random_tree(200, seed=max_nodes)
    tree.lock(tree.match_prefix([0, 1]).last_node)
    snapshot = tree.snapshot(max_nodes)
    live = [v for v in snapshot.nodes if v.state in ("namespace", "locked", "evictable")]
    folds = [v for v in snapshot.nodes if v.state == "folded"]
    assert len(live) <= max_nodes
    assert sum(v.num_tokens for v in live) + sum(v.num_tokens for v in folds) == tree.total_tokens
    assert sum(v.num_nodes for v in live if v.state != "namespace") + sum(v.num_nodes for v in folds) == (
        snapshot.total_nodes
    )
    assert snapshot.protected_tokens == tree.protected_tokens
    seen = set()
    for view in snapshot.nodes:  # each parent before its children
        assert view.parent_id is None or view.parent_id in seen
        seen.add(view.node_id)
    # Kept nodes are the heaviest: every node left out weighs at most what any kept node weighs.
    kept_ids = {v.node_id for v in live}
    weight = _subtree_tokens(tree)
    lightest_kept = min((weight[i] for i in kept_ids if weight[i]), default=0)
    left_out = [n for n in _nodes(tree) if n.parent is not None and n.node_id not in kept_ids and n.parent.node_id in kept_ids]
    assert all(weight[n.node_id] <= lightest_kept for n in left_out)


def _subtree_tokens(tree: RadixTree) -> dict[int, int]:
    order = list(_nodes(tree))
    weight: dict[int, int] = {}
    for node in reversed(order):  # _nodes lists parents before children
        weight[node.node_id] = node.num_tokens + sum(weight[c.node_id] for c in node.children.values())
    return weight


def test_snapshot_of_one_namespace_and_ghosts_of_evicted_edges():
    tree = RadixTree()
    tree.insert([1, 2, 3], torch.arange(3))
    tree.insert([1, 2, 9, 9], torch.arange(3, 7))
    tree.insert([5, 5], torch.arange(7, 9), namespace="tenant")
    assert [v.state for v in tree.snapshot(10, namespace="tenant").nodes] == ["namespace", "evictable"]
    assert tree.snapshot(10, namespace="nobody").nodes == []
    tree.evict(1)  # the least recently used leaf: [3] under [1, 2]
    views = tree.snapshot(10).nodes
    ghost = next(v for v in views if v.state == "evicted")
    assert ghost.head == (3,) and ghost.num_tokens == 1
    parent = next(v for v in views if v.node_id == ghost.parent_id)
    assert parent.head == (1, 2)
    with pytest.raises(ValueError, match="max_nodes"):
        tree.snapshot(0)


def test_ten_thousand_nodes_render_into_a_bounded_picture():
    rng = random.Random(1)
    tree = RadixTree()
    slot = 0
    for _ in range(10_000):
        tokens = [rng.randrange(40) for _ in range(rng.randrange(2, 9))]
        tree.insert(tokens, torch.arange(slot, slot + len(tokens)))
        slot += len(tokens)
    snapshot = tree.snapshot(150)
    assert snapshot.total_nodes >= 10_000
    root = ET.fromstring(render_svg(snapshot, lambda ids: " ".join(map(str, ids)), str))
    boxes = root.findall(f"{SVG}g")
    assert 0 < len(boxes) <= 2 * 150 + 16  # kept nodes, at most one fold each, and ghosts


def _nodes(tree: RadixTree):
    stack = list(tree._roots.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        yield node


# --- the Runtime's report -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime(tiny_llama_dir):
    with Runtime(tiny_llama_dir, device="cpu", dtype="float32", max_total_tokens=2048, check_invariants=True) as rt:
        yield rt


def greedy(tokens: int = 2) -> dict:
    return {"max_new_tokens": tokens, "temperature": 0}


def test_a_prompt_that_differs_at_a_known_token(runtime):
    runtime.flush_cache()
    cached = list(range(10, 70))
    runtime.generate(input_ids=cached, sampling_params=greedy())
    changed = cached[:37] + [5, 6, 7] + cached[40:]
    report = runtime.explain_cache(input_ids=changed)
    decode = runtime.tokenizer.decode
    assert report["prompt_tokens"] == 60
    assert report["diverged_at"] == 37
    assert report["cached_tokens"] == 37
    assert report["context_text"] == decode(cached[5:37])
    assert report["prompt_text"] == decode(changed[37:69])
    # The closest branch is the cached prompt, followed by what generation appended to it.
    assert report["cached_text"].startswith(decode(cached[37:60]))


def test_fully_cached_never_seen_and_chat_messages(runtime):
    runtime.flush_cache()
    messages = [{"role": "system", "content": "You answer tersely."}, {"role": "user", "content": "hello there"}]
    runtime.generate(messages, greedy())
    full = runtime.explain_cache(messages=messages)
    assert full["diverged_at"] is None
    assert full["cached_tokens"] == full["prompt_tokens"] - 1  # the last token is always computed
    assert full["prompt_text"] == ""
    other = runtime.explain_cache("zebra quantum")
    assert other["diverged_at"] == 0 and other["cached_tokens"] == 0 and other["context_text"] == ""
    edited = runtime.explain_cache(messages=[messages[0], {"role": "user", "content": "goodbye there"}])
    assert 0 < edited["diverged_at"] < edited["prompt_tokens"]
    assert "hello" in edited["cached_text"] and "goodbye" in edited["prompt_text"]


def test_explain_leaves_stats_and_lru_order_alone(runtime):
    runtime.flush_cache()
    runtime.generate(input_ids=[[3, 4, 5, 6, 7, 8], [3, 4, 5, 9, 9, 9]], sampling_params=greedy())
    tree = runtime.engine.cache.tree
    stats, picture = runtime.cache_stats(), tree.pretty()
    for ids in ([3, 4, 5, 6], [3, 4, 1], [8, 8], [3, 4, 5, 9, 9, 9, 1, 1]):
        runtime.explain_cache(input_ids=ids)
    assert runtime.cache_stats() == stats
    assert tree.pretty() == picture


def test_cache_salt_namespaces_are_respected(runtime):
    runtime.flush_cache()
    ids = list(range(100, 140))
    runtime.generate(input_ids=ids, sampling_params=greedy(), cache_salt="alice")
    assert runtime.explain_cache(input_ids=ids, cache_salt="alice")["diverged_at"] is None
    assert runtime.explain_cache(input_ids=ids, cache_salt="bob")["cached_tokens"] == 0
    assert runtime.explain_cache(input_ids=ids)["cached_tokens"] == 0
    alice_only = runtime.cache_tree_svg(cache_salt="alice")
    assert "cache_salt &#x27;alice&#x27;" in alice_only or "cache_salt 'alice'" in alice_only
    assert ET.fromstring(runtime.cache_tree_svg(cache_salt="bob")).findall(f"{SVG}g") == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"input_ids": []}, "prompt"),
        ({"input_ids": [1] * 1100}, "context length"),
        ({"input_ids": [1, 2], "cache_salt": 7}, "cache_salt"),
        ({"prompt": ["a", "b"]}, "one prompt"),
        ({"input_ids": [1, -4]}, "input_ids"),
    ],
)
def test_bad_input_gets_the_errors_generate_gives(runtime, kwargs, message):
    with pytest.raises(ValueError, match=message):
        runtime.explain_cache(**kwargs)


def test_tree_svg_shows_the_branch_point(runtime):
    runtime.flush_cache()
    runtime.generate(["The table lists apples and pears", "The table lists bicycles and cars"], greedy(1))
    svg = runtime.cache_tree_svg()
    root = ET.fromstring(svg)
    texts = " ".join(t.text or "" for t in root.iter(f"{SVG}text"))
    assert "apples" in texts and "bicycles" in texts
    assert "The table lists" in texts
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="max_nodes"):
            runtime.cache_tree_svg(max_nodes=bad)


def test_a_generation_is_one_edge_not_one_node_per_token(runtime):
    """Decode steps do not insert their token: the output enters the tree once, at the end."""
    runtime.flush_cache()
    runtime.generate(input_ids=list(range(200, 230)), sampling_params={**greedy(12), "ignore_eos": True})
    edges = [v.num_tokens for v in runtime.engine.cache.snapshot(100).nodes if v.state == "evictable"]
    assert edges == [30, 11]  # the prompt (inserted when computed), then the output but its last token


def test_any_decoded_text_makes_well_formed_svg():
    """Tokens can decode to control characters or lone surrogates, which XML cannot hold even escaped."""
    tree = RadixTree()
    tree.insert([1, 2, 3], torch.arange(3))
    tree.insert([1, 5], torch.arange(3, 5))
    nasty = "\x00\x07<&>\"'\ud800\ufffe\U0001f600 tab\there"
    root = ET.fromstring(render_svg(tree.snapshot(10), lambda ids: nasty, lambda ns: nasty))
    assert any("\\x07" in (t.text or "") for t in root.iter(f"{SVG}text"))
