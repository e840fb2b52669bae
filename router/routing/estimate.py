"""What a request would wait for on each worker: the core's estimate, read by every policy.

The model of one engine (continuous batching with chunked prefill): each step computes up to
`prefill_budget` prompt tokens and, alongside, one token of every running request. A request's
first token therefore comes after the prefill queued ahead of it and its own uncached prefill,
both slowed by the decode work that rides along every chunk:

    effective_speed = speed / (1 + decode_step_s * speed / prefill_budget)   (while decoding)
    prefill_s = uncached / effective_speed x (knee + cached + uncached / 2) / (knee + budget / 2)
    ttft = queue_s + room_wait_s + prefill_s + host_hit / host_load_speed + decode_step_s

`room_wait_s` is the wait for a running slot (past `max_running`) or for KV room.
`prefill_budget` and `max_running` are the worker's own (its reported `EngineShape`).

`speed` is `WorkerStats.prefill_tokens_per_s` once the worker has measured it, the fleet's
median until then, and while a figure far off the median rests on little of the worker's own
traffic (`speeds.peer_checked`). `decode_step_s` is the fleet's fit of the step on decode
context, read at the context booked on the worker now (`speeds`); without a fit (one worker,
or all at one context), the worker's measured `WorkerStats.decode_step_s`, else the fleet's
median or prior. `queue_s` is this router's booked queue (fresh) plus the reported waiting
prefill of the requests it did not book (other routers').

`RoutingCore` owns one `Estimator`; it fills `WorkerView.estimate` once per request for every
candidate, books the chosen worker's prefill time, and weighs session pins with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from router.routing.candidates import Estimate, RouteRequest, WorkerView
from router.routing.speeds import FleetSpeeds, denoise, peer_checked
from worker.protocol import WorkerStats


@dataclass
class EstimateConfig:
    """Priors used until the workers report their own speeds, and how reports are read."""

    prefill_tokens_per_s: float = 8000.0  # prompt tokens/s of one worker, prior
    decode_step_s: float = 0.015  # time of one decode step with a small batch, prior
    decode_step_per_request_s: float = 0.0002  # prior growth of the step time per running request
    host_load_tokens_per_s: float = 100_000.0  # KV loaded back from the host tier, tokens/s
    # prefill time per token grows with the context it attends to: at this context, attention
    # costs as much as the rest (~ 6 x hidden size; 30k for Llama 3 8B: 2 x 32 layers x 4096
    # x context FLOPs of attention vs 2 x 8e9 of weights per token); 0: linear prefill
    attention_knee_tokens: float = 30_000.0
    # measured speeds within this fraction of the fleet's median count as the median: workers
    # of one deployment differ by measurement noise, which must not decide where prefixes go
    speed_noise: float = 0.25
    # a prefill speed more than this many times off the fleet's median, measured over fewer
    # than `speed_trust_tokens` of the worker's own traffic, counts as the median
    # (`speeds.peer_checked`: a worker added live under load measures a crowded moment). 32k:
    # some 60 full prefill steps, over which the engine's weighted mean has forgotten its first
    # ones; at 8k a new worker on a loaded 2-core machine was trusted at a third of its peer's
    # speed after 17 requests, and got none again
    speed_outlier: float = 3.0
    speed_trust_tokens: int = 32768
    # the same for the decode step. It also differs with each worker's batch (size, context),
    # and a narrower band (0.1) lets a worker decoding long contexts be seen to prefill slower
    # (Mooncake matrix: better), but then stale reports stack chat sessions (docs/router.md)
    step_noise: float = 0.25
    # True: a worker's step is the fleet's fit of step on decode context (its reports), read
    # at the context booked on the worker now: fresh, where its own measured step is a report
    # late (Mooncake matrix: better; False: the measured step and its band, above)
    step_from_context: bool = True
    # time constant of the rates of arrivals and prompt tokens wanting each worker
    # (`affinity`)
    affinity_window_s: float = 30.0
    # time constant of the fleet's saturation: the share of recent time no worker was free
    # (`bookings.Saturation`)
    saturation_window_s: float = 10.0


class Speeds(NamedTuple):
    """A worker's speeds right now: its load, raw and effective prefill speed, step time."""

    load: int  # running requests: booked here plus other routers' (`WorkerView.load`)
    prefill_tokens_per_s: float  # with no decode alongside
    effective_tokens_per_s: float  # with its running requests decoding alongside
    step_s: float  # one decode step of its running batch


