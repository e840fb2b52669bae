"""Stats arrive late (a poll interval, a wire delay): the router's own bookings are fresher.

A worker's reported requests beyond this router's bookings are other routers' (`foreign`),
counted when the stats arrive and held until the next ones. The bug this guards against: the
load was max(booked, reported), so each request that finished after a report kept counting,
with its share of the reported prefill queue, until the next report; the idle worker looked
busy and lost requests to a busier one.
"""

from __future__ import annotations

import pytest

from mem_cache.events import block_hashes
from router.routing.core import RoutingCore
from worker.protocol import WorkerStats


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def prompt_hashes(i: int, n: int = 1024) -> tuple[list[int], int]:
    return block_hashes([100_000 * (i + 1) + t for t in range(n)]), n


def view(core: RoutingCore, worker_id: str):
    return next(v for v in core.workers() if v.worker_id == worker_id)


def test_finished_requests_do_not_linger_as_load_until_the_next_report() -> None:
    core = RoutingCore("least_load", Clock())
    core.add_worker("w0")
    for i in range(3):
        core.route(f"r{i}", *prompt_hashes(i), 16)
    core.update_stats(WorkerStats("w0", running=2, waiting=1, waiting_prefill_tokens=1024))
    assert (view(core, "w0").load, view(core, "w0").foreign_requests) == (3, 0)
    for i in range(3):
        core.finish(f"r{i}", cached_tokens=0)
    w0 = view(core, "w0")
    assert w0.load == 0 and core.estimator.queue_s(w0) == 0.0


def test_other_routers_requests_count_on_top_of_fresh_bookings() -> None:
    core = RoutingCore("least_load", Clock())
    core.add_worker("w0")
    core.add_worker("w1")
    core.route("mine", *prompt_hashes(0), 16)  # least_load's tie goes to w0
    stats = WorkerStats("w0", running=3, waiting=2, waiting_prefill_tokens=8000,
                        prefill_tokens_per_s=8000.0, decode_step_s=0.01)  # fmt: skip
    core.update_stats(stats)  # 5 reported, 1 booked here: 4 are another router's
    core.update_stats(WorkerStats("w1", running=3, prefill_tokens_per_s=8000.0))
    w0 = view(core, "w0")
    assert (w0.requests, w0.foreign_requests, w0.load) == (1, 4, 5)
    # the other router's share (4 of 5) of the reported queue adds to this router's own
    effective = core.estimator.speeds(w0).effective_tokens_per_s
    assert core.estimator.queue_s(w0) == pytest.approx(w0.queue_s + 0.8 * 8000 / effective)
    core.finish("mine", cached_tokens=0)
    assert view(core, "w0").load == 4  # the foreign requests stay until the next report
    # w1 reported 3 requests, none booked here; w0 has 4 foreign: w1 gets the next request
    assert core.route("next", *prompt_hashes(1), 16).worker_id == "w1"
    core.update_stats(WorkerStats("w0"))  # the next report: w0 is empty
    assert view(core, "w0").load == 0
