"""A worker's decode step from the fleet's fit of step on decode context (`step_from_context`).

A decode step reads every running request's KV, so a worker decoding long contexts steps
slower, and every prefill chunk that rides along with its decode is slower too. Each worker's
own measurement is late (a report interval) and noisy; the fit over the fleet's reports, read
at the context booked on each worker now, is neither.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mem_cache.events import block_hashes
from router.routing.core import CoreConfig, RoutingCore
from router.routing.estimate import EstimateConfig, Estimator
from worker.protocol import WorkerStats

BASE_S, PER_TOKEN_S = 0.006, 5e-8  # a step of 6 ms + 50 ms per million context tokens


def report(worker_id: str, context: int, running: int = 4) -> WorkerStats:
    step = BASE_S + PER_TOKEN_S * context
    return WorkerStats(
        worker_id,
        running=running,
        running_decode_tokens=context,
        decode_step_s=step,
        prefill_tokens_per_s=20_000.0,
    )


def core_with(contexts: dict[str, int], **cost: object) -> RoutingCore:
    config = EstimateConfig(**{"step_from_context": True, **cost})  # type: ignore[arg-type]
    core = RoutingCore(config=CoreConfig(estimate=config))
    for worker_id, context in contexts.items():
        core.add_worker(worker_id, report(worker_id, context))
    return core


def steps(core: RoutingCore) -> dict[str, float]:
    return {v.worker_id: core.estimator.speeds(v).step_s for v in core.workers()}


@given(
    base=st.floats(0.001, 0.05),
    per_token=st.floats(0.0, 1e-6),
    contexts=st.lists(st.integers(0, 2_000_000), min_size=2, max_size=16, unique=True),
)
def test_the_fit_recovers_steps_that_grow_linearly_with_context(
    base: float, per_token: float, contexts: list[int]
) -> None:
    model = Estimator(EstimateConfig(step_from_context=True))
    model.observe_fleet(
        WorkerStats(f"w{i}", running_decode_tokens=c, decode_step_s=base + per_token * c)
        for i, c in enumerate(contexts)
    )
    assert model.fleet.step_fit is not None
    intercept, slope = model.fleet.step_fit
    assert slope == pytest.approx(per_token, rel=1e-6, abs=1e-12)
    assert intercept == pytest.approx(base, rel=1e-6, abs=1e-9)


@given(
    points=st.lists(
        st.tuples(st.integers(0, 1_000_000), st.floats(1e-4, 0.1)), min_size=1, max_size=16
    )
)
def test_the_fit_never_has_a_step_that_shrinks_with_context(
    points: list[tuple[int, float]],
) -> None:
    model = Estimator(EstimateConfig(step_from_context=True))
    model.observe_fleet(
        WorkerStats(f"w{i}", running_decode_tokens=c, decode_step_s=s)
        for i, (c, s) in enumerate(points)
    )
    if len({c for c, _ in points}) < 2:
        assert model.fleet.step_fit is None  # nothing to fit: each worker's own step stands
    else:
        assert model.fleet.step_fit is not None and model.fleet.step_fit[1] >= 0.0


def test_each_worker_is_read_at_its_own_reported_context() -> None:
    core = core_with({"a": 80_000, "b": 100_000, "c": 120_000})
    assert steps(core) == pytest.approx({"a": 0.010, "b": 0.011, "c": 0.012})


def test_without_the_fit_the_noise_band_hides_the_same_differences() -> None:
    core = core_with({"a": 80_000, "b": 100_000, "c": 120_000}, step_from_context=False)
    assert steps(core) == pytest.approx({"a": 0.011, "b": 0.011, "c": 0.011})


def test_a_booking_slows_its_worker_before_the_next_report() -> None:
    """The measured step would stay as reported until the worker reports again; the fit reads
    the context booked there now, so a long conversation routed to a worker counts at once."""
    core = core_with({"a": 50_000, "b": 50_000, "c": 150_000})
    before = steps(core)
    assert before["a"] == pytest.approx(before["b"])
    prompt = list(range(100_000))
    worker = core.route("long", block_hashes(prompt), len(prompt), 256).worker_id
    assert worker in ("a", "b")
    other = "b" if worker == "a" else "a"
    after = steps(core)
    assert after[worker] > after[other] + 100_000 * PER_TOKEN_S * 0.9
    assert after[other] == pytest.approx(before[other])
    # the next long prompt goes where fewer context tokens decode alongside its chunks
    second = list(range(200_000, 230_000))
    assert core.route("next", block_hashes(second), len(second), 16).worker_id == other
    core.finish("long")
    assert steps(core)[worker] == pytest.approx(before[worker])


def test_new_conversations_fill_the_gap_then_spread() -> None:
    """Between two reports, the worker that reported the shortest step takes new sessions
    until the context booked on it catches up (20k tokens: about 4.6 sessions of 4,352),
    not every session until it reports again."""
    core = core_with({"a": 40_000, "b": 60_000, "c": 60_000, "d": 60_000})
    chosen = []
    for i in range(16):
        prompt = [10_000 * (i + 1) + t for t in range(4_096)]
        chosen.append(core.route(f"s{i}", block_hashes(prompt), len(prompt), 256).worker_id)
    assert chosen[0] == "a"
    assert 4 <= chosen.count("a") <= 6
    assert all(chosen.count(w) >= 3 for w in "bcd")
