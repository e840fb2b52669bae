"""Predicted time to first token of a request on a worker, from the worker's measured speeds.

The model of one engine (continuous batching with chunked prefill): each step computes up to
`prefill_budget` prompt tokens and, alongside, one token of every running request. A request's
first token therefore comes after the prefill queued ahead of it and its own uncached prefill,
both slowed by the decode work that rides along every chunk:

    effective_speed = speed / (1 + decode_step_s * speed / prefill_budget)   (while decoding)
    ttft = queue_s + slot_wait_s + uncached / effective_speed + host_hit / host_load_speed
           + decode_step_s

`slot_wait_s` is the wait for a running slot once `max_running` requests run.

The `cost` policy minimises `score_s` = ttft + compute_weight x own prefill time (see there).

`speed` is `WorkerStats.prefill_tokens_per_s` and `decode_step_s` is `WorkerStats.decode_step_s`
once the worker has measured them; until then the priors below stand in (their step time grows
with the running batch). `queue_s` is the larger of the router's booked queue (fresh, this
router only) and the worker's reported waiting prefill (late, every router).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.policies import RouteRequest, WorkerView


@dataclass
class CostConfig:
    """Priors used until a worker reports its own speeds, and the engine's step shape."""

    prefill_tokens_per_s: float = 8000.0  # prompt tokens/s of one worker, prior
    decode_step_s: float = 0.015  # time of one decode step with a small batch, prior
    decode_step_per_request_s: float = 0.0002  # prior growth of the step time per running request
    prefill_budget: int = 512  # prompt tokens per engine step (chunked prefill)
    host_load_tokens_per_s: float = 100_000.0  # KV loaded back from the host tier, tokens/s
    max_running: int = 64  # requests a worker runs at once (the engine's default); more wait
    compute_weight: float = 0.5  # `score_s`: seconds of score per second of prefill this adds


class CostModel:
    """Time estimates for `cost`, `e2`, booking and the sessions' soft pin."""

    def __init__(self, config: CostConfig | None = None) -> None:
        self.config = config or CostConfig()

    def prefill_speed(self, view: WorkerView) -> float:
        """Prompt tokens per second of the worker with no decode running alongside."""
        stats = view.stats
        if stats is not None and stats.prefill_tokens_per_s > 0:
            return stats.prefill_tokens_per_s
        return self.config.prefill_tokens_per_s

    def step_s(self, view: WorkerView) -> float:
        """Time of one decode step of the worker's running batch.

        A measured step time covers the batch the worker reported; requests booked since then
        (more than it reported) each add the prior per-request growth.
        """
        cfg, stats = self.config, view.stats
        if stats is not None and stats.decode_step_s > 0:
            unseen = max(0, view.requests - stats.running - stats.waiting)
            return stats.decode_step_s + cfg.decode_step_per_request_s * unseen
        return cfg.decode_step_s + cfg.decode_step_per_request_s * view.load

    def slot_wait_s(self, request: RouteRequest, view: WorkerView) -> float:
        """Wait for a free running slot once the worker runs `max_running` requests: a slot
        frees every (mean booked output x step time) / max_running seconds."""
        over = view.load + 1 - self.config.max_running
        if over <= 0:
            return 0.0
        mean_output = (
            view.decode_tokens / view.requests if view.requests else request.expected_output
        )
        return over * mean_output * self.step_s(view) / self.config.max_running

    def eviction_s(self, request: RouteRequest, view: WorkerView) -> float:
        """Recompute time of cached tokens the worker must evict to fit the request (0 when
        it has not reported its KV)."""
        stats = view.stats
        if stats is None or stats.kv_total <= 0:
            return 0.0
        device, host = self.cached_tokens(request, view)
        need = request.num_tokens - device + request.expected_output
        evicted = min(stats.kv_evictable, max(0, need - stats.kv_free))
        return evicted / self.prefill_speed(view)

    def effective_speed(self, view: WorkerView) -> float:
        """Prompt tokens per second while the worker's running requests decode alongside."""
        speed = self.prefill_speed(view)
        if view.load == 0:
            return speed
        return speed / (1.0 + self.step_s(view) * speed / self.config.prefill_budget)

    def cached_tokens(self, request: RouteRequest, view: WorkerView) -> tuple[int, int]:
        """(device hit, host hit) in tokens; at least one prompt token is always computed."""
        limit = max(0, request.num_tokens - 1)
        device = min(view.matched_blocks * request.block_size, limit)
        host = min(view.host_blocks * request.block_size, limit - device)
        return device, host

    def prefill_s(self, request: RouteRequest, view: WorkerView) -> float:
        """Time of the request's own prefill on the worker, its cached prefix skipped."""
        device, host = self.cached_tokens(request, view)
        uncached = request.num_tokens - device - host
        return uncached / self.effective_speed(view) + host / self.config.host_load_tokens_per_s

    def queue_s(self, view: WorkerView) -> float:
        """Time until the prefill queued ahead of a new request is done."""
        stats = view.stats
        reported = 0.0
        if stats is not None and stats.waiting_prefill_tokens > 0:
            reported = stats.waiting_prefill_tokens / self.effective_speed(view)
        return max(view.queue_s, reported)

    def ttft_s(self, request: RouteRequest, view: WorkerView) -> float:
        """Predicted time to the request's first token on the worker."""
        wait = self.queue_s(view) + self.slot_wait_s(request, view)
        return wait + self.prefill_s(request, view) + self.step_s(view)

    def score_s(self, request: RouteRequest, view: WorkerView) -> float:
        """What `cost` minimises: TTFT plus `compute_weight` x the prefill work it adds.

        TTFT alone is myopic: when two workers promise the same TTFT, recomputing a prefix
        the other holds burns capacity that later requests wait for, and duplicates the prefix.
        """
        own = self.prefill_s(request, view)
        wait = self.queue_s(view) + self.slot_wait_s(request, view)
        return wait + own + self.step_s(view) + self.config.compute_weight * own
