"""The fleet's saturation (`router.routing.bookings.Saturation`): the decayed share of the recent
past in which no worker was free, as `RoutingCore` observes it at each decision and hands it to the
policy (`RouteRequest.saturation`)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mem_cache.events import block_hashes
from router.routing.bookings import Saturation
from router.routing.candidates import Decision, RouteRequest, WorkerView
from router.routing.core import RoutingCore
from router.routing.policies import Policy


def test_each_decision_says_how_long_every_worker_stays_busy() -> None:
    sat = Saturation(window_s=10.0)
    assert sat.observe(30.0, 100.0) == 0.0  # the first observation: nothing seen before it
    # every worker busy for 30 s from 100; at 110 all 10 s were saturated: 1 - e^-1
    assert sat.observe(0.0, 110.0) == pytest.approx(1 - math.exp(-1))
    # some worker free from 110 (least wait 0): the saturated time decays
    assert sat.observe(4.0, 120.0) == pytest.approx((1 - math.exp(-1)) * math.exp(-1))
    # busy for 4 of the next 10 s: that span, 6 to 10 s ago
    after = (1 - math.exp(-1)) * math.exp(-2) + math.exp(-0.6) - math.exp(-1)
    assert sat.observe(0.0, 130.0) == pytest.approx(after)
    # a clock that steps back (another thread's earlier time) changes nothing
    assert sat.observe(50.0, 125.0) == pytest.approx(after)
    assert sat.observe(1e9, 130.0) == pytest.approx(after)  # nothing elapsed since 130
    assert sat.observe(1e9, 1e6) == pytest.approx(1.0)  # saturated for ever
    with pytest.raises(ValueError, match="window_s"):
        Saturation(window_s=0)


@given(st.lists(st.tuples(st.floats(0.0, 20.0), st.floats(0.0, 30.0)), max_size=40))
def test_the_value_is_the_decayed_share_of_saturated_time(steps: list[tuple[float, float]]) -> None:
    """Against the integral over the busy spans: [t, t + min(least wait, time to the next
    observation)], each instant weighing e^-(age / window)."""
    window = 5.0
    sat = Saturation(window)
    now, spans, busy = 0.0, [], 0.0
    value = sat.observe(0.0, now)
    for least_wait, dt in steps:
        spans.append((now, now + min(busy, dt)))
        now += dt
        value = sat.observe(least_wait, now)
        busy = least_wait
    expected = sum(math.exp((b - now) / window) - math.exp((a - now) / window) for a, b in spans)
    assert 0.0 <= value <= 1.0 + 1e-12
    assert value == pytest.approx(expected, abs=1e-9)


class Spy(Policy):
    """Records the saturation each request was routed with; picks the first worker (a stand-in
    policy: these tests are about what the core hands every policy)."""

    name = "spy"

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[float] = []

    def choose(self, request: RouteRequest, workers: list[WorkerView]) -> Decision:  # type: ignore[override]
        self.seen.append(request.saturation)
        return Decision(workers[len(self.seen) % len(workers)].worker_id, "spy")


def test_the_core_reports_a_fleet_whose_every_worker_keeps_a_queue() -> None:
    clock = [0.0]
    spy = Spy()
    core = RoutingCore(spy, lambda: clock[0])
    core.add_worker("w0")
    core.add_worker("w1")
    prompt = list(range(4000))  # 4,000 uncached tokens: seconds of queue at the prior speed
    for i in range(40):  # a request every 0.1 s onto alternate workers: both keep a queue
        core.route(f"r{i}", block_hashes(prompt, f"n{i}"), len(prompt), 16)
        clock[0] += 0.1
    window = core.config.estimate.saturation_window_s
    assert spy.seen[0] == 0.0
    assert spy.seen[-1] > 0.9 * (1 - math.exp(-3.8 / window))  # saturated since ~0.1 s
    # a lull: nothing arrives for two windows, the queues (under a window: predicted) drain;
    # the next request sees the saturated share decayed, not the last state held through it
    assert min(v.queue_s for v in core.workers()) < window
    clock[0] += 2 * window
    core.route("after", block_hashes(prompt, "after"), len(prompt), 16)
    held = spy.seen[-2] * math.exp(-2) + 1 - math.exp(-2)  # had the fleet stayed saturated
    assert spy.seen[-2] * math.exp(-2) < spy.seen[-1] < 0.9 * spy.seen[-2] < held
