"""The `cost` policy's score: a request's predicted TTFT on a worker plus named terms for the harm
the choice does to other requests. Each term has its own small config with documented defaults;
a term set to None is off (`CostTerms.only` keeps just the ones given).

The terms (seconds of score per second of the named quantity):

- `compute`: recomputing a prefix another worker holds burns capacity that later requests wait
  for: `weight` x the request's prefill time there. The weight grows with the share of workers
  that have a queue (`busy_weight x share ** busy_power`: when most are busy, lost hits turn
  into queueing), and under backlog (even the least loaded worker has `rho` s of wait, so
  about rho / s requests of prefill time s queue before it clears: `backlog_weight x rho / s`).
  It shrinks for a request whose best predicted TTFT is past `long_ttft_s` (x (long_ttft_s /
  best) ** long_power): for such a request a wait behind the busy worker that holds its prefix
  costs more than it saves. On an idle worker (nothing booked or reported; with
  `idle_while_decoding`, nothing queued to prefill) the weight is only `idle_weight`: nobody
  waits behind it now, so a prefix every worker needs (a shared system prompt) gets computed
  there once instead of every request piling onto the workers that hold it. On any other
  worker, the part of the prefill that every worker would have to compute (the least prefill
  among the candidates) weighs `idle_weight` too (+ `stall_weight` x its requests, running and
  queued, up to the full weight; `stall_weight` is 0 by default): that work is done wherever
  the request goes and burns no capacity; only what it recomputes beyond that part weighs the
  full weight. With the full weight on it, a prefix holder with one request weighed its own
  128-token remainder 24-30 times, above an idle worker's whole 768-token recompute at
  `idle_weight`, and the prefix was computed again; with 8 per request it stalls, a holder of
  a group's prefix with one to four requests decoding still sent the next request of the group
  to recompute on an idle engine whose cold prefill takes seconds (docs/benchmarks.md).
- `tail`: the part of the TTFT past `tail_ttft_s` counts `weight` times more, so a request is
  not left to wait into the tail for the sake of its cached prefix.
- `guard`: a worker where the request's TTFT would be in the tail and more than `margin_s` +
  `busy_s` x busy past its best TTFT elsewhere is never chosen: no request waits out a long
  queue for its cached prefix when it could start seconds sooner elsewhere.
  Tail and guard apply only while some worker would start the request before `tail_ttft_s`.
  In a backlog (every wait past it) they would only trade its prefix for a shorter queue: the
  recompute adds to the work every queue is behind on, and hits are what lets the cluster
  catch up. They also fade as the fleet has lately been saturated (`RouteRequest.saturation`,
  the decayed share of the last `saturation_window_s` in which no worker was free): the tail
  weight x (1 - saturation), the guard's margin / (1 - saturation). A worker free for a
  moment in a saturated fleet is not spare capacity, the next arrivals fill it anyway; moving
  a holder's request there to recompute puts both behind (figures in docs/benchmarks.md).
- `affinity`: while a worker computes this prefill (P s), the requests whose prefix it holds
  arrive at its affinity rate and wait P / 2 on average, or recompute elsewhere: `weight x rate
  x P^2 / 2`, times busy (with idle workers around they have somewhere cheap to go). It keeps
  long uncached prompts off the workers that hold the live conversations.
- `demand`: the same arrivals, sized by what they hold: each waits P / 2 or recomputes its
  prefix elsewhere, whichever is less. Demand (prompt tokens/s routed to the worker lately) /
  the fleet's speed is the recompute per second of the next turns it will get: `weight x share
  x P x min(rate x P / 2, demand / speed)`. It tells a worker holding 90k-token conversations
  from one holding a system prompt; short prefills add next to nothing.
- `decode`: a small `weight` x its decode time there (expected output x the step of the batch
  it joins) keeps an idle cluster from stacking every conversation on the worker that holds a
  shared system prompt.

`busy` is `share ** busy_power`, `share` the fraction of candidate workers with a prefill queue.
The defaults were set on the simulator (`cluster/sim`, the Mooncake conversation trace, seeds
0-6, held out on 7-10); docs/router.md says why each term exists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from router.routing.candidates import RouteRequest, WorkerView


@dataclass
class ComputeTerm:
    """The prefill work the choice adds (see the module docstring)."""

    weight: float = 24.0
    busy_weight: float = 4.0  # growth with the busy share
    backlog_weight: float = 4.0  # growth with the backlog
    long_ttft_s: float = 0.75  # shrinks past this best TTFT (0: never)
    long_power: float = 1.0
    idle_weight: float = 2.0  # the weight on an idle worker (nothing booked, reported)
    # on a worker that is not idle, the part of the prefill every worker would compute (the
    # least among the candidates) weighs idle_weight plus this per request there (decoding or
    # queued: it stalls each of them), up to the full weight; its recompute beyond that part
    # weighs the full weight. 8 balances new chat sessions a little better (synthetic chat at
    # load 0.95: 0.060 s mean TTFT against 0.066 s) and copies prefixes off their holders on
    # slow engines (docs/benchmarks.md)
    stall_weight: float = 0.0
    # True: a worker with no prefill queued counts as idle even while it decodes. Latency
    # first: lower TTFT, fewer hits (Mooncake matrix: 0.74-0.89 of pooled); under KV pressure
    # it can queue badly (chat, load 0.8, 200k KV: 11x the mean TTFT)
    idle_while_decoding: bool = False


@dataclass
class TailTerm:
    """TTFT past `CostTerms.tail_ttft_s` counts this much more."""

    weight: float = 8.0


@dataclass
class GuardTerm:
    """No worker whose TTFT is in the tail and `margin_s` + `busy_s` x busy past the best."""

    margin_s: float = 5.0
    # 4 (with margin_s 4) pays only together with step_noise 0.1 (`EstimateConfig`)
    busy_s: float = 0.0


@dataclass
class AffinityTerm:
    """The delay the prefill imposes on arrivals whose prefix the worker holds."""

    weight: float = 4.0


@dataclass
class DemandTerm:
    """The recompute or wait the prefill imposes on the next turns routed to the worker."""

    weight: float = 2.0


@dataclass
class DecodeTerm:
    """The request's own decode time on the worker."""

    weight: float = 0.25


