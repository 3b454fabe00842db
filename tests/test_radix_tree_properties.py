"""Stateful property tests: RadixTree against an obviously correct reference trie.

The reference stores one dict-of-children node per page (per token when
page_size is 1), with the time it was last used, its lock count and a flag
saying "a tree node ends here". That flag is what lets it predict the
compressed tree exactly: a node ends where an insert or a match ended, where
two continuations part, or at a leaf, and never stops ending there (the tree
splits nodes but never merges them). Eviction is then defined on the
reference the same way as on the tree: the unlocked leaf node (maximal chain
of pages ending at a leaf) used longest ago goes first.

Every step compares results (lengths, slots, freed slots in order, errors)
and the whole structure, then runs check_invariants and checks that every
slot is either free in the PagePool or held by the tree, never both.
"""

from __future__ import annotations

from array import array

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from radixrt.memory.page_pool import PagePool
from radixrt.tree import RadixTree, TreeNode

NAMESPACES = st.sampled_from([None, "tenant"])
TOKEN_TYPES = st.sampled_from([list, lambda tokens: array("q", tokens), torch.tensor])


class RefPage:
    __slots__ = (
        "parent", "children", "page", "slots", "last_used", "locks", "own_locks", "node_end", "alive"
    )

    def __init__(self, parent: RefPage | None, page: tuple, slots: list[int], last_used: int):
        self.parent = parent
        self.children: dict[tuple, RefPage] = {}
        self.page = page
        self.slots = slots
        self.last_used = last_used
        self.locks = 0  # locks taken on this page or below it
        self.own_locks = 0  # locks taken on a handle ending at this page
        self.node_end = False
        self.alive = True


class ReferenceTree:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.roots: dict[object, RefPage] = {}
        self.clock = 0

    def root(self, namespace: object) -> RefPage:
        if namespace not in self.roots:
            self.roots[namespace] = RefPage(None, (), [], 0)
        return self.roots[namespace]

    def pages(self, tokens: list[int]) -> list[tuple]:
        size = self.page_size
        return [tuple(tokens[i : i + size]) for i in range(0, len(tokens) - size + 1, size)]

    def match(self, namespace: object, tokens: list[int]) -> tuple[int, list[int], RefPage]:
        self.clock += 1
        node, slots = self.root(namespace), []
        for page in self.pages(tokens):
            if page not in node.children:
                break
            node = node.children[page]
            node.last_used = self.clock
            slots += node.slots
        if node.parent is not None:
            node.node_end = True
        return len(slots), slots, node

    def insert(self, namespace: object, tokens: list[int], slots: list[int]) -> int:
        self.clock += 1
        node, cached = self.root(namespace), None
        for number, page in enumerate(self.pages(tokens)):
            child = node.children.get(page)
            if child is None:
                if cached is None:
                    cached = number * self.page_size
                if node.children and node.parent is not None:
                    node.node_end = True  # two continuations part here
                start = number * self.page_size
                child = RefPage(node, page, slots[start : start + self.page_size], self.clock)
                node.children[page] = child
            child.last_used = self.clock
            node = child
        if node.parent is not None:
            node.node_end = True
        return len(self.pages(tokens)) * self.page_size if cached is None else cached

    def all_pages(self):
        for namespace, root in self.roots.items():
            stack = [(root, ())]
            while stack:
                node, path = stack.pop()
                for page, child in node.children.items():
                    yield namespace, path + page, child
                    stack.append((child, path + page))

    def evict(self, num_tokens: int) -> list[int]:
        freed: list[int] = []
        while len(freed) < num_tokens:
            leaves = [p for _, _, p in self.all_pages() if not p.children and not p.locks]
            if not leaves:
                break
            oldest = min(leaf.last_used for leaf in leaves)
            (leaf,) = [leaf for leaf in leaves if leaf.last_used == oldest]  # never a tie
            chain = [leaf]
            while chain[-1].parent.parent is not None and not chain[-1].parent.node_end:
                chain.append(chain[-1].parent)
            del chain[-1].parent.children[chain[-1].page]
            for page in reversed(chain):
                page.alive = False
                freed += page.slots
        return freed

    def path_to_root(self, node: RefPage) -> list[RefPage]:
        path = [node]
        while path[-1].parent is not None:
            path.append(path[-1].parent)
        return path

    def structure(self) -> dict:
        """(namespace, tokens from the root to a node's end) -> (node's slots, locks)."""
        nodes = {}
        for namespace, path, page in self.all_pages():
            if page.node_end or not page.children:
                slots, top = [], page
                while True:
                    slots = top.slots + slots
                    if top.parent.parent is None or top.parent.node_end:
                        break
                    top = top.parent
                nodes[(namespace, path)] = (slots, page.locks)
        return nodes

    def tokens(self, locked: bool) -> int:
        return sum(
            self.page_size for _, _, page in self.all_pages() if bool(page.locks) == locked
        )


