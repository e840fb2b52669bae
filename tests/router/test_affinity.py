"""AffinityRates: a decayed count of the arrivals that found their longest prefix on a worker
and a decayed sum of the prompt tokens routed to it; RoutingCore recording the first for the
workers that hold a routed request's longest match, the second for the worker it chose."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mem_cache.events import AllCleared, BlockStored, block_hashes, encode_batch
from router.routing.affinity import AffinityRates
from router.routing.core import RoutingCore

WORKERS = ("a", "b", "c")


def test_one_arrival_decays_with_the_window() -> None:
    rates = AffinityRates(window_s=10.0)
    rates.add(["a"], now=5.0)
    assert rates.rate("a", 5.0) == pytest.approx(0.1)
    assert rates.rate("a", 15.0) == pytest.approx(0.1 / math.e)
    assert rates.rate("b", 15.0) == 0.0


def test_an_arrival_held_by_several_workers_is_shared_and_drop_forgets() -> None:
    rates = AffinityRates(window_s=1.0)
    rates.add(["a", "b"], now=0.0)
    rates.add([], now=0.0)  # no cached prefix anywhere: nobody's
    assert rates.rate("a", 0.0) == rates.rate("b", 0.0) == pytest.approx(0.5)
    rates.drop("a")
    rates.drop("zz")
    assert rates.rate("a", 0.0) == 0.0 and rates.rate("b", 0.0) == pytest.approx(0.5)


def test_a_steady_stream_reads_as_its_rate() -> None:
    rates = AffinityRates(window_s=20.0)
    t = 0.0
    while t < 200.0:  # 2 arrivals/s for 10 windows
        rates.add(["a"], now=t)
        t += 0.5
    assert rates.rate("a", t) == pytest.approx(2.0, rel=0.05)


def test_demand_sums_routed_prompt_tokens_and_decays() -> None:
    rates = AffinityRates(window_s=10.0)
    rates.add_demand("a", 90_000, now=0.0)
    rates.add_demand("a", 10_000, now=0.0)
    rates.add_demand("b", 2_000, now=0.0)
    assert rates.demand("a", 0.0) == pytest.approx(10_000.0)
    assert rates.demand("a", 10.0) == pytest.approx(10_000.0 / math.e)
    assert rates.demand("b", 0.0) == pytest.approx(200.0)
    assert rates.rate("a", 0.0) == 0.0  # routed is not the same as wanted
    rates.drop("a")
    assert rates.demand("a", 0.0) == 0.0 and rates.demand("c", 0.0) == 0.0


def test_the_window_must_be_positive() -> None:
    with pytest.raises(ValueError):
        AffinityRates(window_s=0.0)


arrivals = st.lists(
    st.tuples(
        st.floats(0.0, 50.0, allow_nan=False),
        st.lists(st.sampled_from(WORKERS), unique=True, max_size=3),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(arrivals, st.floats(0.0, 100.0, allow_nan=False))
def test_rates_match_a_direct_sum_over_arrivals(steps, later) -> None:
    rates, window, now, log, routed = AffinityRates(window_s=7.0), 7.0, 0.0, [], []
    for i, (dt, holders) in enumerate(steps):
        now += dt
        rates.add(holders, now)
        log.extend((now, 1.0 / len(holders), w) for w in holders)
        chosen, tokens = WORKERS[i % len(WORKERS)], 100 * (i + 1)
        rates.add_demand(chosen, tokens, now)
        routed.append((now, tokens, chosen))
    end = now + later
    for worker in WORKERS:
        expected = sum(s * math.exp((t - end) / window) for t, s, w in log if w == worker)
        assert rates.rate(worker, end) == pytest.approx(expected / window, abs=1e-9)
        assert rates.rate(worker, end) >= 0.0
        tokens = sum(n * math.exp((t - end) / window) for t, n, w in routed if w == worker)
        assert rates.demand(worker, end) == pytest.approx(tokens / window, rel=1e-9, abs=1e-9)


def test_the_core_records_arrivals_for_the_holders_of_the_longest_match() -> None:
    clock = [0.0]
    core = RoutingCore("cost", lambda: clock[0])
    for w in ("w0", "w1", "w2"):
        core.add_worker(w)
    prompt = list(range(640))
    hashes = block_hashes(prompt)
    core.apply_events(encode_batch("w1", 0, 0, [AllCleared(), BlockStored(hashes, None)]))
    core.apply_events(encode_batch("w2", 0, 0, [AllCleared(), BlockStored(hashes[:8], None)]))
    assert all(v.affinity_rate == 0.0 for v in core.workers())
    core.route("r1", hashes, len(prompt), 10)
    rates = {v.worker_id: v.affinity_rate for v in core.workers()}
    window = core.config.estimate.affinity_window_s
    assert rates == {"w0": 0.0, "w1": pytest.approx(1 / window), "w2": 0.0}
    demand = {v.worker_id: v.demand_tokens_per_s for v in core.workers()}
    chosen = next(w for w, d in demand.items() if d)  # the routed prompt is wanted there next
    assert demand[chosen] == pytest.approx(640 / window) and sum(demand.values()) == demand[chosen]
    core.route("r2", block_hashes([7] * 640), 640, 10)  # cached nowhere: nobody's
    assert core.workers()[1].affinity_rate == pytest.approx(1 / window)
    assert sum(v.demand_tokens_per_s for v in core.workers()) == pytest.approx(1280 / window)
    core.remove_worker("w1")
    core.add_worker("w1")
    assert all(v.affinity_rate == 0.0 for v in core.workers())
    assert next(v for v in core.workers() if v.worker_id == "w1").demand_tokens_per_s == 0.0
