"""The router side of the simulator: the real `RoutingCore` and the stats workers report.

The core, its prefix index and its policy are the live router's own objects, built with the
simulated clock; the cost model's priors come from the same time profile the workers run on,
as a live router's would come from measuring its workers.
"""

from __future__ import annotations

from collections.abc import Callable

from cluster.sim.time_model import TimeProfile, attended_pairs
from cluster.sim.worker import SimWorker
from router.config import cost_config
from router.routing.core import CoreConfig, RoutingCore
from router.routing.estimate import EstimateConfig
from router.routing.policies import PolicyConfig
from worker.protocol import EngineShape, WorkerStats


def prefill_speed(profile: TimeProfile) -> float:
    """Prompt tokens per second of one full prefill chunk with no cached prefix."""
    n = profile.prefill_budget
    return n / profile.step_s(n, attended_pairs(n, 0), 0, 0)


def make_core(
    policy: str,
    clock: Callable[[], float],
    seed: int,
    block_tokens: int,
    profile: TimeProfile,
    cost_overrides: dict | None = None,
) -> RoutingCore:
    """A `RoutingCore` running `policy` on the simulated `clock` (`cost_overrides`: as
    `--cost-config`, on top of the profile's speeds)."""
    priors = EstimateConfig(
        prefill_tokens_per_s=prefill_speed(profile),
        decode_step_s=profile.step_s(0, 0, 1, 0),
        decode_step_per_request_s=profile.token_s,
        attention_knee_tokens=profile.token_s / profile.attn_pair_s,
        host_load_tokens_per_s=1.0 / profile.host_load_token_s,
    )
    estimate, terms = cost_config(cost_overrides, priors)
    config = CoreConfig(
        policy=policy,
        block_size=block_tokens,
        estimate=estimate,
        policies=PolicyConfig(seed=seed, cost=terms),
    )
    return RoutingCore(clock=clock, config=config)


def worker_shape(worker: SimWorker) -> EngineShape:
    """The engine shape the worker reports when it joins."""
    profile = worker.profile
    return EngineShape(
        block_size=worker.block_tokens,
        max_context=1 << 20,
        max_running=profile.max_running,
        prefill_budget=profile.prefill_budget,
    )


def worker_stats(worker: SimWorker, speed_error: float = 1.0) -> WorkerStats:
    """What the worker would report now (KV figures in tokens); its prefill speed times
    `speed_error` (1: exact), as a live engine's measured speed is off by some factor."""
    bt, cache, profile = worker.block_tokens, worker.cache, worker.profile
    context = sum(r.context for r in worker.running)
    free = worker.capacity_blocks - cache.total_size() - worker.reserved
    return WorkerStats(
        worker_id=worker.worker_id,
        kv_total=worker.capacity_blocks * bt,
        kv_free=max(0, free) * bt,
        kv_evictable=cache.evictable_size() * bt,
        kv_protected=cache.protected_size() * bt,
        kv_host_total=worker.host_capacity_blocks * bt,
        kv_host_free=(worker.host_capacity_blocks - cache.host_size()) * bt,
        running=len(worker.running) + len(worker.prefilling),
        waiting=len(worker.waiting),
        waiting_prefill_tokens=worker.queued_prefill_tokens(),
        running_decode_tokens=context,
        prefill_tokens_per_s=prefill_speed(profile) * speed_error,
        decode_step_s=profile.step_s(0, 0, max(1, len(worker.running)), context),
        page_size=1,
        block_size=bt,
        max_context=1 << 20,
        model=profile.name,
    )
