"""Each policy's rule, on hand-made worker views."""

from __future__ import annotations

from collections import Counter

import pytest

from router.routing.candidates import Decision, RouteRequest, WorkerView
from router.routing.cost_terms import ComputeTerm, CostTerms
from router.routing.estimate import EstimateConfig, Estimator
from router.routing.policies import POLICY_NAMES, Policy, PolicyConfig, make_policy
from worker.protocol import WorkerStats


def request(num_tokens: int = 160, expected_output: int = 16) -> RouteRequest:
    return RouteRequest("r", num_tokens, num_tokens // 16, expected_output, 16)


def views(*specs: dict) -> list[WorkerView]:
    return [WorkerView(f"w{i}", **spec) for i, spec in enumerate(specs)]


def choose(
    policy: Policy,
    request: RouteRequest,
    views: list[WorkerView],
    estimate: EstimateConfig | None = None,
) -> Decision:
    """`policy.choose` over views with the core's estimate filled in, as `RoutingCore` does."""
    estimator = Estimator(estimate)
    request.fleet_tokens_per_s = estimator.fleet.prefill_tokens_per_s
    for view in views:
        view.estimate = estimator.estimate(request, view)
    return policy.choose(request, views)


def test_make_policy_knows_every_name_and_rejects_others() -> None:
    assert set(POLICY_NAMES) == {
        "round_robin", "random", "power_of_two", "least_load",
        "cache_aware", "kv_cost", "e2", "cost",
    }  # fmt: skip
    for name in POLICY_NAMES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")


def test_round_robin_cycles() -> None:
    policy = make_policy("round_robin")
    ws = views({}, {}, {})
    assert [choose(policy, request(), ws).worker_id for _ in range(6)] == ["w0", "w1", "w2"] * 2


def test_random_is_seeded_and_covers_workers() -> None:
    ws = views({}, {}, {}, {})
    picks = [choose(make_policy("random", PolicyConfig(seed=3)), request(), ws) for _ in range(3)]
    assert len({d.worker_id for d in picks}) == 1  # same seed, same first pick
    policy = make_policy("random", PolicyConfig(seed=3))
    assert set(Counter(choose(policy, request(), ws).worker_id for _ in range(200))) == {
        "w0", "w1", "w2", "w3",
    }  # fmt: skip


def test_power_of_two_takes_the_less_loaded_of_two() -> None:
    policy = make_policy("power_of_two")
    ws = views({"requests": 5}, {"requests": 1})
    assert all(choose(policy, request(), ws).worker_id == "w1" for _ in range(20))
    ws = views({"requests": 9}, {"requests": 9}, {"requests": 0})
    chosen = Counter(choose(policy, request(), ws).worker_id for _ in range(300))
    assert chosen["w2"] > 150  # picked whenever sampled (2 of 3 draws include it)


def test_least_load_counts_other_routers_load_too() -> None:
    policy = make_policy("least_load")
    busy = WorkerStats("w1", running=4, waiting=3)
    ws = views({"requests": 2}, {"requests": 0, "stats": busy, "foreign_requests": 7},
               {"requests": 1})  # fmt: skip
    decision = choose(policy, request(), ws)
    assert (decision.worker_id, decision.reason) == ("w2", "least_load")


@pytest.mark.parametrize(
    ("loads", "imbalanced"),
    [
        ((100, 30), True),  # 70 > 64 and 100 > 45
        ((100, 40), False),  # 60 <= 64
        ((170, 105), True),  # 65 > 64 and 170 > 157.5
        ((200, 135), False),  # 65 > 64 but 200 <= 202.5
    ],
)
def test_cache_aware_switches_to_least_load_only_when_imbalanced(
    loads: tuple[int, int], imbalanced: bool
) -> None:
    ws = views({"requests": loads[0], "matched_blocks": 8}, {"requests": loads[1]})
    decision = choose(make_policy("cache_aware"), request(), ws)
    expected = ("w1", "least_load") if imbalanced else ("w0", "cache_hit")
    assert (decision.worker_id, decision.reason) == expected


def test_cache_aware_below_match_threshold_takes_the_smallest_cache() -> None:
    policy = make_policy("cache_aware")
    ws = views(
        {"matched_blocks": 3, "cached_blocks": 50}, {"cached_blocks": 10}, {"cached_blocks": 70}
    )
    assert choose(policy, request(), ws).worker_id == "w1"  # 3/10 = 0.3 is not > 0.3
    ws[0].matched_blocks = 4
    decision = choose(policy, request(), ws)
    assert (decision.worker_id, decision.reason) == ("w0", "cache_hit")


def test_kv_cost_weighs_prefill_blocks_against_active_blocks() -> None:
    # w0: 8 of 10 blocks cached but 20 active blocks; w1: nothing cached, idle.
    ws = views({"matched_blocks": 8, "active_tokens": 320}, {})
    # logits: w0 = 1 * 2 + (20 + 11) = 33; w1 = 1 * 10 + 11 = 21
    assert choose(make_policy("kv_cost"), request(), ws).worker_id == "w1"
    heavy = make_policy("kv_cost", PolicyConfig(overlap_weight=4.0))
    # w0 = 4 * 2 + 31 = 39; w1 = 4 * 10 + 11 = 51
    decision = choose(heavy, request(), ws)
    assert (decision.worker_id, decision.reason) == ("w0", "cache_hit")


def test_e2_exploits_a_long_match_and_explores_otherwise() -> None:
    policy = make_policy("e2")
    ws = views({"matched_blocks": 6, "requests": 3, "queue_s": 0.2}, {})
    decision = choose(policy, request(), ws)  # 96 cached > 64 new
    assert (decision.worker_id, decision.reason) == ("w0", "exploit")
    ws[0].matched_blocks = 4  # 64 cached < 96 new
    decision = choose(policy, request(), ws)
    assert (decision.worker_id, decision.reason) == ("w1", "explore")


def test_e2_rebalances_a_request_bound_for_an_overloaded_worker() -> None:
    # Preble's post-assignment rebalancing: the holder of a long prefix would be exploited,
    # but its booked work (2 s of queue) is past 2 x the least load (0) + 1 s
    policy = make_policy("e2")
    ws = views({"matched_blocks": 6, "requests": 3, "queue_s": 2.0}, {}, {"requests": 1})
    decision = choose(policy, request(), ws)
    assert (decision.worker_id, decision.reason) == ("w1", "load_balance")
    ws[0].queue_s = 0.9  # within the floor: exploit as before
    assert choose(policy, request(), ws).reason == "exploit"
    ws[0].queue_s, ws[1].queue_s, ws[2].queue_s = 2.0, 0.6, 0.6  # 2 < 2 x 0.6 + 1
    assert choose(policy, request(), ws).reason == "exploit"


def test_cost_prefers_the_cached_worker_when_idle() -> None:
    ws = views({}, {"matched_blocks": 60}, {"matched_blocks": 20})
    decision = choose(make_policy("cost"), request(1000), ws)
    assert (decision.worker_id, decision.reason) == ("w1", "cache_hit")


def test_cost_trades_locality_for_load_gradually() -> None:
    """The cached worker keeps winning while its queue is short; past the prefill time it saves
    (plus the compute weight) the request goes elsewhere: a soft threshold, not a switch."""
    linear = EstimateConfig(attention_knee_tokens=0)
    policy = make_policy("cost", PolicyConfig(cost=CostTerms(compute=ComputeTerm(weight=0.5))))
    full_prefill_s = 4000 / linear.prefill_tokens_per_s
    chosen = []
    for queue_s in (0.0, 0.25, 0.5, 0.7, 0.8, 1.0, 2.0):
        ws = views({"matched_blocks": 240, "queue_s": queue_s}, {})
        chosen.append(choose(policy, request(4000), ws, linear).worker_id)
    assert chosen == ["w0"] * 4 + ["w1"] * 3
    assert 0.7 < 1.5 * full_prefill_s < 0.8
    default = make_policy("cost")  # a larger compute weight moves the switch, keeps it single

    def switch(other: dict) -> int:
        chosen = []
        for queue_s in range(0, 20):
            ws = views({"matched_blocks": 240, "queue_s": float(queue_s)}, other)
            chosen.append(choose(default, request(4000), ws).worker_id)
        at = chosen.index("w1")
        assert chosen == ["w0"] * at + ["w1"] * (20 - at)
        return at

    busy = switch({"requests": 1})  # w1 decodes: recomputing there delays its requests
    assert busy > 1
    assert 0 < switch({}) < busy  # an idle w1: nobody waits behind the recompute

    # latency first: a decoding w1 with no prefill queued counts as idle too
    latency = CostTerms(compute=ComputeTerm(idle_while_decoding=True))
    default = make_policy("cost", PolicyConfig(cost=latency))
    decoding = switch({"requests": 1})
    assert decoding < busy
    assert switch({"requests": 1, "queue_s": 0.5}) >= busy  # a queue: not idle


def test_cost_values_a_host_hit_between_device_hit_and_miss() -> None:
    policy = make_policy("cost")
    ws = views({"matched_blocks": 240}, {"host_blocks": 240}, {})
    assert choose(policy, request(4000), ws).worker_id == "w0"
    ws[0].queue_s = 2.0  # the device hit is busy: the host hit beats recomputing
    assert choose(policy, request(4000), ws).worker_id == "w1"


def test_cost_uses_measured_speeds() -> None:
    slow = WorkerStats("w0", prefill_tokens_per_s=1000.0, decode_step_s=0.05)
    fast = WorkerStats("w1", prefill_tokens_per_s=50_000.0, decode_step_s=0.01)
    ws = views({"stats": slow, "matched_blocks": 30}, {"stats": fast})
    # w0 computes 520 tokens at 1k/s (0.52 s); w1 all 1000 at 50k/s (0.02 s)
    assert choose(make_policy("cost"), request(1000), ws).worker_id == "w1"


def test_cost_breaks_ties_by_rotation() -> None:
    policy = make_policy("cost")
    ws = views({}, {}, {}, {})
    assert len({choose(policy, request(), ws).worker_id for _ in range(4)}) == 4


@pytest.mark.parametrize("name", ["cost", "least_load", "cache_aware"])
def test_ties_go_to_the_worker_fewer_arrivals_want(name: str) -> None:
    # Two idle workers, nothing cached for this prompt: the new prefix goes where the cached
    # prefixes draw fewer arrivals, whatever the rotation (its followers will come there too).
    policy = make_policy(name)
    for _ in range(4):
        ws = views({"affinity_rate": 0.4}, {"affinity_rate": 0.1})
        assert choose(policy, request(), ws).worker_id == "w1"
    # fewer requests still come first
    ws = views({"affinity_rate": 0.0, "requests": 1}, {"affinity_rate": 0.4})
    assert choose(policy, request(), ws).worker_id == "w1"
