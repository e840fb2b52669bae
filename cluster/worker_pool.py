"""The worker actors of one cluster: create, wait for, watch, add and remove them.

Each worker is one actor in one placement-group bundle (`cluster/placement.py`): a
`WorkerActor` (our engine) or a `VllmWorker` (`--engine vllm`, `cluster/vllm_worker.py`). The
pool lives in the fleet actor (`cluster/fleet.py`), which tells routers of every change; the
pool calls `on_change()` whenever a worker is added, becomes ready, is removed, is found dead
by the watcher, or answers again after Ray restarted it (a restarted actor is a new engine
with an empty cache and a new event epoch, so routers re-add it from its snapshot; a vLLM
worker restarted by Ray serves on new `endpoints`, which routers attach afresh).

Workers are detached, named actors (`cluster/adoption.py`): they outlive the fleet actor, and a
fleet actor that Ray restarted adopts them (`adopt`) with their caches.

All methods run on the fleet actor's event loop, so the pool needs no locking.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from cluster import adoption
from cluster.config import ClusterConfig
from cluster.placement import Placement, Slot
from cluster.vllm_worker import RemoteVllmWorker, VllmConfig
from worker.actor import WorkerActor
from worker.engine import EngineConfig

log = logging.getLogger("radixray.cluster")

PING_TIMEOUT_S = 30.0  # a loaded worker answers `ready` at once, even while it computes
ADOPT_TIMEOUT_S = 10.0  # a worker found alive that does not answer in this time is taken as down


@dataclass
class Worker:
    """One worker actor and its state: loading -> ready <-> down (dead until Ray restarts it)."""

    worker_id: str
    actor: Any
    slot: Slot
    state: str = "loading"
    started: float = field(default_factory=time.monotonic)
    restarts: int = 0
    # where an engine reached over HTTP serves ({"url", "events", "replay"}, from its
    # `ready()`; a vLLM worker's change when Ray restarts it); None for our own engine
    endpoints: dict | None = None
    # its engine's probed speeds ({"prefill_tokens_per_s", "decode_step_s"}, from the same
    # `ready()`); None for our own engine, which reports its own timings
    speeds: dict | None = None

    def served(self, info: dict) -> None:
        """What the worker's `ready()` answered about where and how fast it serves."""
        self.endpoints = info.get("endpoints")
        self.speeds = info.get("speeds")


def engine_config(config: ClusterConfig, device: str) -> EngineConfig | VllmConfig:
    """The engine's config for every worker of this cluster."""
    if config.engine == "vllm":
        cpus = config.cpus_per_worker or 1.0
        return VllmConfig(
            model=config.model,
            python=config.vllm_python,
            args=tuple(config.vllm_args),
            device=device,
            dtype=config.dtype,
            cpu_threads=max(1, int(cpus)),
            api_key=config.api_key,
            probe_tokens=config.probe_tokens,
        )
    return EngineConfig(
        model=config.model,
        device=device,
        dtype=config.dtype,
        attention=config.attention,
        compile=config.compile,
        cuda_graphs=config.cuda_graphs,
        kv_tokens=config.kv_tokens,
        page_size=config.page_size,
        block_size=config.block_size,
        host_kv_tokens=config.host_kv_tokens,
        host_policy=config.host_policy,
    )


