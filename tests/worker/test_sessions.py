"""Streaming sessions: KV parked between turns, reused, trimmed, released."""

from __future__ import annotations

import time

import pytest
from engine_kit import assert_idle_clean, checked, greedy, make, prompt

from mem_cache.events import SessionHeld, SessionReleased, decode_batch
from worker.engine import Engine
from worker.offline import run_to_completion
from worker.protocol import GenerateRequest


def turn(engine: Engine, rid: str, ids: list[int], session: str | None = "s", **kw):
    req = GenerateRequest(rid, ids, greedy(8), session_id=session, **kw)
    return run_to_completion(engine, [req], after_step=checked)[rid]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("enable_cache", [True, False])
def test_next_turn_reuses_the_parked_kv(page_size, enable_cache):
    engine = make(page_size=page_size, enable_cache=enable_cache)
    plain = make(enable_cache=False)
    p1 = prompt(50, 1)
    t1 = turn(engine, "t1", p1)
    s = engine.stats()
    assert s.sessions == 1 and s.kv_session > 0
    held = len(p1) + len(t1.token_ids) - 1  # the last output has no KV yet
    p2 = p1 + t1.token_ids + prompt(20, 2)
    t2 = turn(engine, "t2", p2)
    assert t2.cached_tokens == held // page_size * page_size
    assert t2.token_ids == turn(plain, "ref", p2, session=None).token_ids
    assert engine.close_session("s") and not engine.close_session("s")
    assert_idle_clean(engine)


@pytest.mark.parametrize("page_size", [1, 16])
def test_shorter_next_prompt_frees_the_orphaned_tail(page_size):
    engine = make(page_size=page_size)
    p1 = prompt(70, 3)
    t1 = turn(engine, "t1", p1)
    # the next turn keeps only 37 tokens of what the session holds (a regenerated answer)
    p2 = p1[:37] + prompt(5, 4)
    t2 = turn(engine, "t2", p2)
    assert t2.cached_tokens == 37 // page_size * page_size
    assert t2.token_ids == turn(make(enable_cache=False), "ref", p2, session=None).token_ids
    s = engine.stats()
    # what the session holds now is exactly turn 2's KV
    held = len(p2) + len(t2.token_ids) - 1
    assert s.kv_session + s.kv_protected <= -(-held // page_size) * page_size
    engine.close_session("s")
    assert_idle_clean(engine)
    assert len(t1.token_ids) == 8


def test_ttl_releases_the_session():
    engine = make()
    turn(engine, "t1", prompt(30, 5), session_ttl_s=0.05)
    assert engine.stats().sessions == 1
    time.sleep(0.06)
    assert engine.expire_sessions() == 1
    assert_idle_clean(engine)


def test_aborted_turn_and_a_new_session_turn_leave_nothing():
    engine = make(prefill_budget=16)
    p1 = prompt(40, 6)
    t1 = turn(engine, "t1", p1)
    engine.add_request(GenerateRequest("t2", p1 + t1.token_ids + [5, 6], greedy(8), session_id="s"))
    engine.step()
    engine.abort("t2")
    run_to_completion(engine, after_step=checked)
    assert engine.stats().sessions == 0  # the turn took the session's KV and released it
    assert_idle_clean(engine)


def test_sessions_are_dropped_under_memory_pressure():
    engine = make(kv_tokens=256, prefill_budget=64)
    for i in range(4):
        turn(engine, f"t{i}", prompt(50, 10 + i), session=f"s{i}")
    assert engine.stats().sessions >= 1
    # a request that needs nearly the whole pool pushes the parked sessions out
    big = run_to_completion(
        engine, [GenerateRequest("big", prompt(200, 20), greedy(40))], after_step=checked
    )
    assert big["big"].finish_reason == "length"
    for i in range(4):
        engine.close_session(f"s{i}")
    assert_idle_clean(engine)


_read_up_to: dict[Engine, int] = {}  # the last batch seq session_events read, per engine


def session_events(engine: Engine) -> list:
    """The session events of every batch the engine published since the last call."""
    events = []
    for data in engine.events_since(engine.events.epoch, _read_up_to.get(engine, 0)):
        batch = decode_batch(data)
        _read_up_to[engine] = batch.seq
        events += [e for e in batch.events if isinstance(e, SessionHeld | SessionReleased)]
    return events


def test_the_engine_tells_the_routers_which_sessions_it_holds():
    engine = make(prefill_budget=16)
    p1 = prompt(40, 7)
    t1 = turn(engine, "t1", p1)
    assert session_events(engine) == [SessionHeld("s")]  # parked after its first turn
    # the next turn takes the parked KV and runs for several steps: still held, no flicker
    engine.add_request(GenerateRequest("t2", p1 + t1.token_ids + [5, 6], greedy(8), session_id="s"))
    engine.step()
    assert session_events(engine) == []
    run_to_completion(engine, after_step=checked)
    assert session_events(engine) == []
    # a snapshot (a router that joins late, or missed batches) lists the held sessions
    snapshot = decode_batch(engine.events_since(-1, -1)[0]).events
    assert SessionHeld("s") in snapshot
    assert engine.close_session("s")
    engine.take_event_batch()
    assert session_events(engine) == [SessionReleased("s")]
    assert SessionHeld("s") not in decode_batch(engine.events_since(-1, -1)[0]).events
    assert_idle_clean(engine)


def test_an_aborted_or_expired_session_is_released_to_the_routers():
    engine = make(prefill_budget=16)
    p1 = prompt(40, 8)
    t1 = turn(engine, "t1", p1)
    turn(engine, "u1", prompt(30, 9), session="u", session_ttl_s=0.05)
    assert session_events(engine) == [SessionHeld("s"), SessionHeld("u")]
    engine.add_request(GenerateRequest("t2", p1 + t1.token_ids + [5, 6], greedy(8), session_id="s"))
    engine.step()
    engine.abort("t2")  # the turn held the session's KV and gives it back
    time.sleep(0.06)
    run_to_completion(engine, after_step=checked)  # its steps expire "u" too
    assert sorted(session_events(engine), key=repr) == [SessionReleased("s"), SessionReleased("u")]
    assert engine.stats().sessions == 0
    assert_idle_clean(engine)
