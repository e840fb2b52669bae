"""SessionTable (TTL on an injected clock) and the soft pin as RoutingCore applies it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mem_cache.events import (
    AllCleared,
    SessionHeld,
    block_hashes,
    encode_batch,
)
from router.routing.core import RoutingCore
from router.routing.sessions import SessionConfig, SessionTable


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


def test_a_replica_without_the_pin_follows_the_worker_that_holds_the_session() -> None:
    """Two router replicas read the same workers' events; only one routed the first turn."""
    clock = Clock()
    a, b = make_core(clock), make_core(clock)
    for core in (a, b):
        for i in range(3):
            core.apply_events(encode_batch(f"w{i}", 1, 0, [AllCleared()]))
    hashes = block_hashes(list(range(64)))
    first = a.route("t1", hashes, 64, 8, session_id="s").worker_id
    a.finish("t1")
    assert b.sessions.get("s") is None
    clock.now += 1.0
    parked = encode_batch(first, 1, 1, [SessionHeld("s")])  # the turn ended: KV parked
    for core in (a, b):
        assert core.apply_events(parked)
    for turn in range(2, 5):  # round robin would spread these; the session keeps its worker
        decision = b.route(f"t{turn}", hashes, 64, 8, session_id="s")
        assert (decision.worker_id, decision.reason) == (first, "session")
    assert b.sessions.get("s") == first  # now b's own pin too


def test_the_newer_of_pin_and_holding_wins() -> None:
    clock = Clock()
    table = SessionTable(SessionConfig(ttl_s=60.0), clock)
    table.pin("s", "w0")
    clock.now += 1.0
    table.held("w1", "s")  # another replica moved the session; w1 reports it
    assert table.get("s") == "w1"
    clock.now += 1.0
    table.pin("s", "w2")  # this replica moves it again before w2 reports
    assert table.get("s") == "w2"
    clock.now += 1.0
    table.held("w2", "s")
    table.released("w1", "s")
    assert table.get("s") == "w2" and len(table) == 1
    table.pin("s", "w0")
    table.released("w0", "s")  # w0 dropped it (closed through another replica): pin void
    assert table.get("s") == "w2"
    clock.now += 100.0  # the pin expired; the holding stays until the worker releases it
    assert table.get("s") == "w2"
    table.forget_holdings("w2")
    assert table.get("s") is None and len(table) == 0


def test_a_snapshot_or_a_removed_worker_voids_its_holdings() -> None:
    clock = Clock()
    core = make_core(clock, workers=2)
    core.apply_events(encode_batch("w0", 1, 0, [AllCleared(), SessionHeld("a")]))
    core.apply_events(encode_batch("w1", 1, 0, [AllCleared(), SessionHeld("b")]))
    assert core.sessions.get("a") == "w0" and core.sessions.get("b") == "w1"
    core.apply_events(encode_batch("w0", 2, 5, [AllCleared()]))  # w0 restarted: empty
    assert core.sessions.get("a") is None
    core.remove_worker("w1")
    assert core.sessions.get("b") is None and len(core.sessions) == 0


# one step on a table: (op, session, worker, seconds to advance first)
steps = st.lists(
    st.tuples(
        st.sampled_from(["pin", "held", "moved", "released", "forget", "close", "drop"]),
        st.sampled_from(["s0", "s1", "s2"]),
        st.sampled_from(["w0", "w1", "w2"]),
        st.sampled_from([0.0, 0.5, 3.0]),
    ),
    max_size=40,
)


@given(steps)
def test_the_table_answers_like_a_model_of_pins_and_holdings(ops) -> None:
    """Against a plain model: a pin lives `ttl_s` from its turn; a holding lives until its worker
    releases it, which also voids a pin to that worker; `get` returns the newer of the two (a
    holding wins a tie only if strictly newer); `len` counts the sessions with either."""
    clock = Clock()
    table = SessionTable(SessionConfig(ttl_s=5.0), clock)
    pins: dict[str, tuple[str, float]] = {}
    held: dict[str, dict[str, float]] = {}
    for op, sid, wid, dt in ops:
        clock.now += dt
        now = clock.now
        pins = {s: p for s, p in pins.items() if p[1] + 5.0 > now}
        if op == "pin":
            table.pin(sid, wid)
            pins[sid] = (wid, now)
        elif op == "held":
            assert table.held(wid, sid) == []
            held.setdefault(sid, {})[wid] = now
        elif op == "moved":  # a live batch's report: the other holders' copies are stale
            others = sorted(w for w in held.get(sid, {}) if w != wid)
            assert sorted(table.held(wid, sid, moved=True)) == others
            held[sid] = {wid: now}
        elif op == "released":
            table.released(wid, sid)
            held.get(sid, {}).pop(wid, None)
            if pins.get(sid, ("",))[0] == wid:
                del pins[sid]
        elif op == "forget":
            table.forget_holdings(wid)
            for holders in held.values():
                holders.pop(wid, None)
        elif op == "close":
            was = sid in pins or bool(held.get(sid))
            assert table.close(sid) == was
            pins.pop(sid, None)
            held.pop(sid, None)
        else:
            table.drop_worker(wid)
            pins = {s: p for s, p in pins.items() if p[0] != wid}
            for holders in held.values():
                holders.pop(wid, None)
        held = {s: h for s, h in held.items() if h}
        for s in ("s0", "s1", "s2"):
            expected = pins[s][0] if s in pins else None
            if held.get(s):
                worker, at = max(held[s].items(), key=lambda item: item[1])
                if s not in pins or at > pins[s][1]:
                    expected = worker
            assert table.get(s) == expected
        assert len(table) == len(set(pins) | set(held))


def test_a_session_that_moves_leaves_its_old_copy_to_be_closed() -> None:
    core = make_core(Clock(), workers=2)
    core.apply_events(encode_batch("w0", 1, 0, [AllCleared(), SessionHeld("s")]))
    core.apply_events(encode_batch("w1", 1, 0, [AllCleared(), SessionHeld("s")]))
    assert core.take_stale_sessions() == []  # snapshots re-list holdings: nothing moved
    core.apply_events(encode_batch("w1", 1, 1, [SessionHeld("t")]))
    core.apply_events(encode_batch("w0", 1, 1, [SessionHeld("t")]))  # t's turn now runs on w0
    assert core.take_stale_sessions() == [("w1", "t")] and core.take_stale_sessions() == []
    assert core.sessions.get("t") == "w0"
