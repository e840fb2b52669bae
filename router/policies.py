"""Routing policies: pick one worker for a request from a view of every eligible worker.

Policies are plain objects over `WorkerView`s (prefix match, booked load, reported stats), so the
live router and the simulator run the same code. `RoutingCore` fills the views, removes dead,
draining and excluded workers, and handles session pins; a policy only chooses.

- `round_robin`, `random` (seeded), `power_of_two` (two random workers, the less loaded),
  `least_load`: cache-blind baselines.
- `cache_aware`: the SGLang router's rule. If the load is imbalanced (max - min > 64 requests and
  max > 1.5 x min) the least loaded worker; else the best match if its match rate > 0.3; else
  the worker with the smallest cache.
- `kv_cost`: NVIDIA Dynamo's KV router: minimise overlap_weight x prefill blocks (booked plus
  this request's uncached ones) + active blocks (booked plus this request's).
- `e2`: Preble's exploit/explore: if the best match covers more tokens than it leaves to compute,
  exploit it; else explore: least load + eviction cost + own prefill time; then Preble's
  rebalancing: a worker far above the least load gets no more (the least loaded one does).
- `cost` (default): the least predicted time to first token (`router.cost_model`: queued
  prefill, waits for a running slot or KV room, own uncached prefill), plus a weight x the
  prefill work the choice adds (recomputing a prefix costs later requests capacity; more so
  under backlog) and a small weight x its decode time there. A cached prefix is worth the
  prefill it saves, so locality yields to load gradually, never by a hard switch; load booked
  at dispatch makes a burst spread once queueing behind the cached worker costs more than
  recomputing the prefix elsewhere.

Every `Decision` carries a reason for metrics: cache_hit, load_balance (a better match existed
elsewhere), least_load, smallest_cache, exploit, explore, round_robin, random, power_of_two,
session (set by the core).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from router.cost_config import CostConfig
from router.cost_model import CostModel
from worker.protocol import WorkerStats


@dataclass(slots=True)
class WorkerView:
    """What a policy sees of one worker for one request (filled by `RoutingCore`; read-only)."""

    worker_id: str
    stats: WorkerStats | None = None  # last reported, None until the first report
    matched_blocks: int = 0  # leading blocks of the request on its device (index's belief)
    host_blocks: int = 0  # further blocks found only on its host tier
    cached_blocks: int = 0  # blocks the index holds for it in all: its cache's size
    requests: int = 0  # routed here and not finished (booked)
    prefill_tokens: int = 0  # booked uncached prompt tokens whose prefill is still ahead
    decode_tokens: int = 0  # booked expected output tokens
    active_tokens: int = 0  # booked KV footprint: prompt + expected output
    drain_tokens_per_s: float = 0.0  # KV its ending requests released lately (0: none yet)
    queue_s: float = 0.0  # predicted seconds until its booked prefill queue drains
    affinity_rate: float = 0.0  # arrivals/s lately whose longest cached prefix is here
    demand_tokens_per_s: float = 0.0  # prompt tokens/s routed here lately (`router.affinity`)
    # requests its last stats counted beyond this router's bookings when they arrived (other
    # routers'): fixed until the next stats, so releases since then do not look like load
    foreign_requests: int = 0
    max_running: int = 64  # its engine's shape (`worker.protocol.EngineShape`)
    prefill_budget: int = 512

    @property
    def load(self) -> int:
        """Requests on the worker: booked here, plus other routers' as last reported."""
        return self.requests + self.foreign_requests


@dataclass(slots=True)
class RouteRequest:
    """The request as routing sees it: sizes only, never text."""

    request_id: str
    num_tokens: int
    num_blocks: int  # full blocks (len of its block hashes)
    expected_output: int = 0
    block_size: int = 16
    session_id: str | None = None


@dataclass(slots=True)
class Decision:
    """The chosen worker, why, and the prefix hit the index predicts there (tokens)."""

    worker_id: str
    reason: str
    cached_tokens: int = 0
    host_tokens: int = 0


@dataclass
class PolicyConfig:
    """Knobs of all policies; defaults are the published ones where there are any."""

    seed: int = 0  # random, power_of_two, tie-breaks
    cache_threshold: float = 0.3  # cache_aware: follow the cache above this match rate
    balance_abs_threshold: int = 64  # cache_aware: imbalanced if max - min load exceeds this
    balance_rel_threshold: float = 1.5  # ... and max load exceeds this times the min
    overlap_weight: float = 1.0  # kv_cost: weight of prefill blocks against active blocks
    e2_balance_ratio: float = 2.0  # e2: a worker with more than this x the least load ...
    e2_balance_floor_s: float = 1.0  # ... plus this many seconds of work is overloaded
    cost: CostConfig = field(default_factory=CostConfig)


class Policy(ABC):
    """Chooses one of `workers` (non-empty, all eligible, in a stable order) for `request`."""

    name: str = ""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self.rng = random.Random(self.config.seed)
        self.cost_model = CostModel(self.config.cost)
        self._turn = 0

    @abstractmethod
    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision: ...

    def _argmin(
        self, workers: Sequence[WorkerView], key: Callable[[WorkerView], float]
    ) -> WorkerView:
        """The worker with the least key; ties go to fewer requests, then rotate fairly."""
        return self._pick(workers, [key(w) for w in workers])

    def _pick(self, workers: Sequence[WorkerView], keys: list[float]) -> WorkerView:
        """`workers[i]` with the least `keys[i]`, ties broken as in `_argmin`."""
        return workers[self._pick_index(workers, keys)]

    def _pick_index(self, workers: Sequence[WorkerView], keys: list[float]) -> int:
        """The `i` of `_pick`."""
        low = min(keys)
        ties = [i for i, k in enumerate(keys) if k == low]
        self._turn += 1
        if len(ties) == 1:
            return ties[0]
        n, turn = len(workers), self._turn - 1
        return min(ties, key=lambda i: (workers[i].requests, (i - turn) % n))


