"""Predicted time to first token of a request on a worker, from the worker's measured speeds.

The model of one engine (continuous batching with chunked prefill): each step computes up to
`prefill_budget` prompt tokens and, alongside, one token of every running request. A request's
first token therefore comes after the prefill queued ahead of it and its own uncached prefill,
both slowed by the decode work that rides along every chunk:

    effective_speed = speed / (1 + decode_step_s * speed / prefill_budget)   (while decoding)
    prefill_s = uncached / effective_speed x (knee + cached + uncached / 2) / (knee + budget / 2)
    ttft = queue_s + room_wait_s + prefill_s + host_hit / host_load_speed + decode_step_s

`room_wait_s` is the wait for a running slot (past `max_running`) or for KV room.

The `cost` policy minimises `scores`: the ttft plus what the choice costs other requests (see
there). The weights were set on the simulator (`cluster/sim`, the Mooncake conversation trace,
seeds 0-6, held out on 7-10; docs/benchmarks.md).

`speed` is `WorkerStats.prefill_tokens_per_s` once the worker has measured it, the fleet's
median until then. `decode_step_s` is the fleet's fit of the step on decode context, read at the
context booked on the worker now (`router.fleet`); without a fit (one worker, or all at one
context), the worker's measured `WorkerStats.decode_step_s`, else the fleet's median or prior.
`queue_s` is this router's booked queue (fresh) plus the reported waiting prefill of the
requests it did not book (other routers').
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from router.cost_config import CostConfig
from router.fleet import FleetSpeeds, denoise
from worker.protocol import WorkerStats

if TYPE_CHECKING:
    from router.policies import RouteRequest, WorkerView


class Speeds(NamedTuple):
    """A worker's speeds right now: its load, raw and effective prefill speed, step time."""

    load: int  # running requests: booked here plus other routers' (`WorkerView.load`)
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
        # the speeds of a worker that has not measured itself yet, and the step's fit on
        # decode context (`router.fleet`)
        cfg = self.config
        self.fleet = FleetSpeeds(cfg.prefill_tokens_per_s, cfg.decode_step_s, cfg.step_from_context)

    def observe_fleet(self, stats: Iterable[WorkerStats | None]) -> None:
        """Re-derive the fleet's speeds from the latest reports (`FleetSpeeds.observe`)."""
        self.fleet.observe(stats)

    def speeds(self, view: WorkerView) -> Speeds:
        """Measured speeds where the worker reported them, priors otherwise.

        The step: with `step_from_context` and a fit (`router.fleet`), the fleet's fit at the
        context booked on the worker now, plus other routers' share of its reported context.
        Otherwise its measured step, which covers the batch it reported; requests booked since
        then (more than it reported) each add the prior per-request growth.
        """
        return Speeds(*self._speeds(view))

    def estimate(self, request: RouteRequest, view: WorkerView) -> Estimate:
        """The request's predicted wait, own prefill and first step on the worker."""
        return Estimate(*self._estimate(request, view)[:3])

    def cached_tokens(self, request: RouteRequest, view: WorkerView) -> tuple[int, int]:
        """(device hit, host hit) in tokens; at least one prompt token is always computed."""
        limit = max(0, request.num_tokens - 1)
        device = min(view.matched_blocks * request.block_size, limit)
        return device, min(view.host_blocks * request.block_size, limit - device)

    def ttft_s(self, request: RouteRequest, view: WorkerView) -> float:
        """Predicted time to the request's first token on the worker."""
        wait, prefill, step, _ = self._estimate(request, view)
        return wait + prefill + step

    def scores(self, request: RouteRequest, views: Sequence[WorkerView]) -> list[float]:
        """What `cost` minimises, per view: the TTFT there plus the harm to other requests.

        - Compute: recomputing a prefix another worker holds burns capacity that later requests
          wait for: `compute_weight` x its prefill time. The weight grows with the share of
          workers that have a queue (as `busy_weight x share ** busy_power`: when most are busy,
          lost hits turn into queueing), and under backlog (even the least loaded worker has
          `rho` s of wait, so about rho / s requests of prefill time s queue before it clears).
          It shrinks for a request whose best predicted TTFT is past `long_ttft_s`: for such a
          request a wait behind the busy worker that holds its prefix costs more than it saves.
          On an idle worker (nothing booked or reported; with `idle_while_decoding`, nothing
          queued to prefill) the weight is only `idle_weight`: nobody waits behind it now, so
          a prefix every worker needs (a shared system prompt) gets computed there once
          instead of every request piling onto the workers that hold it.
        - Tail: the part of the TTFT past `tail_ttft_s` counts `tail_weight` times more, so a
          request is not left to wait into the tail for the sake of its cached prefix.
        - Guard: a worker where the request's TTFT would be in the tail and more than
          `tail_guard_s` + `tail_guard_busy_s` x `busy` past its best TTFT elsewhere is never
          chosen: no request waits out a long queue for its cached prefix when it could start
          seconds sooner elsewhere. `tail_guard_busy_s` (0 by default) would give it more time
          with most workers queued (`busy`, as the compute weight's), where the recompute
          elsewhere turns into queueing.
          Tail and guard apply only while some worker would start the request before
          `tail_ttft_s`. In a backlog (every wait past it) they would only trade its prefix
          for a shorter queue: the recompute adds to the work every queue is behind on, and
          hits are what lets the cluster catch up.
        - Affinity: while a worker computes this prefill (P s), the requests whose prefix it
          holds arrive at `affinity_rate` and wait P / 2 on average, or recompute elsewhere:
          `affinity_weight x rate x P^2 / 2`, times `share ** busy_power` (with idle workers
          around they have somewhere cheap to go). It keeps long uncached prompts off the
          workers that hold the live conversations.
        - Demand: the same arrivals, sized by what they hold: each waits P / 2 or recomputes
          its prefix elsewhere, whichever is less. `demand` (prompt tokens/s routed to the
          worker lately) / speed is the recompute per second of the next turns it will get:
          `demand_weight x share x P x min(rate x P / 2, demand / speed)`, `share` the share
          of workers with a queue. It tells a worker holding 90k-token conversations from one
          holding a system prompt; short prefills (P / 2 under a turn's recompute) add next
          to nothing.
        - Decode: a small `decode_weight` x its decode time there (expected output x the step
          time of the batch it joins) keeps an idle cluster from stacking every conversation on
          the worker that holds a shared system prompt.
        """
        cfg = self.config
        estimates = [self._estimate(request, view) for view in views]
        full_s = max(1, request.num_tokens) / max(e[3] for e in estimates)
        best_s = min(e[0] + e[1] + e[2] for e in estimates)
        share = sum(1 for v in views if v.queue_s > 0) / len(views)
        busy = share**cfg.busy_power
        compute = cfg.compute_weight * (1.0 + cfg.busy_weight * busy)
        if cfg.long_ttft_s > 0 and best_s > cfg.long_ttft_s:
            compute *= (cfg.long_ttft_s / best_s) ** cfg.long_power
        weight = 1.0 + compute
        rho = min(e[0] for e in estimates)
        if rho > 0:
            weight += cfg.backlog_weight * rho / full_s
        affinity = cfg.affinity_weight * busy / 2
        demand, speed = cfg.demand_weight * share, self.fleet.prefill_tokens_per_s
        decode = cfg.decode_weight * request.expected_output
        growth, tail_s = cfg.decode_step_per_request_s, cfg.tail_ttft_s
        # backlog: no worker can start it before the tail; the tail and the guard would only
        # trade its prefix for a shorter queue, adding a recompute to a cluster already behind
        backlog = rho >= tail_s
        tail_w = 0.0 if backlog else cfg.tail_weight
        guarded = cfg.tail_guard_s > 0 and not backlog
        guard_s = best_s + cfg.tail_guard_s + cfg.tail_guard_busy_s * busy
        guard_s = max(tail_s, guard_s) if guarded else math.inf
        scores = []
        for (wait, prefill, step, _), view in zip(estimates, views, strict=True):
            ttft = wait + prefill + step
            if cfg.idle_while_decoding:
                idle = view.queue_s <= 0
            else:  # nothing booked, queued or in its own last report: between two requests
                stats = view.stats  # the bookings here may end before its report says so
                reported = 0 if stats is None else stats.running + stats.waiting
                idle = view.requests == 0 and reported == 0 and view.queue_s <= 0
            harm = min(cfg.idle_weight, weight - 1.0) if idle else weight - 1.0
            score = ttft + harm * prefill + decode * (step + growth)
            rate = view.affinity_rate
            score += affinity * rate * prefill * prefill
            score += demand * min(rate * prefill / 2, view.demand_tokens_per_s / speed) * prefill
            if ttft > tail_s:
                score += tail_w * (ttft - tail_s)
            scores.append(math.inf if ttft > guard_s else score)
        return scores

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
                speed = denoise(stats.prefill_tokens_per_s, speed, cfg.speed_noise)
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
    ) -> tuple[float, float, float, float]:
        cfg = self.config
        load, _, effective, step = self._speeds(view)
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
        return wait + self._room_wait_s(request, view, load, step), prefill, step, effective

    def _room_wait_s(
        self, request: RouteRequest, view: WorkerView, load: int, step: float
    ) -> float:
        """Wait for a running slot (past `max_running`) or for KV room (past the worker's KV,
        its running requests holding their whole context, cached prefix included)."""
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
        overflow = view.active_tokens + request.num_tokens + request.expected_output
        overflow -= stats.kv_total - stats.kv_session
        if overflow <= 0:
            return wait
        drain = view.drain_tokens_per_s  # measured: holds however busy the steps are
        if drain <= 0:
            drain = view.active_tokens / residence if residence > 0 else 0.0
        return max(wait, overflow / drain) if drain > 0 else wait

    def prefill_s(self, request: RouteRequest, view: WorkerView) -> float:
        """Time of the request's own prefill on the worker, its cached prefix skipped."""
        return self._estimate(request, view)[1]

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
