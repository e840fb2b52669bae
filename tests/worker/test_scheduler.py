"""Scheduling under pressure: aborts at every stage, preemption, prefix-aware queue order."""

from __future__ import annotations

import random

import pytest
from engine_kit import (
    assert_idle_clean,
    checked,
    drive_randomly,
    greedy,
    make,
    prompt,
)

from worker.engine import Engine
from worker.offline import run_to_completion
from worker.protocol import GenerateRequest


@pytest.mark.parametrize("page_size", [1, 16])
def test_abort_mid_prefill_chunk_frees_everything(page_size):
    engine = make(prefill_budget=24, page_size=page_size)
    engine.add_request(GenerateRequest("a", prompt(100, 1), greedy()))
    engine.add_request(GenerateRequest("b", prompt(100, 1)[:60] + prompt(20, 2), greedy()))
    for _ in range(3):
        assert engine.step() == []  # still prefilling: no tokens yet
        engine.check_integrity()
    engine.abort("a")
    out = run_to_completion(engine, after_step=checked)
    assert out["a"].finish_reason == "abort" and out["a"].token_ids == []
    assert out["b"].finish_reason == "length"
    assert_idle_clean(engine)


@pytest.mark.parametrize("page_size", [1, 16])
def test_abort_mid_decode_and_while_waiting(page_size):
    engine = make(page_size=page_size, max_running=1)
    engine.add_request(GenerateRequest("a", prompt(40, 3), greedy(30)))
    engine.add_request(GenerateRequest("w", prompt(40, 4), greedy(30)))
    got = []
    for _ in range(5):
        got += [t for c in engine.step() for t in c.token_ids]
        engine.check_integrity()
    assert engine.stats().waiting == 1
    engine.abort("w")
    engine.abort("a")
    engine.abort("unknown")  # ignored
    chunks = engine.step()
    assert sorted((c.request_id, c.finish_reason) for c in chunks) == [
        ("a", "abort"),
        ("w", "abort"),
    ]
    assert len(got) == 5 and not engine.has_work()  # five steps: five tokens
    assert_idle_clean(engine)


@pytest.mark.parametrize("page_size", [1, 16])
def test_preemption_under_a_too_small_pool_gives_the_same_outputs(page_size):
    ps = [prompt(60, 10 + i) for i in range(6)]
    reqs = lambda: [GenerateRequest(f"r{i}", p, greedy(40)) for i, p in enumerate(ps)]  # noqa: E731
    roomy = run_to_completion(make(page_size=page_size), reqs())
    small = make(kv_tokens=256, page_size=page_size, prefill_budget=64)
    tight = run_to_completion(small, reqs(), after_step=checked)
    assert small.scheduler.num_retracted > 0
    for rid, done in roomy.items():
        assert tight[rid].token_ids == done.token_ids and tight[rid].finish_reason == "length"
    assert_idle_clean(small)


def test_waiting_queue_prefers_the_longest_cached_prefix():
    engine = make(max_running=1)
    hot = prompt(64, 20)
    run_to_completion(engine, [GenerateRequest("warm", hot + [7], greedy(2))])
    engine.add_request(GenerateRequest("busy", prompt(10, 21), greedy(3)))
    engine.step()  # busy holds the only row
    engine.add_request(GenerateRequest("cold", prompt(64, 22), greedy(2)))
    engine.add_request(GenerateRequest("hit", hot + [9], greedy(2)))
    order = []
    while engine.has_work():
        for c in engine.step():
            if c.request_id not in order:
                order.append(c.request_id)
    assert order.index("hit") < order.index("cold")


def test_aging_admits_a_starving_request_first():
    engine = make(max_running=1, aging_steps=3)
    hot = prompt(64, 30)
    run_to_completion(engine, [GenerateRequest("warm", hot + [7], greedy(2))])
    engine.add_request(GenerateRequest("busy", prompt(10, 31), greedy(6)))
    engine.step()
    engine.add_request(GenerateRequest("cold", prompt(64, 32), greedy(2)))
    for _ in range(4):  # cold waits longer than aging_steps while busy runs
        engine.step()
    engine.add_request(GenerateRequest("hit", hot + [9], greedy(2)))
    order = []
    while engine.has_work():
        for c in engine.step():
            if c.request_id not in order:
                order.append(c.request_id)
    assert order.index("cold") < order.index("hit")


