"""RoutingCore: booking and release, optimistic entries and events, gaps, worker removal."""

from __future__ import annotations

from collections import Counter

import pytest

from mem_cache.events import AllCleared, BlockStored, block_hashes, encode_batch
from router.routing.core import CoreConfig, NoWorkerError, RoutingCore
from router.routing.prefix_index import IndexConfig
from worker.protocol import WorkerStats


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_core(n: int = 4, policy: str = "cost", ttl_s: float = 30.0) -> tuple[RoutingCore, Clock]:
    clock = Clock()
    config = CoreConfig(index=IndexConfig(optimistic_ttl_s=ttl_s))
    core = RoutingCore(policy, clock, config=config)
    for i in range(n):
        core.add_worker(f"w{i}")
    return core, clock


def load(core: RoutingCore) -> dict[str, tuple[int, int]]:
    return {v.worker_id: (v.requests, v.decode_tokens) for v in core.workers()}


PROMPT = list(range(2000))
HASHES = block_hashes(PROMPT)


def test_booking_is_released_on_finish() -> None:
    core, _ = make_core(2)
    decision = core.route("r1", HASHES, len(PROMPT), 100)
    assert load(core)[decision.worker_id] == (1, 100)
    booking = core.finish("r1", cached_tokens=0)
    assert booking is not None and booking.actual_cached_tokens == 0
    assert load(core) == {"w0": (0, 0), "w1": (0, 0)}
    assert core.finish("r1") is None and core.finish("nope") is None
    assert len(core.ledger) == 0


def test_prefill_load_ages_out_at_its_predicted_end() -> None:
    core, clock = make_core(1)
    core.route("r1", HASHES, len(PROMPT), 100)
    view = core.workers()[0]
    assert view.prefill_tokens == 2000 and view.queue_s > 0
    clock.now += 10.0
    view = core.workers()[0]
    assert (view.requests, view.prefill_tokens, view.queue_s) == (1, 0, 0.0)


def test_rerouting_a_request_releases_its_first_booking() -> None:
    core, _ = make_core(2)
    first = core.route("r1", HASHES, len(PROMPT), 100).worker_id
    second = core.route("r1", HASHES, len(PROMPT), 100, exclude={first}).worker_id
    assert second != first
    assert load(core)[first] == (0, 0) and load(core)[second] == (1, 100)


def test_a_burst_of_new_prompts_spreads_over_idle_workers() -> None:
    core, _ = make_core(4)
    chosen = [core.route(f"r{i}", block_hashes([i] * 2000), 2000, 50).worker_id for i in range(8)]
    assert Counter(chosen) == {"w0": 2, "w1": 2, "w2": 2, "w3": 2}


def test_a_burst_on_one_prefix_follows_the_first_request_then_spills() -> None:
    core, _ = make_core(4)
    shared = list(range(4000))
    decisions = [
        core.route(f"r{i}", block_hashes(shared + [i] * 160), 4160, 50) for i in range(200)
    ]
    first = decisions[0].worker_id
    assert decisions[0].reason == "least_load"
    assert all(d.worker_id == first and d.reason == "cache_hit" for d in decisions[1:6])
    assert decisions[1].cached_tokens == 4000
    # the queue (and past max_running, the wait for a slot) grew: others took the rest
    assert len({d.worker_id for d in decisions}) > 1


def test_a_prefix_held_by_a_busy_worker_is_not_recomputed_on_a_busy_one() -> None:
    core, _ = make_core(2)
    core.route("other", block_hashes([9] * 4160), 4160, 50)  # w0 busy, nothing shared
    shared = list(range(4000))
    first = core.route("r0", block_hashes(shared + [0] * 160), 4160, 50)
    assert first.worker_id == "w1"
    nxt = [core.route(f"r{i}", block_hashes(shared + [i] * 160), 4160, 50) for i in range(1, 6)]
    assert all(d.worker_id == "w1" and d.cached_tokens == 4000 for d in nxt)


def test_optimistic_entries_are_confirmed_or_expire() -> None:
    core, clock = make_core(2, ttl_s=5.0)
    worker = core.route("r1", HASHES, len(PROMPT), 10).worker_id
    assert core.index.match(HASHES).device == {worker: len(HASHES)}
    assert core.apply_events(encode_batch(worker, 1, 0, [AllCleared()]))  # snapshot: empty
    core.route("r2", HASHES, len(PROMPT), 10, exclude={w for w in ("w0", "w1") if w != worker})
    assert core.apply_events(encode_batch(worker, 1, 1, [BlockStored(HASHES[:50], None)]))
    assert core.index.is_confirmed(worker, HASHES[49])
    assert not core.index.is_confirmed(worker, HASHES[50])
    core.finish("r1")
    core.finish("r2")
    clock.now += 5.5
    core.route("r3", block_hashes([7] * 64), 64, 10)  # routing expires stale entries
    assert core.index.match(HASHES).device == {worker: 50}


def test_event_gap_asks_for_a_snapshot() -> None:
    core, _ = make_core(1)
    assert core.event_cursor("w0") is None
    assert not core.apply_events(encode_batch("w0", 3, 5, [BlockStored(HASHES[:4], None)]))
    snapshot = encode_batch("w0", 3, 5, [AllCleared(), BlockStored(HASHES[:4], None)])
    assert core.apply_events(snapshot) and core.event_cursor("w0") == (3, 5)
    assert not core.apply_events(encode_batch("w0", 3, 7, [BlockStored(HASHES[4:8], None)]))
    assert core.apply_events(encode_batch("w0", 3, 6, [BlockStored(HASHES[4:8], None)]))
    assert core.index.match(HASHES).device == {"w0": 8}
    with pytest.raises(ValueError):
        core.apply_events(b"\x00garbage")


def test_remove_worker_leaves_no_trace() -> None:
    core, _ = make_core(2)
    core.apply_events(encode_batch("w1", 0, 0, [AllCleared(), BlockStored(HASHES, None)]))
    core.route("r1", HASHES, len(PROMPT), 10, session_id="s")
    core.route("r2", block_hashes([5] * 320), 320, 10, exclude={"w0"})
    assert sorted(b.request_id for b in core.ledger.bookings()) == ["r1", "r2"]
    core.remove_worker("w1")
    assert core.index_blocks() == 0 and len(core.ledger) == 0 and len(core.sessions) == 0
    assert [v.worker_id for v in core.workers()] == ["w0"] and "w1" not in core.registry
    core.remove_worker("w1")  # unknown: ignored
    assert core.route("r3", HASHES, len(PROMPT), 10).worker_id == "w0"


def test_no_worker_error_when_nothing_is_eligible() -> None:
    core, _ = make_core(0)
    with pytest.raises(NoWorkerError):
        core.route("r", HASHES, len(PROMPT), 10)
    core.add_worker("w0")
    core.registry.set_draining("w0")
    with pytest.raises(NoWorkerError):
        core.route("r", HASHES, len(PROMPT), 10)
    core.registry.set_draining("w0", False)
    with pytest.raises(NoWorkerError):
        core.route("r", HASHES, len(PROMPT), 10, exclude={"w0"})
    assert core.route("r", HASHES, len(PROMPT), 10).worker_id == "w0"


def test_stats_feed_the_policy_and_unknown_stats_are_ignored() -> None:
    core, _ = make_core(2, policy="least_load")
    core.update_stats(WorkerStats("w0", running=9, waiting=3))
    core.update_stats(WorkerStats("ghost", running=1))
    assert core.route("r", HASHES, len(PROMPT), 10).worker_id == "w1"
    assert [v.stats.running if v.stats else None for v in core.workers()] == [9, None]
