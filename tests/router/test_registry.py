"""WorkerRegistry: one record per worker; membership changes that every listener follows; the
engine shape a worker reports; in-flight counts on the record they began on."""

from __future__ import annotations

import pytest

from mem_cache.events import AllCleared, BlockStored, block_hashes, encode_batch
from router.routing.candidates import RouteRequest
from router.routing.core import RoutingCore
from router.routing.registry import DEAD, DRAINING, READY, WorkerRegistry, WorkerState
from worker.protocol import EngineShape, WorkerStats

HASHES = block_hashes(list(range(160)))


class Recorder:
    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    def worker_joined(self, worker: WorkerState) -> None:
        self.log.append(("joined", worker.worker_id))

    def worker_left(self, worker_id: str) -> None:
        self.log.append(("left", worker_id))


def test_membership_changes_reach_every_listener_once() -> None:
    registry, recorder = WorkerRegistry(), Recorder()
    registry.subscribe(recorder)
    registry.add("a")
    registry.add("b")
    registry.set_draining("a")
    assert [w.worker_id for w in registry.routable()] == ["b"]
    assert registry["a"].state == DRAINING and len(registry.live()) == 2
    assert registry.mark_dead("b") and not registry.mark_dead("b")  # once
    assert registry["b"].state == DEAD and "b" in registry
    registry.remove("b")  # a dead worker has left already: no second notice
    registry.add("a")  # re-added: the old record leaves first
    assert recorder.log == [
        ("joined", "a"), ("joined", "b"), ("left", "b"), ("left", "a"), ("joined", "a"),
    ]  # fmt: skip
    assert registry["a"].state == READY
    with pytest.raises(KeyError):
        registry.set_draining("zz")


def test_removing_a_worker_is_one_call_the_core_follows() -> None:
    core = RoutingCore("cost")
    core.add_worker("w0")
    core.add_worker("w1", WorkerStats("w1", running=3, prefill_tokens_per_s=4000.0))
    core.apply_events(encode_batch("w1", 0, 0, [AllCleared(), BlockStored(HASHES, None)]))
    core.route("r", HASHES, 160, 8, session_id="s")
    assert core.estimator.fleet.prefill_tokens_per_s == 4000.0
    core.registry.mark_dead("w1")  # what a failed request or poll does
    assert core.index_blocks() == 0 and len(core.ledger) == 0 and core.sessions.get("s") is None
    assert core.estimator.fleet.prefill_tokens_per_s == 8000.0  # the prior again
    assert core.route("r2", HASHES, 160, 8).worker_id == "w0"
    core.update_stats(WorkerStats("w1", running=9))  # a late report of a dead worker
    assert core.registry["w1"].stats.running == 3


def test_the_shape_is_what_the_worker_reports_with_defaults_for_the_rest() -> None:
    assert EngineShape.from_info({"model": "m", "max_context": 4096, "block_size": None}) == (
        EngineShape(max_context=4096)
    )
    reported = {"block_size": 32, "max_running": 8, "prefill_budget": 2048, "page_size": 16}
    shape = EngineShape.from_info(reported)
    assert (shape.block_size, shape.max_running, shape.prefill_budget) == (32, 8, 2048)
    assert EngineShape.from_info({}, EngineShape(block_size=64)).block_size == 64
    registry = WorkerRegistry()
    assert registry.block_size == 16 and registry.max_context() is None
    registry.add("a", shape)
    registry.add("b", EngineShape.from_info({"max_context": 2048}))
    assert registry.max_context() == 2048 and registry["a"].shape.max_running == 8
    registry.mark_dead("b")
    assert registry.max_context() is None  # a dead worker's context does not count


def test_a_workers_own_shape_reaches_its_estimate() -> None:
    """The same bookings on two workers: the one that runs 2 requests at once makes a new
    request wait for a slot; the one that runs 64 does not."""
    core = RoutingCore("cost", clock=lambda: 0.0)
    core.add_worker("small", shape=EngineShape(max_running=2))
    core.add_worker("large", shape=EngineShape(max_running=64))
    for i in range(4):
        for worker, other in (("small", "large"), ("large", "small")):
            prompt = block_hashes(list(range(i * 1000, i * 1000 + 160)), worker)
            core.route(f"{worker}{i}", prompt, 160, 100, exclude={other})
    request = RouteRequest("new", 160, 10, 100)
    waits = {v.worker_id: core.estimator.estimate(request, v).wait_s for v in core.workers()}
    queues = {v.worker_id: v.queue_s for v in core.workers()}
    assert queues["small"] == queues["large"]
    assert waits["small"] > waits["large"] == queues["large"]


def test_in_flight_ends_on_the_record_it_began_on() -> None:
    registry = WorkerRegistry()
    registry.add("a")
    old = registry.begin("a")
    registry.add("a")  # restarted: a fresh record
    registry.end(old)
    assert registry["a"].in_flight == 0 and old.in_flight == 0
    registry.end(registry.begin("a"))
    assert registry["a"].in_flight == 0