def test_many_requests_with_aborts_and_pressure_never_leak():
    rng = random.Random(5)
    engine = make(kv_tokens=320, page_size=4, prefill_budget=40, max_running=6)
    base = prompt(48, 40)
    reqs = [
        GenerateRequest(
            f"m{i}",
            base[: rng.randrange(8, 48)] + prompt(rng.randrange(1, 30), i),
            greedy(rng.randrange(1, 25)),
        )
        for i in range(24)
    ]

    def chaos(engine: Engine, step: int) -> None:
        engine.check_integrity()
        if step % 7 == 3:
            engine.abort(f"m{step // 7 * 3}")

    out = run_to_completion(engine, reqs, after_step=chaos)
    assert {c.finish_reason for c in out.values()} <= {"length", "abort"}
    assert sum(c.finish_reason == "abort" for c in out.values()) >= 2
    assert_idle_clean(engine)


def test_requests_sharing_an_uncached_prefix_compute_it_once():
    engine = make(prefill_budget=512)
    shared = prompt(100, 50)
    reqs = [GenerateRequest(f"d{i}", shared + prompt(5, 60 + i), greedy(3)) for i in range(4)]
    out = run_to_completion(engine, reqs, after_step=checked)
    assert sorted(c.cached_tokens for c in out.values()) == [0, 100, 100, 100]
    # one prefill of the shared part, the four tails, two decode steps each
    assert engine.num_computed_tokens == 100 + 4 * 5 + 4 * 2
    assert_idle_clean(engine)


@pytest.mark.parametrize(("seed", "page_size", "host"), [(1, 1, 0), (2, 4, 0), (3, 2, 512)])
def test_random_operations_never_leak(seed, page_size, host):
    """Random arrivals (shared prefixes, session turns, resumes), aborts, session closes and
    steps on a tight pool: integrity after every step, conservation once idle."""
    rng = random.Random(seed)
    engine = make(
        kv_tokens=192, page_size=page_size, prefill_budget=24, max_running=5, host_kv_tokens=host
    )
    drive_randomly(engine, rng, prompt(64, seed), ops=60, max_new=12)
    run_to_completion(engine, after_step=checked)
    engine.close_session("s1")
    engine.close_session("s2")
    assert_idle_clean(engine)


def test_a_decode_step_short_of_pages_takes_nothing_then_goes_request_by_request():
    """Decode slots come from one allocator call; when the free list cannot cover every
    decoding request, that call takes nothing and the request-by-request path retracts (and
    the outputs are those of a pool with room)."""
    ps = [prompt(16, 30 + i) for i in range(3)]
    want = [o.token_ids for o in run(make(kv_tokens=4096, page_size=16), ps)]
    engine = make(kv_tokens=64, page_size=16, enable_cache=False)  # 4 pages of 16
    for i, p in enumerate(ps):
        engine.add_request(GenerateRequest(f"r{i}", p, greedy(4)))
    first = {c.request_id: c.token_ids for c in engine.step()}  # the prompts, a page each
    memory, running = engine.memory, engine.scheduler.running
    assert len(running) == 3 and all(r.remaining == 1 for r in running)
    free, alloc = memory.allocator.available_size(), [r.alloc_len for r in running]
    assert free == 16 and not memory.alloc_decodes(running)  # 3 new pages wanted, 1 free
    assert memory.allocator.available_size() == free  # nothing taken
    assert [r.alloc_len for r in running] == alloc
    out = run_to_completion(engine, after_step=checked)
    got = [first.get(f"r{i}", []) + out[f"r{i}"].token_ids for i in range(3)]
    assert got == want
    assert engine.scheduler.num_retracted > 0
    assert_idle_clean(engine)


def run(engine: Engine, prompts: list[list[int]]):
    reqs = [GenerateRequest(f"q{i}", p, greedy(4)) for i, p in enumerate(prompts)]
    out = run_to_completion(engine, reqs, after_step=checked)
    return [out[r.request_id] for r in reqs]
