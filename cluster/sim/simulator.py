"""The discrete-event simulator: a workload, N `SimWorker`s and the real `RoutingCore`.

Events, in time order (ties in insertion order, so a run is deterministic):
- an arrival: the router routes the request (`RoutingCore.route`, the same object and policy
  as the live router) and the chosen worker queues it (interrupting a decode run);
- a step end: the worker applies its step, the router hears of first tokens and finished
  requests at once (`first_token`; `finish` with the real cached tokens), as the live router
  does when a stream starts and ends;
- a delivery: KV event batches and worker stats reach the router `event_delay_s` after the
  worker produced them, as they would over the wire.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.progress import Progress
from cluster.sim.routing import make_core, worker_shape, worker_stats
from cluster.sim.time_model import TimeProfile
from cluster.sim.worker import RequestState, SimWorker
from cluster.sim.workloads import Workload
from mem_cache.events import block_hashes, encode_batch


@dataclass(slots=True)
class SimConfig:
    """One simulation. `kv_tokens` is each worker's KV capacity (tokens; None: the profile's).

    event_delay_s: how late KV events and stats reach the router.
    host_kv_tokens / host_policy: each worker's host tier (`RadixCache` host_allocator).
    speed_error: the prefill speed the workers report, as a multiple of their real one.
    stats_interval_s: how often each worker reports its stats.
    """

    workers: int = 8
    kv_tokens: int | None = None
    policy: str = "cost"
    event_delay_s: float = 0.05
    stats_interval_s: float = 0.5
    seed: int = 0
    host_kv_tokens: int = 0  # host KV tier per worker (0: none)
    host_policy: str = "write_through"
    cost_config: dict = field(default_factory=dict)  # `--cost-config` overrides
    speed_error: float = 1.0


@dataclass(slots=True)
class SimResult:
    """Per-request outcomes (arrays in workload order) and per-worker totals."""

    policy: str
    ttft_s: list[float]
    e2e_s: list[float]
    cached_tokens: list[int]
    host_tokens: list[int]
    prompt_tokens: list[int]
    output_tokens: list[int]
    worker_of: list[int]
    busy_s: list[float]
    requests_per_worker: list[int]
    makespan_s: float


class Simulator:
    """Runs one workload under one policy; `run()` returns a `SimResult`."""

    def __init__(
        self,
        workload: Workload,
        config: SimConfig,
        profile: TimeProfile,
        progress: Progress | None = None,
    ) -> None:
        self.workload = workload
        self.config = config
        self.profile = profile
        self.progress = progress
        self.now = 0.0
        kv_tokens = config.kv_tokens or profile.kv_tokens
        bt = workload.block_tokens
        self.workers = [
            SimWorker(i, profile, max(1, kv_tokens // bt), bt,
                      host_capacity_blocks=config.host_kv_tokens // bt,
                      host_policy=config.host_policy)
            for i in range(config.workers)
        ]
        self.by_id = {w.worker_id: w for w in self.workers}
        self.core = make_core(
            config.policy, lambda: self.now, config.seed, bt, profile, config.cost_config
        )
        for w in self.workers:
            stats = worker_stats(w, config.speed_error)
            self.core.add_worker(w.worker_id, stats, worker_shape(w))
            self.core.apply_events(encode_batch(w.worker_id, 0, 0, w.cache.snapshot_events()))
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._event_seq = [0] * config.workers
        self._last_stats = [-math.inf] * config.workers
        self._done = 0

    def _at(self, time_s: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (time_s, next(self._seq), action))

    def run(self) -> SimResult:
        states = [RequestState(r) for r in self.workload.requests]
        for state in states:
            self._at(state.req.arrival_s, lambda s=state: self._arrive(s))
        while self._heap:
            self.now, _, action = heapq.heappop(self._heap)
            action()
        if self.progress:
            self.progress.close()
        return self._result(states)

    def _arrive(self, state: RequestState) -> None:
        req = state.req
        hashes = block_hashes(req.blocks, None, 1)
        decision = self.core.route(
            req.request_id, hashes, req.input_length, req.output_length, req.session_id
        )
        worker = self.by_id[decision.worker_id]
        worker.enqueue(state)
        if worker.busy_until < 0:
            self._start(worker)
        else:
            end = worker.interrupt(self.now)
            if end is not None:
                worker.version += 1
                self._at(end, lambda v=worker.version: self._end(worker, v))

    def _start(self, worker: SimWorker) -> None:
        end = worker.begin_step(self.now)
        if end >= 0:
            worker.version += 1
            self._at(end, lambda v=worker.version: self._end(worker, v))

    def _end(self, worker: SimWorker, version: int) -> None:
        if version != worker.version:
            return  # replaced by an interrupt
        first, finished = worker.end_step(self.now)
        for state in first:
            self.core.first_token(state.req.request_id)
        for state in finished:
            self.core.finish(state.req.request_id, state.cached_tokens)
        self._done += len(finished)
        if self.progress and finished:
            self.progress.update(self._done)
        self._publish(worker)
        self._start(worker)

    def _publish(self, worker: SimWorker) -> None:
        """Ship the worker's new KV events, and its stats when due, with the wire delay."""
        events = worker.cache.take_events()
        due = self.now + self.config.event_delay_s
        if events:
            self._event_seq[worker.index] += 1
            batch = encode_batch(worker.worker_id, 0, self._event_seq[worker.index], events)
            self._at(due, lambda b=batch: self.core.apply_events(b))
        if self.now - self._last_stats[worker.index] >= self.config.stats_interval_s:
            self._last_stats[worker.index] = self.now
            stats = worker_stats(worker, self.config.speed_error)
            self._at(due, lambda s=stats: self.core.update_stats(s))

    def _result(self, states: list[RequestState]) -> SimResult:
        unfinished = [s.req.request_id for s in states if math.isnan(s.finish_s)]
        if unfinished:
            raise RuntimeError(f"{len(unfinished)} requests never finished, e.g. {unfinished[0]}")
        return SimResult(
            policy=self.config.policy,
            ttft_s=[s.first_token_s - s.req.arrival_s for s in states],
            e2e_s=[s.finish_s - s.req.arrival_s for s in states],
            cached_tokens=[s.cached_tokens for s in states],
            host_tokens=[s.host_tokens for s in states],
            prompt_tokens=[s.req.input_length for s in states],
            output_tokens=[s.req.output_length for s in states],
            worker_of=[s.worker for s in states],
            busy_s=[w.busy_s for w in self.workers],
            requests_per_worker=[w.served for w in self.workers],
            makespan_s=max(s.finish_s for s in states) if states else 0.0,
        )


def simulate(
    workload: Workload, config: SimConfig, profile: TimeProfile, progress: bool = False
) -> SimResult:
    """Run one policy over `workload`."""
    bar = Progress(len(workload.requests), config.policy, enabled=progress)
    return Simulator(workload, config, profile, bar).run()
