"""Hypothesis state machines over the component radix cache (`HybridRadixCache`): requests that
match, lock, compute, insert whole or chunk by chunk (pausing with their lock held), abort;
evictions of every component; host backup and load back; protect / release on host; reset.

After every step (`Harness.check`): `check_integrity()`, slot conservation per allocator, the
replayed events of every group and medium equal what the tree holds; every match is checked
against a brute-force reference of the resume rule and its slots' recorded content.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from mem_cache.radix_node import descendants

from .hybrid_harness import Harness


class HybridMachine(RuleBasedStateMachine):
    config: dict = {}
    seen: Counter = Counter()  # what the examples exercised, summed over a run

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(**self.config)
        self.prompts: list[list[int]] = []
        self.protected = []

    OPS = ("run",) * 4 + ("revisit",) * 3 + ("pause", "pause", "resume", "resume", "match", "abort",
           "evict_full", "evict_window", "evict_states", "evict_host", "protect", "release",
           "reset")

    @rule(op=st.sampled_from(OPS), tokens=st.lists(st.integers(0, 1), max_size=12),
          num=st.sampled_from([1, 2, 4, 8, 100]), flag=st.booleans(), data=st.data())
    def step(self, op, tokens, num, flag, data) -> None:
        h, page = self.h, self.h.page
        if op == "revisit" and self.prompts:
            base = data.draw(st.sampled_from(self.prompts))
            tokens = base[: data.draw(st.integers(0, len(base)))] + tokens
            op = "run"
        tokens = tokens[: len(tokens) // page * page]
        # how much window KV past the window a request keeps (its last chunk's)
        h.keep = [max(w, page) + page * (1 + num % 3) for w in h.windows]
        if op in ("run", "pause"):
            # a prefill in two chunks: the first ends at `mid`, inserted with the lock moved
            mid = data.draw(st.integers(0, len(tokens) // page)) * page
            req = h.start(tokens, load=flag, upto=mid)
            if req is None:
                return
            self.prompts.append(tokens)
            h.requests.append(req)
            if mid > req.done:
                h.insert(req, mid)
            if op == "pause":
                return  # paused mid-prefill, its lock held
            h.requests.remove(req)
            if h.advance(req, len(tokens)):
                h.finish(req)
            else:
                h.abort(req)
        elif op == "abort":  # a locked match released without insert
            req = h.start(tokens, load=flag)
            if req is not None:
                h.abort(req)
        elif op == "resume" and h.requests:
            req = data.draw(st.sampled_from(h.requests))
            h.requests.remove(req)
            if flag and h.advance(req, len(req.tokens)):
                h.finish(req)
            else:
                h.abort(req)  # aborted mid-prefill
        elif op == "match":
            m = h.cache.match_prefix(tokens)
            h.check_match(tokens, m)
        elif op == "evict_full":
            h.cache.evict(num)
        elif op == "evict_window" and h.windows:
            g = data.draw(st.sampled_from(range(len(h.windows))))
            h.cache.evict_window(h.groups[1 + g].index, num)
        elif op == "evict_states":
            h.cache.evict_states(num)
        elif op == "evict_host":
            h.cache.evict_host(num)
        elif op == "protect":
            m = h.cache.match_prefix(tokens)
            node = m.host_node or m.node
            if node is not h.cache.root and node.host_ready:
                h.cache.protect_host(node)
                self.protected.append(node)
        elif op == "release" and self.protected:
            node = self.protected.pop(data.draw(st.integers(0, len(self.protected) - 1)))
            h.cache.release_host(node)
        elif op == "reset" and not h.requests and not self.protected:
            h.cache.reset()

    @invariant()
    def consistent(self) -> None:
        self.h.check()
        nodes = descendants(self.h.cache.root)
        self.seen["tombstone"] += any(
            not n.evicted and any(w is None for w in n.windows) for n in nodes)
        self.seen["host-only"] += any(n.evicted for n in nodes)
        self.seen["state"] += any(n.state >= 0 for n in nodes)
        self.seen["paused"] += bool(self.h.requests)
        self.seen.update(self.h.stats)
        self.h.stats.clear()

    def teardown(self) -> None:
        for req in list(self.h.requests):
            self.h.abort(req)
        self.h.requests.clear()
        for node in self.protected:
            self.h.cache.release_host(node)
        self.protected.clear()
        self.h.check()
        cache = self.h.cache
        for g in self.h.groups:  # idle: nothing protected, every slot free or the tree's
            assert cache.protected_size(g.index) == 0, f"group {g.index}: a lock leaked"


MAX_EXAMPLES = int(os.environ.get("HYBRID_MAX_EXAMPLES", "100"))

PHASES = [p for p in Phase if p is not Phase.shrink or not os.environ.get("HYBRID_NO_SHRINK")]

CONFIGS = {
    "window": dict(windows=(4,), page=2, block=2, device=24),
    "window_page1": dict(windows=(3,), page=1, block=2, device=12),
    "two_windows_recurrent": dict(windows=(2, 6), recurrent=True, page=2, block=4, device=24),
    "recurrent": dict(recurrent=True, windows=(), page=1, block=1, device=12, states=5),
    "window_host_wt": dict(windows=(4,), page=2, block=2, device=16, host=32),
    "window_host_wb": dict(windows=(4,), page=2, block=2, device=16, host=32,
                           policy="write_back"),
    "hybrid_host": dict(windows=(4,), recurrent=True, page=2, block=2, device=16, host=40,
                        states=6, interval=4),
    # blocks that pages do not tile (two siblings may hold one block), a window under a page
    "odd_blocks": dict(windows=(1, 5), recurrent=True, page=2, block=3, device=20, host=40,
                       states=6, policy="write_back"),
}


# What each configuration's run must have exercised (else the machine tests too little).
EXPECT = {
    "window": ("hit", "cut back", "tombstone", "paused"),
    "window_page1": ("hit", "cut back", "tombstone", "paused"),
    "two_windows_recurrent": ("hit", "cut back", "tombstone", "state"),
    "recurrent": ("hit", "cut back", "state"),
    "window_host_wt": ("hit", "host hit", "loaded back", "host-only", "tombstone"),
    "window_host_wb": ("hit", "host hit", "loaded back", "host-only", "tombstone"),
    "hybrid_host": ("hit", "host hit", "loaded back", "host-only", "state"),
    "odd_blocks": ("hit", "host hit", "host-only", "tombstone", "state"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hybrid_state_machine(name):
    seen: Counter = Counter()
    machine = type(f"Machine_{name}", (HybridMachine,), {"config": CONFIGS[name], "seen": seen})
    run_state_machine_as_test(
        machine,
        settings=settings(max_examples=MAX_EXAMPLES, stateful_step_count=30, deadline=None,
                          suppress_health_check=list(HealthCheck),
                          phases=PHASES),
    )
    missing = [what for what in EXPECT[name] if not seen[what]]
    assert not missing, f"the machine never exercised {missing}: {dict(seen)}"
    print(name, dict(seen))
