"""SessionTable (TTL on an injected clock) and the soft pin as RoutingCore applies it."""

from __future__ import annotations

from mem_cache.events import block_hashes
from router.core import RoutingCore
from router.sessions import SessionConfig, SessionTable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pin_expires_after_ttl_and_renews_on_use() -> None:
    clock = Clock()
    table = SessionTable(SessionConfig(ttl_s=10.0), clock)
    table.pin("s", "w0")
    clock.now += 9.0
    assert table.get("s") == "w0"
    table.pin("s", "w0")  # a new turn renews the TTL
    clock.now += 9.0
    assert table.get("s") == "w0" and len(table) == 1
    clock.now += 1.5
    assert table.get("s") is None and len(table) == 0


def test_expire_drops_only_expired_pins() -> None:
    clock = Clock()
    table = SessionTable(SessionConfig(ttl_s=10.0), clock)
    table.pin("old", "w0")
    clock.now += 6.0
    table.pin("new", "w1")
    clock.now += 5.0
    assert table.expire() == 1
    assert table.get("old") is None and table.get("new") == "w1"


def test_close_and_drop_worker() -> None:
    table = SessionTable(SessionConfig(), Clock())
    table.pin("a", "w0")
    table.pin("b", "w0")
    table.pin("c", "w1")
    assert table.close("c") and not table.close("c")
    assert sorted(table.drop_worker("w0")) == ["a", "b"]
    assert len(table) == 0


def test_should_yield_only_when_far_costlier() -> None:
    table = SessionTable(SessionConfig(yield_factor=2.0, yield_slack_s=0.25), Clock())
    assert not table.should_yield(pinned_cost=1.2, best_cost=0.5)
    assert table.should_yield(pinned_cost=1.3, best_cost=0.5)


def make_core(clock: Clock, workers: int = 3) -> RoutingCore:
    core = RoutingCore("round_robin", clock)
    for i in range(workers):
        core.add_worker(f"w{i}")
    return core


def test_session_stays_on_its_worker_against_the_policy() -> None:
    core = make_core(Clock())
    hashes = block_hashes(list(range(64)))
    first = core.route("t1", hashes, 64, 8, session_id="s")
    for turn in range(2, 6):
        decision = core.route(f"t{turn}", hashes, 64, 8, session_id="s")
        assert (decision.worker_id, decision.reason) == (first.worker_id, "session")


def test_pin_yields_to_draining_excluded_or_removed_worker() -> None:
    core = make_core(Clock())
    hashes = block_hashes(list(range(64)))
    pinned = core.route("t1", hashes, 64, 8, session_id="s").worker_id
    core.registry.set_draining(pinned, True)
    moved = core.route("t2", hashes, 64, 8, session_id="s").worker_id
    assert moved != pinned and core.sessions.get("s") == moved
    other = core.route("t3", hashes, 64, 8, session_id="s", exclude={moved}).worker_id
    assert other not in (moved, pinned) and core.sessions.get("s") == other
    core.remove_worker(other)
    assert core.sessions.get("s") is None
    assert core.route("t4", hashes, 64, 8, session_id="s").worker_id == moved


def test_pin_yields_only_to_a_far_cheaper_worker() -> None:
    core = RoutingCore("cost", Clock())
    for w in ("w0", "w1"):
        core.add_worker(w)
    history = block_hashes(list(range(4000)))
    assert core.route("t1", history, 4000, 8, session_id="s").worker_id == "w0"
    core.finish("t1")
    filler = block_hashes(list(range(1, 4001)))
    core.route("load0", filler, 4000, 8, exclude={"w1"})  # ~0.5 s queued on w0
    decision = core.route("t2", history, 4000, 8, session_id="s")
    assert (decision.worker_id, decision.reason) == ("w0", "session")
    core.finish("t2")
    for i in range(1, 20):  # ~10 s queued on w0: recomputing the history on w1 is far cheaper
        core.route(f"load{i}", block_hashes([i] * 4000), 4000, 8, exclude={"w1"})
    decision = core.route("t3", history, 4000, 8, session_id="s")
    assert decision.worker_id == "w1" and decision.reason != "session"
    assert core.sessions.get("s") == "w1"