def tree_structure(tree: RadixTree) -> dict:
    nodes = {}
    for namespace, root in tree._roots.items():
        stack = [(root, ())]
        while stack:
            node, path = stack.pop()
            for child in node.children.values():
                child_path = path + tuple(child.tokens())
                slots = memoryview(child.slots).cast("q").tolist()
                nodes[(namespace, child_path)] = (slots, child.lock_ref)
                stack.append((child, child_path))
    return nodes


class TreeMachine(RuleBasedStateMachine):
    """Random interleavings of insert / match / lock / unlock / evict / reset."""

    page_size = 1
    vocabulary = 3
    max_length = 10
    handles = Bundle("handles")

    def __init__(self):
        super().__init__()
        self.tree = RadixTree(self.page_size)
        self.reference = ReferenceTree(self.page_size)
        self.pool = PagePool(num_pages=48 // self.page_size, page_size=self.page_size)

    def tokens(self):
        return st.lists(st.integers(0, self.vocabulary - 1), max_size=self.max_length)

    def as_given(self, data, tokens: list[int]):
        """`tokens` as one of the types the tree accepts (they must all behave alike)."""
        convert = data.draw(TOKEN_TYPES)
        return convert(tokens) if tokens or convert is not torch.tensor else torch.empty(0, dtype=torch.int64)

    def _evict(self, num_tokens: int) -> None:
        freed = self.tree.evict(num_tokens)
        assert freed.tolist() == self.reference.evict(num_tokens)
        self.pool.free(freed)

    def _slots_for(self, num_tokens: int) -> torch.Tensor | None:
        shortfall = self.pool.pages_for(num_tokens) - self.pool.available_pages
        if shortfall > 0:
            self._evict(shortfall * self.page_size)
        if self.pool.pages_for(num_tokens) > self.pool.available_pages:
            return None
        return self.pool.alloc(num_tokens)

    def _insert(self, namespace, tokens, given, prefix: torch.Tensor, new: torch.Tensor) -> None:
        indices = torch.cat((prefix, new))[: len(tokens)]
        cached = self.tree.insert(given, indices, namespace)
        assert cached == self.reference.insert(namespace, tokens, indices.tolist())
        whole = len(tokens) - len(tokens) % self.page_size
        self.pool.free(new[: max(0, cached - len(prefix))])  # the tree had these
        self.pool.free(new[whole - len(prefix) :])  # not a whole page

    @rule(namespace=NAMESPACES, data=st.data())
    def insert(self, namespace, data):
        tokens = data.draw(self.tokens())
        new = self._slots_for(len(tokens))
        if new is not None:
            self._insert(namespace, tokens, self.as_given(data, tokens), new[:0], new)

    @rule(namespace=NAMESPACES, data=st.data())
    def request(self, namespace, data):
        """What the engine does: match, lock, allocate the rest, insert, unlock."""
        tokens = data.draw(self.tokens())
        given = self.as_given(data, tokens)
        match = self.tree.match_prefix(given, namespace)
        length, _, ref_node = self.reference.match(namespace, tokens)
        assert match.length == length
        self.tree.lock(match.last_node)
        self._lock_reference(ref_node, +1)
        new = self._slots_for(len(tokens) - match.length)
        if new is not None:
            self._insert(namespace, tokens, given, match.indices, new)
        self.tree.unlock(match.last_node)
        self._lock_reference(ref_node, -1)

    @rule(target=handles, namespace=NAMESPACES, data=st.data())
    def match(self, namespace, data):
        tokens = data.draw(self.tokens())
        match = self.tree.match_prefix(self.as_given(data, tokens), namespace)
        length, slots, ref_node = self.reference.match(namespace, tokens)
        assert match.length == length and match.length % self.page_size == 0
        assert match.indices.tolist() == slots
        expected_root = ref_node.parent is None
        assert (match.last_node.parent is None) == expected_root
        return match.last_node, ref_node

    @rule(namespace=NAMESPACES, data=st.data(), insert=st.booleans())
    def bad_tokens(self, namespace, data, insert):
        """A negative token anywhere: ValueError, and the invariant sees no change."""
        tokens = data.draw(self.tokens()) + [-1] + data.draw(self.tokens())
        given = self.as_given(data, tokens)
        with pytest.raises(ValueError):
            if insert:
                self.tree.insert(given, torch.arange(len(tokens)), namespace)
            else:
                self.tree.match_prefix(given, namespace)

    @rule(handle=handles)
    def lock(self, handle: tuple[TreeNode, RefPage]):
        node, ref_node = handle
        if not ref_node.alive:
            with pytest.raises(ValueError):
                self.tree.lock(node)
            return
        self.tree.lock(node)
        self._lock_reference(ref_node, +1)

    @rule(handle=handles)
    def unlock(self, handle: tuple[TreeNode, RefPage]):
        node, ref_node = handle
        if not ref_node.alive or not ref_node.own_locks:
            with pytest.raises(ValueError):
                self.tree.unlock(node)
            return
        self.tree.unlock(node)
        self._lock_reference(ref_node, -1)

    @rule(num_tokens=st.integers(0, 24))
    def evict(self, num_tokens):
        self._evict(num_tokens)

    @rule(chance=st.integers(0, 3))
    def flush(self, chance):
        if chance == 0:
            self._evict(10**18)
            assert self.tree.evictable_tokens == 0

    @rule(chance=st.integers(0, 7))
    def reset(self, chance):
        if chance == 0 and self.tree.protected_tokens == 0:
            self._evict(10**18)
            self.tree.reset()
            for _, _, page in self.reference.all_pages():
                page.alive = False
            for root in self.reference.roots.values():
                root.alive = False  # a handle to a root dies with it
            self.reference.roots = {}

    def _lock_reference(self, ref_node: RefPage, delta: int) -> None:
        ref_node.own_locks += delta
        for page in self.reference.path_to_root(ref_node):
            page.locks += delta

    @invariant()
    def agrees_with_reference(self):
        self.tree.check_invariants()
        self.pool.check_invariants()
        assert tree_structure(self.tree) == self.reference.structure()
        assert self.tree.protected_tokens == self.reference.tokens(locked=True)
        assert self.tree.evictable_tokens == self.reference.tokens(locked=False)
        assert self.pool.available + self.tree.total_tokens == self.pool.num_slots


class PagedTreeMachine(TreeMachine):
    page_size = 2
    vocabulary = 2
    max_length = 13


SETTINGS = {
    "deadline": None,
    "derandomize": True,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much],
}

TestRadixTreeAgainstReference = TreeMachine.TestCase
TestRadixTreeAgainstReference.settings = settings(
    max_examples=200, stateful_step_count=60, **SETTINGS
)
TestPagedRadixTreeAgainstReference = PagedTreeMachine.TestCase
TestPagedRadixTreeAgainstReference.settings = settings(
    max_examples=150, stateful_step_count=60, **SETTINGS
)
