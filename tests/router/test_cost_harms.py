"""The terms `cost` weighs besides a request's own TTFT (`router.routing.cost_terms`): its
TTFT past the tail threshold (not in a backlog), the guard, the compute weight growing with the
share of busy workers, and the delay a long prefill imposes on the requests that want the
worker (affinity and demand). Each test runs a plain compute term (weight 16, nothing else)
plus the term it is about, with that term's own knobs only."""

from __future__ import annotations

from dataclasses import replace

import pytest

from router.routing.candidates import RouteRequest, WorkerView
from router.routing.cost_terms import (
    AffinityTerm,
    ComputeTerm,
    CostTerms,
    DecodeTerm,
    DemandTerm,
    GuardTerm,
    TailTerm,
)
from router.routing.cost_terms import scores as cost_scores
from router.routing.estimate import EstimateConfig, Estimator
from worker.protocol import WorkerStats

SPEED = 1000.0  # tokens/s: a prompt of N uncached tokens takes N / 1000 s
# a worker with any request on it has the full weight (`stall_weight` has its own test)
PLAIN = ComputeTerm(weight=16.0, busy_weight=0.0, backlog_weight=0.0, long_ttft_s=0.0,
                    stall_weight=1e9)


class Model:
    """The given terms on top of the plain compute term, over a linear-prefill estimate."""

    def __init__(self, compute: ComputeTerm | None = PLAIN, **terms: object) -> None:
        self.terms = CostTerms.only(compute=compute, **terms)

    def scores(self, request: RouteRequest, views: list[WorkerView]) -> list[float]:
        estimator = Estimator(EstimateConfig(prefill_tokens_per_s=SPEED, attention_knee_tokens=0))
        request.fleet_tokens_per_s = estimator.fleet.prefill_tokens_per_s
        for view in views:
            view.estimate = estimator.estimate(request, view)
        return cost_scores(self.terms, request, views)


model = Model


def pick(cost_model: Model, request: RouteRequest, views: list[WorkerView]) -> str:
    scores = cost_model.scores(request, views)
    return views[scores.index(min(scores))].worker_id


def tail_case() -> tuple[RouteRequest, list[WorkerView]]:
    """2,000 tokens, 1,500 cached behind a 6 s queue (TTFT 6.5 s) or none on a worker with no
    queue (2 s)."""
    request = RouteRequest("r", 2000, 125, block_size=16)
    free = WorkerView("free", requests=1)  # decoding, no prefill queue
    return request, [WorkerView("cached", matched_blocks=94, queue_s=6.0), free]


def test_without_the_tail_weight_the_request_waits_for_its_cached_prefix() -> None:
    assert pick(model(), *tail_case()) == "cached"


def test_a_wait_into_the_tail_outweighs_the_recompute() -> None:
    assert pick(model(tail_ttft_s=3.0, tail=TailTerm(8.0)), *tail_case()) == "free"


def test_the_tail_weight_leaves_choices_under_the_threshold_alone() -> None:
    assert pick(model(tail_ttft_s=7.0, tail=TailTerm(8.0)), *tail_case()) == "cached"


def test_the_guard_keeps_a_request_from_waiting_far_into_the_tail() -> None:
    # cached: 6.5 s, free: 2 s; whatever the recompute weighs, 6.5 s is past 2 s + 4 s
    heavy = dict(compute=replace(PLAIN, weight=1000.0), tail_ttft_s=4.0)
    assert pick(model(**heavy), *tail_case()) == "cached"
    assert pick(model(**heavy, guard=GuardTerm(4.0)), *tail_case()) == "free"
    assert pick(model(**heavy, guard=GuardTerm(5.0)), *tail_case()) == "cached"  # 6.5 < 2 + 5
    # under the tail threshold the guard does not apply, however far from the best
    assert pick(model(replace(PLAIN, weight=1000.0), tail_ttft_s=7.0, guard=GuardTerm(1.0)),
                *tail_case()) == "cached"  # fmt: skip


