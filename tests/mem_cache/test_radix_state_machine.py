"""Hypothesis state machine: RadixCache (with an allocator) against a plain model.

The model is a dict from every cached page-aligned prefix `(namespace, tokens)` to the slots of
its last page and its last use. After every step the tree must hold exactly the model's
prefixes with the model's slots, pass `check_integrity()`, conserve slots
(`available + total_size == size`), and its replayed KV events must equal the blocks the model
holds. Eviction is checked for LRU order, locked paths and the amount freed.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from mem_cache.allocator import KVAllocator, pages_to_slots
from mem_cache.events import AllCleared, BlockRemoved, BlockStored, block_hashes
from mem_cache.radix_cache import RadixCache

Prefix = tuple  # (namespace, tokens tuple)


def tree_contents(cache: RadixCache) -> dict[Prefix, tuple[int, ...]]:
    """Every cached page-aligned prefix of the tree -> the slots of its last page."""
    page, out = cache.page_size, {}
    stack = [(child, ()) for child in cache.root.children.values()]
    while stack:
        node, above = stack.pop()
        tokens, slots = node.tokens().tolist(), pages_to_slots(node.value, page).tolist()
        for i in range(0, len(tokens), page):
            out[(node.namespace, above + tuple(tokens[: i + page]))] = tuple(slots[i : i + page])
        stack.extend((child, above + tuple(tokens)) for child in node.children.values())
    return out


class RadixMachine(RuleBasedStateMachine):
    page = 1
    block = 4
    pages = 24
    max_pages = 40  # per drawn sequence
    steps = 0  # rules run, summed over every example of this class

    def __init__(self) -> None:
        super().__init__()
        self.alloc = KVAllocator(self.pages * self.page, self.page)
        self.cache = RadixCache(self.alloc, self.page, self.block)
        self.model: dict[Prefix, tuple[tuple[int, ...], int]] = {}  # prefix -> (slots, last use)
        self.tick = 0
        self.handles: list[tuple[object, Prefix]] = []  # locks held, with the prefix they end at
        self.released: list[object] = []  # nodes whose lock was released (for bad unlocks)
        self.blocks: set[int] = set()  # block hashes stored according to the events

    # --- helpers ------------------------------------------------------------------------------

    def seq(self, draw: list[int]) -> list[int]:
        return draw[: len(draw) // self.page * self.page]

    def cached_len(self, ns: str | None, tokens: list[int]) -> int:
        n = 0
        while n + self.page <= len(tokens) and (ns, tuple(tokens[: n + self.page])) in self.model:
            n += self.page
        return n

    def touch(self, ns: str | None, tokens: list[int], length: int) -> None:
        self.tick += 1
        for n in range(self.page, length + 1, self.page):
            key = (ns, tuple(tokens[:n]))
            self.model[key] = (self.model[key][0], self.tick)

    def locked(self) -> set[Prefix]:
        out = set()
        for _, (ns, tokens) in self.handles:
            out.update((ns, tokens[:n]) for n in range(self.page, len(tokens) + 1, self.page))
        return out

    def expected_blocks(self) -> set[int]:
        leaves = [k for k in self.model if not any(
            o[0] == k[0] and len(o[1]) > len(k[1]) and o[1][: len(k[1])] == k[1]
            for o in self.model)]
        return {h for ns, tokens in leaves for h in block_hashes(list(tokens), ns, self.block)}

    # --- rules --------------------------------------------------------------------------------

    namespaces = st.sampled_from([None, None, "lora"])

    @classmethod
    def sequences(cls) -> st.SearchStrategy[list[int]]:
        """Token lists made of a few distinct whole pages (so paths share and split at page
        boundaries whatever the page size) plus a partial page of tail."""
        chunks = [[c] * cls.page for c in range(3)]
        if cls.page > 1:
            chunks.append([0, 1] * (cls.page // 2))
        pages = st.lists(st.sampled_from(chunks), max_size=cls.max_pages)
        tail = st.lists(st.integers(0, 2), max_size=cls.page - 1)
        return st.tuples(pages, tail).map(lambda t: [x for c in t[0] for x in c] + t[1])

    @rule(data=st.data(), ns=namespaces)
    def insert(self, data: st.DataObject, ns: str | None) -> None:
        tokens = self.seq(data.draw(self.sequences()))
        need = len(tokens)
        if self.alloc.available_size() < need:
            self.evict(need - self.alloc.available_size())
        slots = self.alloc.alloc(need)
        if slots is None:
            return
        expected = self.cached_len(ns, tokens)
        assert self.cache.insert(tokens, slots, namespace=ns) == expected
        self.alloc.free(slots[:expected])
        for n in range(expected + self.page, need + 1, self.page):
            page_slots = tuple(slots[n - self.page : n].tolist())
            self.model[(ns, tuple(tokens[:n]))] = (page_slots, 0)
        self.touch(ns, tokens, need)

    @rule(data=st.data(), ns=namespaces, lock=st.booleans())
    def match(self, data: st.DataObject, ns: str | None, lock: bool) -> None:
        tokens = data.draw(self.sequences())  # unaligned on purpose: the match aligns down
        result = self.cache.match_prefix(tokens, namespace=ns)
        expected = self.cached_len(ns, tokens)
        assert result.length == expected
        want = [s for n in range(self.page, expected + 1, self.page)
                for s in self.model[(ns, tuple(tokens[:n]))][0]]
        assert result.indices.tolist() == want
        self.touch(ns, tokens, expected)
        if lock and expected:
            self.cache.lock(result.node)
            self.handles.append((result.node, (ns, tuple(tokens[:expected]))))

    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        if not self.handles:
            return
        node, _ = self.handles.pop(data.draw(st.integers(0, len(self.handles) - 1)))
        self.cache.unlock(node)
        self.released.append(node)

    @rule(data=st.data())
    def unlock_unlocked(self, data: st.DataObject) -> None:
        if not self.released:
            return
        node = data.draw(st.sampled_from(self.released))
        if any(h is node for h, _ in self.handles):
            return
        before = (node.lock_ref, self.cache.protected_size(), self.cache.evictable_size())
        with pytest.raises(ValueError):
            self.cache.unlock(node)
        assert before == (node.lock_ref, self.cache.protected_size(), self.cache.evictable_size())

    @rule(num=st.integers(-2, 60))
    def evict(self, num: int) -> None:
        evictable = self.cache.evictable_size()
        freed = self.cache.evict(num)
        after = tree_contents(self.cache)
        gone = set(self.model) - set(after)
        assert set(after) <= set(self.model)
        assert freed == len(gone) * self.page
        assert freed >= min(max(num, 0), evictable)
        assert not gone & self.locked(), "a locked prefix was evicted"
        if gone:
            latest_gone = max(self.model[k][1] for k in gone)
            for key in after:
                is_leaf = not any(o[0] == key[0] and len(o[1]) > len(key[1])
                                  and o[1][: len(key[1])] == key[1] for o in after)
                if is_leaf and key not in self.locked():
                    assert self.model[key][1] >= latest_gone, "evicted a newer leaf first"
        for key in gone:
            del self.model[key]

    @rule()
    def reset(self) -> None:
        if self.handles:
            with pytest.raises(ValueError):
                self.cache.reset()
            return
        self.cache.reset()
        self.model.clear()

    # --- after every step -------------------------------------------------------------------

    @invariant()
    def matches_model(self) -> None:
        type(self).steps += 1
        self.cache.check_integrity()
        assert self.alloc.available_size() + self.cache.total_size() == self.alloc.size
        assert self.cache.total_size() == len(self.model) * self.page
        contents = tree_contents(self.cache)
        assert contents == {k: v[0] for k, v in self.model.items()}
        for event in self.cache.take_events():
            if isinstance(event, BlockStored):
                assert not self.blocks & set(event.hashes), "a block was stored twice"
                self.blocks.update(event.hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.hashes) <= self.blocks, "a block was removed twice"
                self.blocks.difference_update(event.hashes)
            else:
                assert isinstance(event, AllCleared)
                self.blocks.clear()
        expected = self.expected_blocks()
        assert self.blocks == expected
        snapshot = self.cache.snapshot_events()
        assert isinstance(snapshot[0], AllCleared)
        assert {h for e in snapshot[1:] for h in e.hashes} == expected


class PageOneMachine(RadixMachine):
    page, block, pages, max_pages = 1, 4, 24, 40


class PageSixteenMachine(RadixMachine):
    page, block, pages, max_pages = 16, 32, 12, 6


class PageSmallerThanBlockMachine(RadixMachine):
    """Pages of 4 with blocks of 2: siblings can share a block (reported once)."""

    page, block, pages, max_pages = 4, 2, 16, 8


def run(machine: type[RadixMachine], examples: int, steps: int) -> int:
    machine.steps = 0
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        ),
    )
    return machine.steps


def test_page_one_against_model() -> None:
    assert run(PageOneMachine, examples=110, steps=50) >= 4500


def test_page_sixteen_against_model() -> None:
    assert run(PageSixteenMachine, examples=110, steps=50) >= 4500


def test_page_smaller_than_block_against_model() -> None:
    assert run(PageSmallerThanBlockMachine, examples=40, steps=50) >= 1500


def test_model_helpers_see_the_tree() -> None:
    """The model's view of the tree is itself right (else the machine proves nothing)."""
    alloc = KVAllocator(16, 1)
    cache = RadixCache(alloc, 1, 2)
    cache.insert([1, 2, 3], alloc.alloc(3))
    assert tree_contents(cache) == {
        (None, (1,)): (0,),
        (None, (1, 2)): (1,),
        (None, (1, 2, 3)): (2,),
    }
    assert sorted(alloc.free_slot_ids().tolist()) == list(range(3, 16))
