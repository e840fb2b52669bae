"""Predicted time to first token of a request on a worker, from the worker's measured speeds.

The model of one engine (continuous batching with chunked prefill): each step computes up to
`prefill_budget` prompt tokens and, alongside, one token of every running request. A request's
first token therefore comes after the prefill queued ahead of it and its own uncached prefill,
both slowed by the decode work that rides along every chunk:

    effective_speed = speed / (1 + decode_step_s * speed / prefill_budget)   (while decoding)
    ttft = queue_s + slot_wait_s + uncached / effective_speed + host_hit / host_load_speed
           + decode_step_s

`slot_wait_s` is the wait for a running slot once `max_running` requests run.

The `cost` policy minimises `scores` = ttft + compute_weight x own prefill time (see there).

`speed` is `WorkerStats.prefill_tokens_per_s` and `decode_step_s` is `WorkerStats.decode_step_s`
once the worker has measured them; until then the priors below stand in (their step time grows
with the running batch). `queue_s` is the larger of the router's booked queue (fresh, this
router only) and the worker's reported waiting prefill (late, every router).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

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
    compute_weight: float = 0.5  # `scores`: seconds of score per second of prefill it adds


class Speeds(NamedTuple):
    """A worker's speeds right now: its load, raw and effective prefill speed, step time."""

    load: int  # running requests, booked or reported (`WorkerView.load`)
    prefill_tokens_per_s: float  # with no decode alongside
    effective_tokens_per_s: float  # with its running requests decoding alongside
    step_s: float  # one decode step of its running batch


class Estimate(NamedTuple):
    """Predicted seconds for one request on one worker; their sum is the TTFT."""

    wait_s: float  # prefill queued ahead + wait for a running slot
    prefill_s: float  # its own prefill, cached prefix skipped, host hit loaded back
    step_s: float  # the step that emits its first token


class CostModel:
    """Time estimates for `cost`, `e2`, booking and the sessions' soft pin."""

    def __init__(self, config: CostConfig | None = None) -> None:
        self.config = config or CostConfig()

    def speeds(self, view: WorkerView) -> Speeds:
        """Measured speeds where the worker reported them, priors otherwise.

        A measured step time covers the batch the worker reported; requests booked since then
        (more than it reported) each add the prior per-request growth.
        """
        return Speeds(*self._speeds(view))

    def estimate(self, request: RouteRequest, view: WorkerView) -> Estimate:
        """The request's predicted wait, own prefill and first step on the worker."""
        return Estimate(*self._estimate(request, view))

    def cached_tokens(self, request: RouteRequest, view: WorkerView) -> tuple[int, int]:
        """(device hit, host hit) in tokens; at least one prompt token is always computed."""
        limit = max(0, request.num_tokens - 1)
        device = min(view.matched_blocks * request.block_size, limit)
        return device, min(view.host_blocks * request.block_size, limit - device)

    def ttft_s(self, request: RouteRequest, view: WorkerView) -> float:
        """Predicted time to the request's first token on the worker."""
        wait, prefill, step = self._estimate(request, view)
        return wait + prefill + step

    def scores(self, request: RouteRequest, views: Sequence[WorkerView]) -> list[float]:
        """What `cost` minimises, per view: TTFT plus `compute_weight` x the prefill it adds.

        TTFT alone is myopic: when two workers promise the same TTFT, recomputing a prefix
        the other holds burns capacity that later requests wait for, and duplicates the prefix.
        """
        weight = 1.0 + self.config.compute_weight
        estimate = self._estimate
        out = []
        for view in views:
            wait, prefill, step = estimate(request, view)
            out.append(wait + weight * prefill + step)
        return out

    # The two below run once per worker per request: plain tuples and no helper calls, for speed.

    def _speeds(self, view: WorkerView) -> tuple[int, float, float, float]:
        cfg, stats, booked = self.config, view.stats, view.requests
        speed, per_request = cfg.prefill_tokens_per_s, cfg.decode_step_per_request_s
        if stats is None:
            load = booked
            step = cfg.decode_step_s + per_request * load
        else:
            reported = stats.running + stats.waiting
            load = booked if booked > reported else reported
            if stats.prefill_tokens_per_s > 0:
                speed = stats.prefill_tokens_per_s
            if stats.decode_step_s > 0:
                step = stats.decode_step_s + per_request * max(0, booked - reported)
            else:
                step = cfg.decode_step_s + per_request * load
        effective = speed if load == 0 else speed / (1.0 + step * speed / cfg.prefill_budget)
        return load, speed, effective, step

    def _estimate(self, request: RouteRequest, view: WorkerView) -> tuple[float, float, float]:
        cfg = self.config
        load, _, effective, step = self._speeds(view)
        limit = request.num_tokens - 1 if request.num_tokens > 0 else 0
        device = view.matched_blocks * request.block_size
        device = device if device < limit else limit
        host = view.host_blocks * request.block_size
        host = host if host < limit - device else limit - device
        prefill = (request.num_tokens - device - host) / effective
        if host:
            prefill += host / cfg.host_load_tokens_per_s
        wait = view.queue_s
        stats = view.stats
        if stats is not None and stats.waiting_prefill_tokens > wait * effective:
            wait = stats.waiting_prefill_tokens / effective
        over = load + 1 - cfg.max_running
        if over > 0:  # a slot frees every (mean output x step) / max_running seconds
            requests = view.requests
            mean_output = view.decode_tokens / requests if requests else request.expected_output
            wait += over * mean_output * step / cfg.max_running
        return wait, prefill, step

    def prefill_s(self, request: RouteRequest, view: WorkerView) -> float:
        """Time of the request's own prefill on the worker, its cached prefix skipped."""
        return self._estimate(request, view)[1]

    def queue_s(self, view: WorkerView) -> float:
        """Time until the prefill queued ahead of a new request (booked or reported) is done."""
        stats = view.stats
        if stats is None or stats.waiting_prefill_tokens <= 0:
            return view.queue_s
        reported = stats.waiting_prefill_tokens / self._speeds(view)[2]
        return max(view.queue_s, reported)

    def eviction_s(self, request: RouteRequest, view: WorkerView) -> float:
        """Recompute time of cached tokens the worker must evict to fit the request (0 when
        it has not reported its KV)."""
        stats = view.stats
        if stats is None or stats.kv_total <= 0:
            return 0.0
        device, _ = self.cached_tokens(request, view)
        need = request.num_tokens - device + request.expected_output
        evicted = min(stats.kv_evictable, max(0, need - stats.kv_free))
        return evicted / self._speeds(view)[1]