def test_in_a_saturated_fleet_a_free_moment_does_not_pull_the_request_off_its_prefix() -> None:
    """The tail case (cached 6.5 s, free 2 s) when no worker has been free for most of the
    recent past (`RouteRequest.saturation`): the free worker will be filled by the next
    arrivals anyway, so the recompute only adds to the work the fleet is behind on."""
    tail = dict(tail_ttft_s=3.0, tail=TailTerm(8.0))
    guard = dict(compute=replace(PLAIN, weight=1000.0), tail_ttft_s=4.0, guard=GuardTerm(4.0))
    for knobs in (tail, guard):
        request, views = tail_case()
        assert pick(model(**knobs), request, views) == "free"  # a lull: as before
        request.saturation = 1.0
        assert pick(model(**knobs), request, views) == "cached"
    # the tail weight scales with the calm share: at 0.75 saturated, 8 x 0.25 x (6.5 - 3)
    # = 7 against a recompute of 16 x 1.5 = 24 + 2 - 6.5: it stays; at 0.25, 21 > 19.5
    request, views = tail_case()
    request.saturation = 0.75
    assert pick(model(**tail), request, views) == "cached"
    request.saturation = 0.25
    assert pick(model(**tail), request, views) == "free"
    # the guard's margin grows as 1 / calm: 6.5 is past 2.07 + 4 / 0.95 (its first step
    # included), not past 2.07 + 4 / 0.8
    request, views = tail_case()
    request.saturation = 0.05
    assert pick(model(**guard), request, views) == "free"
    request.saturation = 0.2
    assert pick(model(**guard), request, views) == "cached"


def test_the_guard_loosens_as_more_workers_are_busy() -> None:
    """With most workers queued, a recompute elsewhere turns into queueing: the guard gives
    `tail_guard_busy_s` x busy share ** 4 more time past the best before it bites."""
    heavy = dict(compute=replace(PLAIN, weight=1000.0), tail_ttft_s=4.0, busy_power=4.0)
    request, views = tail_case()  # cached 6.5 s, free 2 s; one of two workers queued
    queued = [WorkerView(f"q{i}", queue_s=10.0) for i in range(6)]  # 7 of 8 queued
    assert pick(model(**heavy, guard=GuardTerm(4.0)), request, views + queued) == "free"
    loose = model(**heavy, guard=GuardTerm(4.0, busy_s=4.0))
    assert pick(loose, request, views + queued) == "cached"  # 6.5 < 2 + 4 + 4 x 0.59
    assert pick(loose, request, views) == "free"  # 6.5 > 2 + 4 + 4 x 0.06


def backlog_case() -> tuple[RouteRequest, list[WorkerView]]:
    """The tail case in a backlog: 1,500 of 2,000 tokens cached behind a 20 s queue (TTFT
    20.5 s), or none behind a 12 s queue (14 s): no worker starts it before a 4 s tail."""
    request = RouteRequest("r", 2000, 125, block_size=16)
    cached = WorkerView("cached", matched_blocks=94, queue_s=20.0)
    return request, [cached, WorkerView("shorter", queue_s=12.0)]


def test_in_a_backlog_neither_tail_nor_guard_trades_the_prefix_for_a_shorter_queue() -> None:
    knobs = dict(tail_ttft_s=4.0, tail=TailTerm(8.0), guard=GuardTerm(4.0))
    # 20.5 + 16 x 0.5 s of recompute = 28.5 against 14 + 16 x 2 s = 46: it stays (before
    # the backlog rule, the tail term, 8 x (20.5 - 4) against 8 x (14 - 4), and the guard,
    # 20.5 > 14 + 4, both sent it to recompute on the shorter queue)
    assert pick(model(**knobs), *backlog_case()) == "cached"
    # with a worker that starts it before the tail, both apply again
    request, views = backlog_case()
    views[1] = WorkerView("shorter", queue_s=1.0)
    assert pick(model(**knobs), request, views) == "shorter"
    assert pick(model(replace(PLAIN, weight=1000.0), tail_ttft_s=4.0, guard=GuardTerm(4.0)),
                request, views) == "shorter"  # fmt: skip


def test_a_worker_is_idle_only_when_its_own_last_report_shows_it_empty_too() -> None:
    """2,000 tokens, 1,504 cached behind a 3 s queue (TTFT 3.5 s), or none on a worker this
    router has nothing booked on (2 s): at the idle weight the recompute costs 2 + 0.5 x 2."""
    request = RouteRequest("r", 2000, 125, block_size=16)
    cached = WorkerView("cached", matched_blocks=94, queue_s=3.0, requests=3)
    knobs = dict(compute=replace(PLAIN, idle_weight=0.5))
    empty = WorkerView("free", stats=WorkerStats("free"))
    assert pick(model(**knobs), request, [cached, empty]) == "free"  # 3 < 3.5 + 16 x 0.5
    between = WorkerView("free", stats=WorkerStats("free", running=2))  # released since
    assert pick(model(**knobs), request, [cached, between]) == "cached"  # 2 + 16 x 2 > 11.4


