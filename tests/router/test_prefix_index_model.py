"""The prefix index against a brute-force model under random route/event/evict/remove sequences.

The model keeps one record per (worker, tier, hash) with a unique last-use tick and answers
every question by scanning; the index must agree after every step.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mem_cache.events import DEVICE, HOST, AllCleared, BlockRemoved, BlockStored
from router.routing.prefix_index import IndexConfig, PrefixIndex

WORKERS = ["w0", "w1", "w2", "w3"]
TTL = 5.0
MAX_BLOCKS = 12

worker_ids = st.sampled_from(WORKERS)
tiers = st.sampled_from([DEVICE, HOST])
chains = st.lists(st.integers(0, 9), max_size=7)


class Model:
    """Brute force: (worker, tier, hash) -> tick; (worker, hash) -> deadline when unconfirmed."""

    def __init__(self) -> None:
        self.workers: list[str] = []
        self.entries: dict[tuple[str, str, int], int] = {}
        self.pending: dict[tuple[str, int], float] = {}
        self.tick = 0

    def touch(self, w: str, tier: str, h: int) -> None:
        self.tick += 1
        self.entries[(w, tier, h)] = self.tick

    def drop(self, w: str, tier: str, h: int) -> None:
        self.entries.pop((w, tier, h), None)
        if tier == DEVICE:
            self.pending.pop((w, h), None)

    def clear(self, w: str) -> None:
        for key in [k for k in self.entries if k[0] == w]:
            self.drop(*key)

    def bound(self) -> None:
        while len(self.entries) > MAX_BLOCKS:
            self.drop(*min(self.entries, key=self.entries.get))

    def match(self, hashes: list[int]) -> tuple[dict[str, int], dict[str, int]]:
        device, host = {}, {}
        for w in self.workers:
            d = 0
            while d < len(hashes) and (w, DEVICE, hashes[d]) in self.entries:
                d += 1
            t = d
            while t < len(hashes) and any(
                (w, m, hashes[t]) in self.entries for m in (DEVICE, HOST)
            ):
                t += 1
            if d:
                device[w] = d
            if t > d:
                host[w] = t - d
        return device, host


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.index = PrefixIndex(
            IndexConfig(max_blocks=MAX_BLOCKS, optimistic_ttl_s=TTL), clock=lambda: self.now
        )
        self.model = Model()

    @rule(w=worker_ids)
    def add_worker(self, w: str) -> None:
        self.index.add_worker(w)
        if w not in self.model.workers:
            self.model.workers.append(w)

    @rule(w=worker_ids)
    def remove_worker(self, w: str) -> None:
        self.index.remove_worker(w)
        self.model.clear(w)
        if w in self.model.workers:
            self.model.workers.remove(w)

    @precondition(lambda self: self.model.workers)
    @rule(data=st.data(), hashes=chains)
    def route(self, data: st.DataObject, hashes: list[int]) -> None:
        w = data.draw(st.sampled_from(self.model.workers))
        self.index.record_route(w, hashes)
        for h in hashes:
            fresh = (w, DEVICE, h) not in self.model.entries
            self.model.touch(w, DEVICE, h)
            if fresh:
                self.model.pending[(w, h)] = self.now + TTL
        self.model.bound()

    @precondition(lambda self: self.model.workers)
    @rule(data=st.data(), hashes=chains, tier=tiers)
    def stored(self, data: st.DataObject, hashes: list[int], tier: str) -> None:
        w = data.draw(st.sampled_from(self.model.workers))
        self.index.apply(w, [BlockStored(hashes, None, tier)])
        for h in hashes:
            self.model.touch(w, tier, h)
            if tier == DEVICE:
                self.model.pending.pop((w, h), None)
        self.model.bound()

    @precondition(lambda self: self.model.workers)
    @rule(data=st.data(), hashes=chains, tier=tiers)
    def removed(self, data: st.DataObject, hashes: list[int], tier: str) -> None:
        w = data.draw(st.sampled_from(self.model.workers))
        self.index.apply(w, [BlockRemoved(hashes, tier)])
        for h in hashes:
            self.model.drop(w, tier, h)

    @precondition(lambda self: self.model.workers)
    @rule(data=st.data())
    def cleared(self, data: st.DataObject) -> None:
        w = data.draw(st.sampled_from(self.model.workers))
        self.index.apply(w, [AllCleared()])
        self.model.clear(w)

    @precondition(lambda self: self.model.workers)
    @rule(data=st.data(), hashes=chains)
    def refresh(self, data: st.DataObject, hashes: list[int]) -> None:
        w = data.draw(st.sampled_from(self.model.workers))
        self.index.refresh_pending(w, hashes)
        for h in hashes:
            if (w, h) in self.model.pending:
                self.model.pending[(w, h)] = self.now + TTL

    @rule(dt=st.sampled_from([0.5, 2.0, 4.0, 6.0]))
    def advance(self, dt: float) -> None:
        self.now += dt
        expected = [k for k, deadline in self.model.pending.items() if deadline <= self.now]
        for w, h in expected:
            self.model.drop(w, DEVICE, h)
        assert self.index.expire() == len(expected)

    @rule(hashes=chains)
    def match(self, hashes: list[int]) -> None:
        got = self.index.match(hashes)
        assert (got.device, got.host) == self.model.match(hashes)

    @invariant()
    def same_entries(self) -> None:
        assert len(self.index) == len(self.model.entries) <= MAX_BLOCKS
        for w in WORKERS:
            for tier in (DEVICE, HOST):
                mine = {h for (mw, mt, h) in self.model.entries if mw == w and mt == tier}
                assert self.index.num_blocks(w, tier) == len(mine)
                assert all(self.index.holds(w, h, tier) for h in mine)
            for h in {h for (mw, mt, h) in self.model.entries if mw == w and mt == DEVICE}:
                assert self.index.is_confirmed(w, h) == ((w, h) not in self.model.pending)

    @invariant()
    def masks_hold_no_trace(self) -> None:
        """The per-hash worker bitmasks are exactly the entries: removed workers leave none."""
        for tier in (DEVICE, HOST):
            expected: dict[int, int] = {}
            for w, t, h in self.model.entries:
                if t == tier:
                    expected[h] = expected.get(h, 0) | (1 << self.index._workers[w].bit)
            assert self.index._store.masks[tier] == expected


IndexMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPrefixIndexModel = IndexMachine.TestCase
