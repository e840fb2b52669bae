"""`cost` weighs the prefill a choice adds less for requests whose best TTFT is long: they make
the TTFT tail, and for them a queue behind the worker that caches half their prompt costs more
than recomputing it.

Same relative situation for both sizes: worker `cached` holds half the prompt behind a queue 5x
the remaining prefill, worker `idle` holds nothing and waits for nothing.
"""

from __future__ import annotations

from router.routing.candidates import RouteRequest, WorkerView
from router.routing.cost_terms import ComputeTerm, CostTerms, scores
from router.routing.estimate import EstimateConfig, Estimator

SPEED = 1000.0  # tokens/s, so a prompt of N tokens takes N / 1000 s


def model(long_ttft_s: float) -> CostTerms:
    """The compute term alone (the others are tested in test_cost_harms.py)."""
    compute = ComputeTerm(weight=16.0, busy_weight=0.0, long_ttft_s=long_ttft_s, long_power=2.0,
                          stall_weight=1e9)  # any request there: the full weight
    return CostTerms.only(compute=compute)


def choice(terms: CostTerms, tokens: int) -> str:
    request = RouteRequest("r", tokens, tokens // 16)
    half_prefill_s = tokens / 2 / SPEED
    views = [
        WorkerView("cached", matched_blocks=tokens // 32, queue_s=5 * half_prefill_s),
        WorkerView("idle", requests=1),  # decoding: not idle, no queue
    ]
    estimator = Estimator(EstimateConfig(prefill_tokens_per_s=SPEED, attention_knee_tokens=0))
    for view in views:
        view.estimate = estimator.estimate(request, view)
    scored = scores(terms, request, views)
    return views[scored.index(min(scored))].worker_id


def test_a_short_request_follows_its_cached_prefix_past_a_queue():
    assert choice(model(long_ttft_s=0.5), 800) == "cached"  # best TTFT 0.8 s


def test_a_long_request_avoids_the_queue_in_front_of_its_cached_prefix():
    assert choice(model(long_ttft_s=0.5), 8000) == "idle"  # best TTFT 8 s


def test_without_the_knob_the_long_request_queued_behind_its_cache():
    assert choice(model(long_ttft_s=0.0), 8000) == "cached"