def test_a_prefix_holder_that_only_decodes_weighs_its_prefill_by_what_it_stalls() -> None:
    """768 of 896 tokens cached on a worker decoding R requests with nothing queued (remainder
    128 tokens: 0.128 s), or a whole recompute on an idle worker (0.896 s at `idle_weight` 2:
    2.69 s of score). With one request decoding, the remainder stalls that one: weight 2 + 4 x 1
    (0.9 s), and the holder keeps its prefix. A live run lost these hits to the full weight,
    24 x 0.128 + 0.14 = 3.2 s; with six decoding, the full weight applies again, and so it does
    with a `stall_weight` too large to matter."""
    request = RouteRequest("r", 896, 56, block_size=16)

    def views(running: int) -> list[WorkerView]:
        return [WorkerView("holder", matched_blocks=48, requests=running), WorkerView("idle")]

    compute = ComputeTerm(busy_weight=0.0, backlog_weight=0.0, long_ttft_s=0.0, idle_weight=2.0,
                          stall_weight=4.0)  # weight 24: 24 x the prefill on a busy worker
    assert pick(model(compute), request, views(1)) == "holder"
    assert pick(model(compute), request, views(6)) == "idle"
    assert pick(model(replace(compute, stall_weight=1e9)), request, views(1)) == "idle"
    # the same while the holder still prefills its one request for 0.2 s (busy share 1/2)
    queued = [WorkerView("holder", matched_blocks=48, requests=1, queue_s=0.2), WorkerView("idle")]
    assert pick(model(replace(compute, busy_weight=4.0)), request, queued) == "holder"
    full = replace(compute, busy_weight=4.0, stall_weight=1e9)
    assert pick(model(full), request, queued) == "idle"  # 0.128 x 30 + 0.34 > 0.896 x 3


def busy_case(others_queue_s: float) -> tuple[RouteRequest, list[WorkerView]]:
    """1,000 tokens, half cached on a worker 10 s behind; seven others hold nothing."""
    request = RouteRequest("r", 1000, 62, block_size=16)
    views = [WorkerView("cached", matched_blocks=31, queue_s=10.0)]
    views += [WorkerView(f"w{i}", queue_s=others_queue_s) for i in range(7)]
    return request, views


def test_with_idle_workers_around_the_request_leaves_its_busy_cached_worker() -> None:
    busy = model(replace(PLAIN, busy_weight=3.0), busy_power=4.0)
    assert pick(busy, *busy_case(others_queue_s=0.0)) != "cached"


def test_when_every_worker_is_busy_the_recompute_costs_more_and_it_stays() -> None:
    busy = model(replace(PLAIN, busy_weight=3.0), busy_power=4.0)
    assert pick(busy, *busy_case(others_queue_s=0.5)) == "cached"
    assert pick(model(), *busy_case(others_queue_s=0.5)) != "cached"  # the busy share decides


def affinity_case(queue_a: float, queue_b: float) -> tuple[RouteRequest, list[WorkerView]]:
    """10,000 uncached tokens (10 s of prefill); `a` holds live conversations (1 arrival/s
    wants it), `b` holds none."""
    request = RouteRequest("r", 10_000, 625, block_size=16)
    return request, [
        WorkerView("a", queue_s=queue_a, affinity_rate=1.0),
        WorkerView("b", queue_s=queue_b, affinity_rate=0.0),
    ]


def test_a_long_prefill_goes_where_fewer_requests_want_the_worker() -> None:
    case = affinity_case(queue_a=0.1, queue_b=0.6)
    assert pick(model(affinity=AffinityTerm(4.0)), *case) == "b"
    assert pick(model(), *case) == "a"  # else: the shorter queue


def test_with_no_busy_worker_the_affinity_harm_is_zero() -> None:
    request, views = affinity_case(queue_a=0.0, queue_b=0.0)
    with_harm = model(affinity=AffinityTerm(4.0)).scores(request, views)
    assert with_harm == model().scores(request, views)


