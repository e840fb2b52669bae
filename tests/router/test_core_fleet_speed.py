"""`cost` must not let one worker's measured speed, against a fresh worker's prior or a twin's
measurement noise, decide where new prefixes go; a decode step slowed by a worker's batch is
not noise.

The bug: on CPU a measured worker (faster than the H100-class prior) looked faster than a fresh
one, so every new prefix of a sequential workload piled onto it and the other worker idled.
"""

from __future__ import annotations

from collections import Counter

from mem_cache.events import block_hashes
from router.routing.core import CoreConfig, RoutingCore
from router.routing.estimate import EstimateConfig
from worker.protocol import WorkerStats


def route_distinct_prefixes(core: RoutingCore, n: int) -> Counter[str]:
    """Sequential requests on n unrelated 512-token prompts; each finishes before the next."""
    chosen: Counter[str] = Counter()
    for i in range(n):
        prompt = [1000 * (i + 1) + t for t in range(512)]
        decision = core.route(f"r{i}", block_hashes(prompt), len(prompt), 16)
        core.finish(f"r{i}", cached_tokens=0)
        chosen[decision.worker_id] += 1
    return chosen


def test_a_fresh_worker_is_assumed_as_fast_as_its_measured_peers() -> None:
    core = RoutingCore("cost")
    core.add_worker("w0", WorkerStats("w0", prefill_tokens_per_s=60_000.0, decode_step_s=0.002))
    core.add_worker("w1")  # not measured yet
    assert route_distinct_prefixes(core, 8) == Counter({"w0": 4, "w1": 4})


def test_measurement_noise_between_twins_does_not_decide_placement() -> None:
    core = RoutingCore("cost")
    core.add_worker("w0", WorkerStats("w0", prefill_tokens_per_s=20_000.0, decode_step_s=0.010))
    core.add_worker("w1", WorkerStats("w1", prefill_tokens_per_s=22_000.0, decode_step_s=0.011))
    assert route_distinct_prefixes(core, 8) == Counter({"w0": 4, "w1": 4})


def test_a_really_faster_worker_still_wins_new_prefixes() -> None:
    core = RoutingCore("cost")
    core.add_worker("w0", WorkerStats("w0", prefill_tokens_per_s=5_000.0, decode_step_s=0.010))
    core.add_worker("w1", WorkerStats("w1", prefill_tokens_per_s=15_000.0, decode_step_s=0.010))
    assert route_distinct_prefixes(core, 6) == Counter({"w1": 6})


def two_busy_workers(step_noise: float) -> RoutingCore:
    """Same batch size; "long" decodes longer contexts (a 33% slower step than "short")."""
    core = RoutingCore(config=CoreConfig(estimate=EstimateConfig(step_noise=step_noise)))
    busy = {"running": 8, "prefill_tokens_per_s": 20_000.0}
    core.add_worker("long", WorkerStats("long", decode_step_s=0.020, **busy))
    core.add_worker("short", WorkerStats("short", decode_step_s=0.015, **busy))
    return core


def test_past_step_noise_a_worker_decoding_long_contexts_is_seen_to_prefill_slower() -> None:
    """Decode step times differ with each worker's batch, not only by noise. Past
    `step_noise` of the median the measured step counts, and a long new prompt goes where
    fewer context tokens decode alongside its chunks."""
    core = two_busy_workers(step_noise=0.1)
    steps = {v.worker_id: core.estimator.speeds(v).step_s for v in core.workers()}
    assert steps == {"long": 0.020, "short": 0.015}
    prompt = list(range(30_000))
    assert core.route("r", block_hashes(prompt), len(prompt), 16).worker_id == "short"


def test_within_the_default_step_noise_both_count_as_the_median() -> None:
    # 25%: a narrower band stacked chat sessions on stale reports (docs/benchmarks.md)
    core = two_busy_workers(step_noise=EstimateConfig().step_noise)
    steps = {v.worker_id: core.estimator.speeds(v).step_s for v in core.workers()}
    assert steps == {"long": 0.0175, "short": 0.0175}
