"""Overlap mode (`EngineConfig.overlap`): the next step is scheduled while the forward pass of
the current one runs in the engine's forward thread, and no slot that pass uses changes owner
before it ends. Outputs equal to the synchronous engine's are checked by every test module
that uses the `step_modes` fixture, and against HF in test_engine_hf_identity."""

from __future__ import annotations

import random
import threading
import time

import pytest
from engine_kit import (
    assert_idle_clean,
    checked,
    drive_randomly,
    greedy,
    make,
    prompt,
)

from worker.offline import run_to_completion
from worker.protocol import GenerateRequest, SamplingParams


def test_the_next_step_is_scheduled_while_the_pass_runs():
    engine = make(overlap=True, prefill_budget=16)
    passes, schedules, threads = [], [], []
    schedule, run = engine.scheduler.schedule, engine.runner.run

    def spy_schedule(**kw):
        schedules.append(time.monotonic())
        return schedule(**kw)

    def spy_run(inputs):
        threads.append(threading.current_thread().name)
        logits = run(inputs)
        time.sleep(0.1)  # a slow device: wide enough a window to see what runs meanwhile
        passes.append(time.monotonic())
        return logits

    engine.scheduler.schedule, engine.runner.run = spy_schedule, spy_run
    reqs = [GenerateRequest(f"r{i}", prompt(30 + 7 * i, i), greedy(5)) for i in range(3)]
    out = run_to_completion(engine, reqs, after_step=checked)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 5 for c in out.values())
    # a synchronous engine schedules step k + 1 after pass k ends; this one before
    assert len(passes) > 5
    assert all(sum(t < end for t in schedules) >= k + 2 for k, end in enumerate(passes))
    assert all(name.startswith("worker-0-forward") for name in threads)
    assert_idle_clean(engine)


@pytest.mark.parametrize(("seed", "page_size", "host"), [(1, 1, 0), (2, 4, 0), (3, 2, 512)])
def test_no_slot_a_pass_uses_changes_owner_before_it_ends(seed, page_size, host):
    """Random arrivals, session turns, aborts and closes on a pool too small for them: every
    release, park and retraction happens to a request outside the pass in flight, memory
    pressure is met by waiting for the pass (then retracting), and nothing leaks."""
    rng = random.Random(seed)
    engine = make(
        overlap=True, kv_tokens=160, page_size=page_size, prefill_budget=24, max_running=6,
        host_kv_tokens=host,
    )  # fmt: skip
    touched = []

    def guard(fn):
        def guarded(req, *args):
            assert req not in engine.in_flight, f"{fn.__name__} of {req.request_id} in flight"
            touched.append(fn.__name__)
            return fn(req, *args)

        return guarded

    memory, scheduler = engine.memory, engine.scheduler
    memory.release, memory.park = guard(memory.release), guard(memory.park)
    scheduler.retract = guard(scheduler.retract)
    schedule, short = scheduler.schedule, []

    def spy_schedule(**kw):
        batch = schedule(**kw)
        short.append(batch.short_of_memory)
        return batch

    scheduler.schedule = spy_schedule
    drive_randomly(engine, rng, prompt(64, seed), ops=80, max_new=40)
    run_to_completion(engine, after_step=checked)
    engine.close_session("s1")
    engine.close_session("s2")
    assert {"release", "park", "retract"} <= set(touched)
    assert any(short)  # pressure met with a pass in flight: the request waited a step
    assert_idle_clean(engine)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_turn_ending_on_a_stop_token_parks_only_what_it_computed(page_size):
    """A request is scheduled into the next step before its token is known; when that token
    ends it, the slot taken for the next step goes back, and the session holds exactly the
    turn's computed KV (what the synchronous engine parks)."""
    p = prompt(50, 7)
    free = run_to_completion(make(), [GenerateRequest("ref", p, greedy(8))])["ref"].token_ids
    stop = SamplingParams(max_tokens=50, temperature=0.0, stop_token_ids=[free[5]])
    parked = {}
    for overlap in (False, True):
        engine = make(overlap=overlap, page_size=page_size)
        req = GenerateRequest("t", p, stop, session_id="s")
        out = run_to_completion(engine, [req], after_step=checked)["t"]
        assert out.finish_reason == "stop" and out.token_ids == free[: free.index(free[5]) + 1]
        s = engine.stats()
        parked[overlap] = (s.kv_session, s.kv_protected, s.kv_free)
        engine.close_session("s")
        assert_idle_clean(engine)
    assert parked[True] == parked[False]


def test_a_failing_pass_raises_from_step():
    """The worker actor fails the engine on an exception from `step`: one raised in the
    forward thread must come out of it too."""
    engine = make(overlap=True)

    def broken(inputs):
        raise RuntimeError("device lost")

    engine.runner.run = broken
    engine.add_request(GenerateRequest("x", prompt(20, 1), greedy(3)))
    engine.step()  # launches the pass
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