TERMS = ("compute", "tail", "guard", "affinity", "demand", "decode")


@dataclass
class CostTerms:
    """The terms of `cost` (None: off) and the two thresholds they share."""

    tail_ttft_s: float = 4.0  # where the tail starts (tail, guard, and what a backlog is)
    busy_power: float = 4.0  # busy = share of queued workers ** this (compute, guard, affinity)
    compute: ComputeTerm | None = field(default_factory=ComputeTerm)
    tail: TailTerm | None = field(default_factory=TailTerm)
    guard: GuardTerm | None = field(default_factory=GuardTerm)
    affinity: AffinityTerm | None = field(default_factory=AffinityTerm)
    demand: DemandTerm | None = field(default_factory=DemandTerm)
    decode: DecodeTerm | None = field(default_factory=DecodeTerm)

    @classmethod
    def only(cls, **terms: object) -> CostTerms:
        """The given terms (name=config) and thresholds; every other term off."""
        off = {f.name: None for f in fields(cls) if f.name in TERMS}
        return cls(**{**off, **terms})  # type: ignore[arg-type]


def scores(terms: CostTerms, request: RouteRequest, views: Sequence[WorkerView]) -> list[float]:
    """What `cost` minimises, per view: the TTFT there plus the terms (module docstring);
    `math.inf` where the guard rules the worker out."""
    estimates = [view.estimate for view in views]
    best_s = min(e[0] + e[1] + e[2] for e in estimates)
    share = sum(1 for v in views if v.queue_s > 0) / len(views)
    busy = share**terms.busy_power
    rho = min(e[0] for e in estimates)
    tail_s = terms.tail_ttft_s
    # backlog: no worker can start it before the tail; the tail and the guard would only
    # trade its prefix for a shorter queue, adding a recompute to a cluster already behind
    backlog = rho >= tail_s
    weight = 1.0
    compute = terms.compute
    if compute is not None:
        full_s = max(1, request.num_tokens) / max(e[3] for e in estimates)
        weight = _compute_weight(compute, busy, best_s, rho, full_s)
    # saturated lately (no worker free): a worker free now is free for a moment only
    calm = 1.0 - request.saturation
    tail_w = 0.0 if backlog or terms.tail is None else terms.tail.weight * calm
    guard = terms.guard
    guard_s = math.inf
    if guard is not None and guard.margin_s > 0 and not backlog and calm > 0:
        guard_s = max(tail_s, best_s + (guard.margin_s + guard.busy_s * busy) / calm)
    affinity = 0.0 if terms.affinity is None else terms.affinity.weight * busy / 2
    demand = 0.0 if terms.demand is None else terms.demand.weight * share
    speed = request.fleet_tokens_per_s
    decode = 0.0 if terms.decode is None else terms.decode.weight * request.expected_output
    idle_while_decoding = compute is not None and compute.idle_while_decoding
    idle_weight = 0.0 if compute is None else compute.idle_weight
    stall_weight = 0.0 if compute is None else compute.stall_weight
    least_prefill = min(e[1] for e in estimates)  # what every worker has to compute
    out = []
    for (wait, prefill, step, _, _, joined_step), view in zip(estimates, views, strict=True):
        ttft = wait + prefill + step
        full = weight - 1.0
        stats = view.stats  # the bookings here may end before its report says so
        reported = 0 if stats is None else stats.running + stats.waiting
        requests = max(view.load, reported, view.queue_s > 0)  # a queue is someone's
        if view.queue_s <= 0 and (requests == 0 or idle_while_decoding):
            harm = min(idle_weight, full) * prefill  # idle: nobody waits behind it
        else:  # the prefill any worker would do stalls the requests there; a recompute on
            # top of that burns capacity that later requests wait for
            shared = min(prefill, least_prefill)
            stall = min(idle_weight + stall_weight * requests, full)
            harm = stall * shared + full * (prefill - shared)
        score = ttft + harm + decode * joined_step
        rate = view.affinity_rate
        score += affinity * rate * prefill * prefill
        if demand:
            score += demand * min(rate * prefill / 2, view.demand_tokens_per_s / speed) * prefill
        if ttft > tail_s:
            score += tail_w * (ttft - tail_s)
        out.append(math.inf if ttft > guard_s else score)
    return out


def _compute_weight(
    term: ComputeTerm, busy: float, best_s: float, rho: float, full_s: float
) -> float:
    """1 + the compute term's weight for this request (see the module docstring)."""
    compute = term.weight * (1.0 + term.busy_weight * busy)
    if term.long_ttft_s > 0 and best_s > term.long_ttft_s:
        compute *= (term.long_ttft_s / best_s) ** term.long_power
    weight = 1.0 + compute
    if rho > 0:
        weight += term.backlog_weight * rho / full_s
    return weight