class Estimator:
    """The estimate of a request on a worker (`Estimate`), from the fleet's reports."""

    def __init__(self, config: EstimateConfig | None = None) -> None:
        self.config = config or EstimateConfig()
        # the speeds of a worker that has not measured itself yet, and the step's fit on
        # decode context (`speeds`)
        cfg = self.config
        self.fleet = FleetSpeeds(cfg.prefill_tokens_per_s, cfg.decode_step_s, cfg.step_from_context,
                                 cfg.speed_trust_tokens)

    def observe_fleet(self, stats: Iterable[WorkerStats | None]) -> None:
        """Re-derive the fleet's speeds from the latest reports (`FleetSpeeds.observe`)."""
        self.fleet.observe(stats)

    def speeds(self, view: WorkerView) -> Speeds:
        """Measured speeds where the worker reported them, priors otherwise.

        The step: with `step_from_context` and a fit (`speeds`), the fleet's fit at the
        context booked on the worker now, plus other routers' share of its reported context.
        Otherwise its measured step, which covers the batch it reported; requests booked since
        then (more than it reported) each add the prior per-request growth.
        """
        return Speeds(*self._speeds(view))

    def estimate(self, request: RouteRequest, view: WorkerView) -> Estimate:
        """The request's predicted wait, own prefill and first step on the worker (its prefix
        match and load filled in `view`), with the speeds they come from."""
        return Estimate(*self._estimate(request, view))

    def cached_tokens(self, request: RouteRequest, view: WorkerView) -> tuple[int, int]:
        """(device hit, host hit) in tokens; at least one prompt token is always computed."""
        limit = max(0, request.num_tokens - 1)
        device = min(view.matched_blocks * request.block_size, limit)
        return device, min(view.host_blocks * request.block_size, limit - device)

    # The two below run once per worker per request: plain tuples and no helper calls, for speed.

    def _speeds(self, view: WorkerView) -> tuple[int, float, float, float]:
        cfg, stats, booked, fleet = self.config, view.stats, view.requests, self.fleet
        speed, per_request = fleet.prefill_tokens_per_s, cfg.decode_step_per_request_s
        if stats is None:
            load = booked
            step = fleet.decode_step_s + per_request * load
        else:
            reported = stats.running + stats.waiting
            load = booked + view.foreign_requests
            if stats.prefill_tokens_per_s > 0:
                measured = peer_checked(stats, speed, cfg.speed_outlier, cfg.speed_trust_tokens)
                speed = denoise(measured, speed, cfg.speed_noise)
            if fleet.step_fit is not None:
                intercept, slope = fleet.step_fit
                foreign = view.foreign_requests / reported if reported else 0.0
                context = view.active_tokens + foreign * stats.running_decode_tokens
                step = max(0.5 * fleet.decode_step_s, intercept + slope * context)
            elif stats.decode_step_s > 0:
                measured = denoise(stats.decode_step_s, fleet.decode_step_s, cfg.step_noise)
                step = measured + per_request * max(0, load - reported)
            else:
                step = fleet.decode_step_s + per_request * load
        effective = speed if load == 0 else speed / (1.0 + step * speed / view.prefill_budget)
        return load, speed, effective, step

    def _estimate(
        self, request: RouteRequest, view: WorkerView
    ) -> tuple[float, float, float, float, float, float]:
        cfg = self.config
        load, speed, effective, step = self._speeds(view)
        limit = request.num_tokens - 1 if request.num_tokens > 0 else 0
        device = view.matched_blocks * request.block_size
        device = device if device < limit else limit
        host = view.host_blocks * request.block_size
        host = host if host < limit - device else limit - device
        uncached = request.num_tokens - device - host
        prefill = uncached / effective
        knee = cfg.attention_knee_tokens
        if knee > 0:  # attention: each new token reads its whole prefix; `speed` is measured
            # on chunks of `prefill_budget` tokens, which already pay for their own attention
            prefill *= (knee + device + host + uncached / 2) / (knee + view.prefill_budget / 2)
        if host:
            prefill += host / cfg.host_load_tokens_per_s
        wait = self._queue_s(view, effective)
        wait += self._room_wait_s(request, view, load, step)
        return wait, prefill, step, effective, speed, step + cfg.decode_step_per_request_s

    def _room_wait_s(
        self, request: RouteRequest, view: WorkerView, load: int, step: float
    ) -> float:
        """Wait for a running slot (past `max_running`) or for KV room (past the worker's KV,
        its running requests holding their whole context, a prefix they share held once; the
        request needs room only for what it does not share with them)."""
        requests = view.requests
        if not requests:
            return 0.0
        # a model drain: requests leave after decoding their output (residence), so a slot
        # frees every residence / max_running seconds and booked KV drains at kv / residence
        residence = view.decode_tokens / requests * step
        wait = 0.0
        over = load + 1 - view.max_running
        if over > 0:
            wait = residence * over / view.max_running
        stats = view.stats
        if stats is None or stats.kv_total <= 0:
            return wait
        shared = min(view.held_blocks * request.block_size, request.num_tokens)
        overflow = view.kv_tokens + request.num_tokens - shared + request.expected_output
        overflow -= stats.kv_total - stats.kv_session
        if overflow <= 0:
            return wait
        drain = view.drain_tokens_per_s  # measured: holds however busy the steps are
        if drain <= 0:
            drain = view.kv_tokens / residence if residence > 0 else 0.0
        return max(wait, overflow / drain) if drain > 0 else wait

    def queue_s(self, view: WorkerView) -> float:
        """Time until the prefill queued ahead of a new request is done (see `_queue_s`)."""
        return self._queue_s(view, self._speeds(view)[2])

    def _queue_s(self, view: WorkerView, effective: float) -> float:
        """This router's booked queue, plus the reported waiting prefill of requests it did
        not book (other routers'): the share of the reported requests that were beyond its
        bookings when the stats arrived (`WorkerView.foreign_requests`).

        The reported figure alone would mislead: it is late, and it may count prompt tokens
        that the cache will serve (the worker matches a request only when it admits it).
        """
        stats = view.stats
        if stats is None or stats.waiting_prefill_tokens <= 0:
            return view.queue_s
        foreign = view.foreign_requests / max(1, stats.running + stats.waiting)
        if foreign <= 0:
            return view.queue_s
        return view.queue_s + foreign * stats.waiting_prefill_tokens / effective