def demand_case(queue_s: float) -> tuple[RouteRequest, list[WorkerView]]:
    """5,000 uncached tokens (5 s of prefill). Every worker gets one arrival/s; `a` was sent
    60k-token conversations lately (2,000 tokens/s over the 30 s window: their next turns
    would recompute 2 s each elsewhere), `b` only 2k-token prompts, `c` nothing (its cache is
    an old one) but it has a long queue. `b`'s queue is a little longer than `a`'s."""
    request = RouteRequest("r", 5_000, 313, block_size=16)
    return request, [
        WorkerView("a", queue_s=queue_s, affinity_rate=1.0, demand_tokens_per_s=2_000.0),
        WorkerView("b", queue_s=queue_s + 0.3, affinity_rate=1.0, demand_tokens_per_s=70.0),
        WorkerView("c", queue_s=10.0, affinity_rate=1.0),
    ]


def demand_harm(request: RouteRequest, views: list[WorkerView]) -> list[float]:
    with_demand = model(demand=DemandTerm(2.0)).scores(request, views)
    return [d - p for d, p in zip(with_demand, model().scores(request, views), strict=True)]


def test_a_long_prefill_goes_where_the_waiting_turns_hold_less() -> None:
    case = demand_case(queue_s=0.1)
    assert pick(model(affinity=AffinityTerm(4.0)), *case) == "a"  # same arrival rate: shorter queue
    assert pick(model(affinity=AffinityTerm(4.0), demand=DemandTerm(2.0)), *case) == "b"


def test_the_demand_harm_is_the_recompute_at_risk_capped_by_the_wait() -> None:
    request, views = demand_case(queue_s=0.1)
    harm = demand_harm(request, views)  # every worker has a queue: share 1
    assert harm[0] == pytest.approx(2.0 * 5.0 * 2_000.0 / SPEED)  # under the wait of 2.5 s each
    assert harm[1] == pytest.approx(2.0 * 5.0 * 70.0 / SPEED)
    assert harm[2] == 0.0  # nothing routed there lately
    views[2].queue_s = 0.0  # one of three idle: a third less harm
    assert demand_harm(request, views)[0] == pytest.approx(2.0 * (2 / 3) * 5.0 * 2.0)
    short = RouteRequest("short", 200, 13, block_size=16)  # 0.2 s: each turn waits 0.1 s
    assert demand_harm(short, views)[0] == pytest.approx(2.0 * (2 / 3) * 0.2 * 0.1)
    views[0].matched_blocks = 312  # all but one block cached on `a`: no prefill, no harm
    assert 0.0 < demand_harm(request, views)[0] < harm[0] / 1000


def test_the_decode_term_adds_the_answers_decode_time_there() -> None:
    """No prefix anywhere; one worker decodes a batch (a longer step). The decode term adds
    `weight` x expected output x the step once the request joins, on each worker."""
    request = RouteRequest("r", 1000, 62, expected_output=1000, block_size=16)
    stats = WorkerStats("batch", running=8, decode_step_s=0.05)
    views = [WorkerView("batch", stats=stats), WorkerView("free", stats=WorkerStats("free"))]
    plain = model(compute=None).scores(request, views)
    with_decode = model(compute=None, decode=DecodeTerm(0.25)).scores(request, views)
    for view, without, scored in zip(views, plain, with_decode, strict=True):
        assert scored - without == pytest.approx(0.25 * 1000 * view.estimate.joined_step_s)
    assert with_decode[1] - plain[1] < with_decode[0] - plain[0]  # the batch steps slower


def test_the_backlog_raises_the_compute_weight() -> None:
    """1,000 tokens, half cached on a worker 10 s behind, none on one 4 s behind: every worker
    has a wait (rho = 4 s), so recomputing adds to the backlog: with `backlog_weight` the
    request stays with its prefix."""
    request = RouteRequest("r", 1000, 62, block_size=16)
    views = [WorkerView("cached", matched_blocks=31, queue_s=10.0), WorkerView("b", queue_s=4.0)]
    assert pick(model(replace(PLAIN, weight=1.0)), request, views) == "b"
    heavy = model(replace(PLAIN, weight=1.0, backlog_weight=4.0))
    assert pick(heavy, request, views) == "cached"