def locality_reason(chosen: WorkerView, workers: Sequence[WorkerView]) -> str:
    """cache_hit when the chosen worker has the best match, load_balance when another had a
    better one, least_load when nobody had any."""
    best = max(w.matched_blocks + w.host_blocks for w in workers)
    if best == 0:
        return "least_load"
    return "cache_hit" if chosen.matched_blocks + chosen.host_blocks == best else "load_balance"


class RoundRobin(Policy):
    name = "round_robin"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        self._turn += 1
        return Decision(workers[(self._turn - 1) % len(workers)].worker_id, "round_robin")


class RandomPolicy(Policy):
    name = "random"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        return Decision(self.rng.choice(workers).worker_id, "random")


class PowerOfTwo(Policy):
    name = "power_of_two"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        picks = self.rng.sample(list(workers), min(2, len(workers)))
        chosen = min(picks, key=lambda w: w.load)
        return Decision(chosen.worker_id, "power_of_two")


class LeastLoad(Policy):
    name = "least_load"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        return Decision(self._argmin(workers, lambda w: w.load).worker_id, "least_load")


class CacheAware(Policy):
    """SGLang's cache_aware rule (see the module docstring)."""

    name = "cache_aware"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        cfg = self.config
        loads = [w.load for w in workers]
        high, low = max(loads), min(loads)
        if high - low > cfg.balance_abs_threshold and high > cfg.balance_rel_threshold * low:
            return Decision(self._argmin(workers, lambda w: w.load).worker_id, "least_load")
        best = max(workers, key=lambda w: w.matched_blocks)
        rate = best.matched_blocks * request.block_size / max(1, request.num_tokens)
        if rate > cfg.cache_threshold:
            top = [w for w in workers if w.matched_blocks == best.matched_blocks]
            return Decision(self._argmin(top, lambda w: w.load).worker_id, "cache_hit")
        chosen = self._argmin(workers, lambda w: w.cached_blocks)
        return Decision(chosen.worker_id, "smallest_cache")


class KvCost(Policy):
    """Dynamo's KV router cost, in blocks (see the module docstring)."""

    name = "kv_cost"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        bs = request.block_size
        own_blocks = request.num_blocks + request.expected_output // bs

        def logit(w: WorkerView) -> float:
            prefill = w.prefill_tokens / bs + request.num_blocks - w.matched_blocks
            reported = 0 if w.stats is None else w.stats.kv_protected
            active = max(w.active_tokens, reported) / bs + own_blocks
            return self.config.overlap_weight * prefill + active

        chosen = self._argmin(workers, logit)
        return Decision(chosen.worker_id, locality_reason(chosen, workers))


class E2(Policy):
    """Preble's E2: exploit a long shared prefix, else explore by load + eviction + prefill;
    then its post-assignment rebalancing: a request bound for an overloaded worker goes to the
    least loaded one instead (which then holds the prefix too: hot prefixes spread).

    Load is a worker's booked work in seconds (queued prefill, waits for a slot or KV room, and
    its decode), the counterpart of Preble's recent compute per GPU; a worker is overloaded
    past `e2_balance_ratio` x the least load + `e2_balance_floor_s`.
    """

    name = "e2"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        model = self.cost_model
        estimates = [model.estimate(request, w) for w in workers]
        loads = [
            e.wait_s + e.step_s * w.decode_tokens / max(1, w.load)
            for e, w in zip(estimates, workers, strict=True)
        ]
        best = max(w.matched_blocks for w in workers)
        cached = min(best * request.block_size, request.num_tokens)
        if best and cached > request.num_tokens - cached:
            top = [i for i, w in enumerate(workers) if w.matched_blocks == best]
            ttft = [e.wait_s + e.prefill_s + e.step_s for e in (estimates[i] for i in top)]
            chosen = top[self._pick_index([workers[i] for i in top], ttft)]
            reason = "exploit"
        else:
            explore = [
                load + model.eviction_s(request, w) + e.prefill_s
                for load, e, w in zip(loads, estimates, workers, strict=True)
            ]
            chosen, reason = self._pick_index(workers, explore), "explore"
        lightest = self._pick_index(workers, loads)
        cfg = self.config
        if loads[chosen] > cfg.e2_balance_ratio * loads[lightest] + cfg.e2_balance_floor_s:
            return Decision(workers[lightest].worker_id, "load_balance")
        return Decision(workers[chosen].worker_id, reason)


class Cost(Policy):
    """The least predicted time to first token (see `router.cost_model`)."""

    name = "cost"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        chosen = self._pick(workers, self.cost_model.scores(request, workers))
        return Decision(chosen.worker_id, locality_reason(chosen, workers))


_POLICIES: dict[str, type[Policy]] = {
    p.name: p
    for p in (RoundRobin, RandomPolicy, PowerOfTwo, LeastLoad, CacheAware, KvCost, E2, Cost)
}
POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)
DEFAULT_POLICY = "cost"


def make_policy(name: str = DEFAULT_POLICY, config: PolicyConfig | None = None) -> Policy:
    """A fresh policy object by name; `ValueError` names the valid ones for an unknown name."""
    try:
        return _POLICIES[name](config)
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}"
        ) from None
