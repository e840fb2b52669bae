"""Routing policies: pick one worker for a request from a view of every eligible worker.

Policies are plain objects over `WorkerView`s (`candidates`: prefix match, booked and reported
load, and the core's estimate of the request there), so the live router and the simulator run
the same code. `RoutingCore` builds the views of the ready, non-excluded workers once per
request, estimates the request on each (`estimate`) and handles session pins; a policy
only chooses.

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
- `cost` (default): the least predicted time to first token (the estimate: queued prefill,
  waits for a running slot or KV room, own uncached prefill), plus named terms for the harm
  the choice does to other requests (`cost_terms`: the prefill work it adds, the tail,
  the guard, affinity, demand, its decode time there). A cached prefix is worth the
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

from router.routing.candidates import Decision, RouteRequest, WorkerView
from router.routing.cost_terms import CostTerms, scores


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
    cost: CostTerms = field(default_factory=CostTerms)  # cost: its terms (`cost_terms`)


class Policy(ABC):
    """Chooses one of `workers` (non-empty, all eligible, in a stable order) for `request`."""

    name: str = ""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self.rng = random.Random(self.config.seed)
        self._turn = 0

    @abstractmethod
    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision: ...

    def _argmin(
        self, workers: Sequence[WorkerView], key: Callable[[WorkerView], float]
    ) -> WorkerView:
        """The worker with the least key; ties go to fewer requests, then to the worker fewer
        arrivals want lately (`affinity_rate`), then rotate fairly."""
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
        # A new prefix draws its followers to where it is computed: between equals, the worker
        # whose cached prefixes draw fewer arrivals takes it, so that the prefixes (and the
        # load that follows them) spread instead of piling up on whoever wins the rotation.
        return min(
            ties, key=lambda i: (workers[i].requests, workers[i].affinity_rate, (i - turn) % n)
        )


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
        estimates = [w.estimate for w in workers]
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
                load + eviction_s(request, w) + e.prefill_s
                for load, e, w in zip(loads, estimates, workers, strict=True)
            ]
            chosen, reason = self._pick_index(workers, explore), "explore"
        lightest = self._pick_index(workers, loads)
        cfg = self.config
        if loads[chosen] > cfg.e2_balance_ratio * loads[lightest] + cfg.e2_balance_floor_s:
            return Decision(workers[lightest].worker_id, "load_balance")
        return Decision(workers[chosen].worker_id, reason)


def eviction_s(request: RouteRequest, view: WorkerView) -> float:
    """Recompute time of cached tokens the worker must evict to fit the request (0 when it has
    not reported its KV)."""
    stats = view.stats
    if stats is None or stats.kv_total <= 0:
        return 0.0
    limit = max(0, request.num_tokens - 1)
    device = min(view.matched_blocks * request.block_size, limit)
    need = request.num_tokens - device + request.expected_output
    evicted = min(stats.kv_evictable, max(0, need - stats.kv_free))
    return evicted / view.estimate.prefill_tokens_per_s


class Cost(Policy):
    """The least predicted time to first token plus the harm to other requests (see
    `cost_terms`)."""

    name = "cost"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        chosen = self._pick(workers, scores(self.config.cost, request, workers))
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