class WorkerPool:
    """Owns the worker actors; the only place that creates or kills them."""

    def __init__(
        self,
        config: ClusterConfig,
        device: str,
        placement: Placement,
        on_change: Callable[[], None] = lambda: None,
        pool_id: str = "pool",
    ) -> None:
        self.config = config
        self.engine = engine_config(config, device)
        self.device = device
        self.placement = placement
        self.workers: dict[str, Worker] = {}
        self.on_change = on_change
        self._next_index = 0
        # in the workers' names: a fleet started again under the same name never meets a name
        # its predecessor's dying workers still hold
        self.pool_id = pool_id

    async def start(self, count: int, progress: Callable[[Worker], None] | None = None) -> None:
        """Reserve `count` bundles, create the workers and wait until each has its model loaded."""
        slots = await self.placement.reserve(count, self.config.ready_timeout_s)
        workers = [self._create(slot) for slot in slots]
        await self._wait_ready(workers, progress)

    async def add(self, count: int = 1) -> list[str]:
        """Start `count` more workers and wait for their models; returns their ids.

        On failure (no room for a bundle, a model that does not load) the workers of this call
        are removed again, so nothing stays reserved, and the error is raised."""
        workers: list[Worker] = []
        try:
            for _ in range(count):
                slot = await self.placement.acquire(self.config.ready_timeout_s)
                workers.append(self._create(slot))
            await self._wait_ready(workers, None)
        except BaseException:
            for worker in workers:
                await self.remove(worker.worker_id)
            raise
        return [w.worker_id for w in workers]

    async def remove(self, worker_id: str) -> None:
        """Remove the worker now: the router forgets it, the actor is killed, its bundle freed.

        Requests still running on it fail over to other workers (the routers' job)."""
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            raise KeyError(worker_id)
        self.on_change()  # routers stop routing to it before it dies
        ray.kill(worker.actor, no_restart=True)
        self.placement.release(worker.slot)

    async def watch(self) -> None:
        """Forever: ping every worker; a dead one is reported to the routers at once."""
        while True:
            await asyncio.gather(*(self._check(w) for w in list(self.workers.values())))
            await asyncio.sleep(self.config.watch_interval_s)

    def shutdown(self) -> None:
        """Kill every worker (no restart) and free every bundle."""
        for worker in self.workers.values():
            ray.kill(worker.actor, no_restart=True)
        self.workers.clear()
        self.placement.remove_all()

    def adopt(self, found: adoption.Found) -> int:
        """Take over the workers and groups a previous fleet actor left running (blocking: the
        fleet's `__init__`); returns how many workers were adopted. Each keeps its id, actor and
        cache; one that does not answer within `ADOPT_TIMEOUT_S` is adopted `down` (Ray is
        restarting it: the watcher reports it back)."""
        used = {(w.group, w.bundle) for w in found.workers}
        slots = self.placement.adopt(found.groups, used)
        workers = [w for w in found.workers if f"{w.group}#{w.bundle}" in slots]
        for stray in (w for w in found.workers if w not in workers):  # its group is gone
            ray.kill(stray.actor, no_restart=True)
        if not workers:
            return 0
        pings = [w.actor.ready.remote() for w in workers]
        answered, _ = ray.wait(pings, num_returns=len(pings), timeout=ADOPT_TIMEOUT_S)
        for w, ping in zip(workers, pings, strict=True):
            worker = Worker(w.worker_id, w.actor, slots[f"{w.group}#{w.bundle}"], state="down")
            if ping in answered:
                try:
                    worker.served(ray.get(ping))
                    worker.state = "ready"
                except (RayActorError, RayTaskError):
                    pass
            self.workers[w.worker_id] = worker
            index = w.worker_id.rpartition("-")[2]
            if index.isdigit():
                self._next_index = max(self._next_index, int(index) + 1)
        log.warning("the fleet adopted %d running worker(s): %s", len(workers),
                    ", ".join(f"{w.worker_id} {w.state}" for w in self.workers.values()))
        return len(workers)

    def _create(self, slot: Slot) -> Worker:
        worker_id = f"worker-{self._next_index}"
        self._next_index += 1
        resources = slot.group.bundle_specs[slot.bundle_index]
        actor_class = RemoteVllmWorker if isinstance(self.engine, VllmConfig) else WorkerActor
        actor = actor_class.options(
            name=adoption.worker_name(self.config.fleet_name, self.pool_id, worker_id,
                                      slot.name, slot.bundle_index),
            namespace=self.config.namespace,
            lifetime="detached",  # not fate-shared with the fleet actor (module docstring)
            num_cpus=resources.get("CPU", 0),
            num_gpus=resources.get("GPU", 0),
            max_restarts=self.config.max_restarts,
            max_task_retries=0,  # a generation is retried by the router, never replayed by Ray
            scheduling_strategy=slot.strategy(),
        ).remote(self.engine, worker_id)
        worker = Worker(worker_id, actor, slot)
        self.workers[worker_id] = worker
        self.on_change()
        return worker

    async def _wait_ready(
        self, workers: list[Worker], progress: Callable[[Worker], None] | None
    ) -> None:
        async def one(worker: Worker) -> None:
            try:
                info = await asyncio.wait_for(worker.actor.ready.remote(),
                                              self.config.ready_timeout_s)
            except Exception as exc:
                raise RuntimeError(f"{worker.worker_id} failed to load its model: {exc}") from exc
            worker.served(info)
            worker.state = "ready"
            worker.started = time.monotonic()
            self.on_change()
            if progress:
                progress(worker)

        await asyncio.gather(*(one(w) for w in workers))

    async def _check(self, worker: Worker) -> None:
        if worker.state == "loading":
            return
        try:
            info = await asyncio.wait_for(worker.actor.ready.remote(), PING_TIMEOUT_S)
        except (TimeoutError, GetTimeoutError):
            return  # busy or restarting: the next successful ping decides
        except (RayActorError, RayTaskError) as exc:  # dead, or alive with a failed engine
            if worker.state != "down" and worker.worker_id in self.workers:
                log.warning("%s died (%s); Ray restarts it", worker.worker_id, type(exc).__name__)
                worker.state = "down"
                self.on_change()
            return
        if worker.worker_id not in self.workers:
            return
        if worker.state == "down":
            log.warning("%s is back (restarted, empty cache)", worker.worker_id)
            worker.restarts += 1
            worker.state = "ready"
            worker.started = time.monotonic()
            worker.served(info)
            self.on_change()
        elif info.get("endpoints") != worker.endpoints:  # restarted between two pings
            worker.restarts += 1
            worker.served(info)
            self.on_change()

