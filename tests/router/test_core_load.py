"""LoadLedger (booked load, prefill aging, drain rate) and the cost model's waits for room."""

from __future__ import annotations

import pytest

from router.cost_terms import ComputeTerm, CostTerms
from router.estimate import Estimator
from router.load import Booking, LoadLedger
from router.policies import Policy, PolicyConfig, make_policy
from router.views import Decision, RouteRequest, WorkerView
from worker.protocol import WorkerStats


def booking(request_id: str, worker: str = "w0", prefill_s: float = 1.0) -> Booking:
    return Booking(
        request_id, worker, prefill_tokens=1000, decode_tokens=50, active_tokens=1050,
        prefill_s=prefill_s, prefill_done_at=0.0,
    )  # fmt: skip


def test_prefill_queues_fifo_and_ages_out() -> None:
    ledger = LoadLedger()
    ledger.book(booking("a"), now=0.0)
    ledger.book(booking("b"), now=0.5)
    assert ledger.get("b").prefill_done_at == 2.0  # queued behind a
    assert ledger.queue_s("w0", 0.5) == 1.5
    load = ledger.load("w0", 1.2)
    assert (load.requests, load.prefill_tokens, load.decode_tokens) == (2, 1000, 100)
    assert ledger.load("w0", 2.0).prefill_tokens == 0


def test_release_before_the_predicted_end_shortens_the_queue() -> None:
    ledger = LoadLedger()
    ledger.book(booking("a"), now=0.0)
    ledger.book(booking("b"), now=0.0)
    ledger.release("a", now=0.5)  # aborted early: its remaining prefill leaves the queue
    assert ledger.queue_s("w0", 0.5) == pytest.approx(1.0)
    assert ledger.load("w0", 0.5).prefill_tokens == 1000
    ledger.release("b", now=0.6)
    assert ledger.queue_s("w0", 0.6) == 0.0 and ledger.load("w0", 0.6).requests == 0
    assert ledger.release("b", now=0.7) is None


def test_double_booking_is_refused_and_drop_worker_returns_its_bookings() -> None:
    ledger = LoadLedger()
    ledger.book(booking("a"), now=0.0)
    with pytest.raises(ValueError):
        ledger.book(booking("a"), now=0.0)
    ledger.book(booking("b", "w1"), now=0.0)
    assert [b.request_id for b in ledger.drop_worker("w0")] == ["a"]
    assert "a" not in ledger and "b" in ledger and len(ledger) == 1


def test_drain_rate_measures_released_kv_over_a_window() -> None:
    ledger = LoadLedger(drain_window_s=10.0)
    assert ledger.drain_rate("w0", 0.0) == 0.0
    for i in range(4):
        ledger.book(booking(f"r{i}", prefill_s=0.1), now=0.0)
    ledger.release("r0", now=1.0)
    ledger.release("r1", now=2.0)
    assert ledger.drain_rate("w0", 2.0) == pytest.approx(2 * 1050 / 2.0)
    ledger.release("r2", now=12.5)
    assert ledger.drain_rate("w0", 12.5) == pytest.approx(1050 / 10.0)  # r0, r1 left the window


def test_cost_avoids_a_worker_whose_kv_is_full_until_it_drains() -> None:
    policy = make_policy("cost", PolicyConfig(cost=CostTerms(compute=ComputeTerm(weight=0.5))))
    request = RouteRequest("r", 4000, 250, 100, 16)
    full = WorkerStats("w0", kv_total=50_000)
    # w0 holds the prefix but its booked requests overfill its KV by ~53k tokens, which
    # its requests free at ~52k tokens/s (their 100 output tokens at ~19 ms a step); w1 is empty
    busy = WorkerView("w0", full, matched_blocks=240, requests=20, decode_tokens=2000,
                      active_tokens=99_000)  # fmt: skip
    idle = WorkerView("w1", WorkerStats("w1", kv_total=100_000))
    assert choose(policy, request, [busy, idle]).worker_id == "w1"
    busy.drain_tokens_per_s = 1_000_000.0  # requests leave fast: room comes in ~3 ms
    assert choose(policy, request, [busy, idle]).worker_id == "w0"


def choose(
    policy: Policy, request: RouteRequest, views: list[WorkerView]
) -> Decision:
    """`policy.choose` over views with the core's estimate filled in, as `RoutingCore` does."""
    estimator = Estimator()
    request.fleet_tokens_per_s = estimator.fleet.prefill_tokens_per_s
    for view in views:
        view.estimate = estimator.estimate(request, view)
    return policy.choose(request, views)
