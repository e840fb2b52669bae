"""The worker fleet: one detached, named Ray actor that owns every worker of a cluster.

Routers come and go (a Serve replica restarted after a failed health check, a `radixray serve`
router actor killed); the workers and their KV caches must not go with them. So the workers
(`WorkerActor`s) and their placement groups belong to `FleetActor`, a small actor of its own
(no CPU reserved) with `lifetime="detached"`, named `ClusterConfig.fleet_name` in the Ray
namespace `ClusterConfig.namespace`. Routers find it by name (`find_fleet`), read its members
and follow its changes (`changes`: a long poll that answers when the version moves); none of
them creates or kills a worker. Scaling (add, remove) is asked of the fleet, once for all
routers.

The fleet is stopped explicitly (`stop_fleet`: `radixray serve` on exit, or whoever deployed
it), never by a router's death. Nor by its own: the workers and their placement groups are
detached, named Ray objects (`cluster/adoption.py`), not children of the fleet's process. When
that process dies, Ray restarts the actor (`max_restarts=-1`) and the new one adopts the running
workers, their caches intact, before it answers anyone; its version numbers start above the old
ones (they count from the clock), so every router's next long poll answers at once with the
same members. Meanwhile routers serve on the workers they know, and admin calls get 503.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster import adoption
from cluster.config import ClusterConfig
from cluster.placement import Placement, Slot
from cluster.vllm_worker import VllmConfig
from cluster.worker_pool import WorkerPool, engine_config
from worker.engine import EngineConfig

log = logging.getLogger("radixray.cluster")


@dataclass
class Member:
    """One worker as the fleet reports it to routers: `state` is loading, ready or down (dead
    until Ray restarts it; `restarts` counts how often it came back, each time empty).
    `endpoints`: where a vLLM worker serves (`{"url", "events", "replay"}`), None for ours;
    `speeds`: its engine's probed `{"prefill_tokens_per_s", "decode_step_s"}` (0: not
    measured), None for ours."""

    worker_id: str
    actor: Any
    state: str
    restarts: int
    slot: Slot
    endpoints: dict | None = None
    speeds: dict | None = None


class FleetActor:
    """The `WorkerPool` of a cluster in its own actor, plus a version bumped on every change.

    A new actor first adopts whatever workers of its fleet still run (a restart by Ray, or a
    fleet created again by name): it counts as started then, and `start` does nothing more."""

    def __init__(self, config: ClusterConfig, device: str, bundle: dict[str, float],
                 fixed: bool) -> None:
        found = adoption.find(config.fleet_name, config.namespace)
        pool_id = found.pool_id or uuid.uuid4().hex[:8]
        names = adoption.group_name(config.fleet_name, pool_id, "")
        placement = Placement(bundle, fixed=fixed, notify=_echo, names=names)
        self.pool = WorkerPool(config, device, placement, on_change=self._changed,
                               pool_id=pool_id)
        self.version = time.time_ns() // 1000  # above any version a previous actor gave out
        self._bumped = asyncio.Event()
        self._started = asyncio.Event()  # set once a start has succeeded
        self._start: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None
        self.adopted = self.pool.adopt(found)
        if self.adopted:
            self._started.set()

    async def start(self, count: int) -> None:
        """Start `count` workers and wait for their models; every caller waits for the same
        start (the first caller's count wins). A start that failed is cleaned up and may be
        tried again."""
        if self._started.is_set():
            self._watching()
            return
        if self._start is None:
            self._start = asyncio.get_running_loop().create_task(self.pool.start(count))
        task = self._start
        try:
            await asyncio.shield(task)
        except BaseException:
            if self._start is task and task.done():
                self._start = None
                self.pool.shutdown()
                self._changed()
            raise
        self._watching()
        self._started.set()

    async def started(self) -> None:
        """Returns once the fleet's start has succeeded (at once after that): a router that
        loads beside the workers waits here before it serves."""
        await self._started.wait()
        self._watching()

    def _watching(self) -> None:
        """Start the watcher once the fleet has workers (an adopting actor: at its first call
        on the loop)."""
        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self.pool.watch())

    def members(self) -> tuple[int, list[Member]]:
        """(version, every worker) now."""
        return self.version, [
            Member(w.worker_id, w.actor, w.state, w.restarts, w.slot, w.endpoints, w.speeds)
            for w in self.pool.workers.values()
        ]

    async def changes(self, version: int, timeout_s: float) -> tuple[int, list[Member]]:
        """`members()` once the version differs from `version`, or after `timeout_s`."""
        if self._started.is_set():
            self._watching()
        if version == self.version:
            bumped = self._bumped
            try:
                await asyncio.wait_for(bumped.wait(), timeout_s)
            except TimeoutError:
                pass
        return self.members()

    async def add(self, count: int) -> list[Member]:
        """Start `count` more workers and wait for their models (errors as `WorkerPool.add`)."""
        ids = await self.pool.add(count)
        return [m for m in self.members()[1] if m.worker_id in ids]

    async def remove(self, worker_id: str, deadline: float | None = None) -> bool:
        """Kill the worker and free its bundle; False when there is no such worker.

        `deadline` (`time.time()`): a call that reaches the fleet later does nothing and raises
        TimeoutError: its caller has given up (the fleet was away) and told its client so."""
        if deadline is not None and time.time() > deadline:
            raise TimeoutError(f"removing {worker_id} was asked too long ago")
        if worker_id not in self.pool.workers:
            return False
        await self.pool.remove(worker_id)
        return True

    def engine(self) -> EngineConfig | VllmConfig:
        """The engine config every worker of this fleet runs."""
        return self.pool.engine

    def placing(self) -> bool:
        """True while Ray places the workers (the placement's notices say what it waits for)."""
        starting = self._start is not None and not self._start.done() and not self.pool.workers
        return starting or self.pool.placement.waiting > 0

    def groups(self) -> int:
        """Placement groups held now (one initial group plus one per worker added live)."""
        return len(self.pool.placement._groups)

    def stop(self) -> None:
        """Kill every worker and free every bundle (the actor itself is killed by its caller)."""
        for task in (self._watch, self._start):
            if task is not None:
                task.cancel()
        self.pool.shutdown()
        self._changed()

    def _changed(self) -> None:
        self.version += 1
        self._bumped.set()
        self._bumped = asyncio.Event()


def _echo(line: str) -> None:
    # Ray copies an actor's stderr to the driver: `radixray serve` shows placement notices.
    print(line, file=sys.stderr, flush=True)


_RemoteFleet = ray.remote(FleetActor)


def create_fleet(config: ClusterConfig, device: str, bundle: dict[str, float],
                 fixed: bool) -> Any:
    """Start the fleet actor; RuntimeError when one of that name already runs on this Ray."""
    if find_fleet(config) is not None:
        raise RuntimeError(f"a fleet named {config.fleet_name!r} already runs on this Ray "
                           "(--fleet-name starts another)")
    return _fleet_options(config).remote(config, device, bundle, fixed)


async def get_or_create_fleet(config: ClusterConfig, device: str,
                              bundle: dict[str, float]) -> Any:
    """The running fleet of that name, else a new one (what every Serve replica does).

    RuntimeError when the running fleet's workers run another engine config (a redeploy that
    changed the model or the KV knobs must name a new `fleet_name`)."""
    fleet = _fleet_options(config, get_if_exists=True).remote(config, device, bundle, False)
    running = await fleet.engine.remote()
    wanted = engine_config(config, device)
    if running != wanted:
        raise RuntimeError(f"the running fleet {config.fleet_name!r} runs {running}, not "
                           f"{wanted}: name a new fleet_name (and stop the old fleet)")
    return fleet


def find_fleet(config: ClusterConfig) -> Any | None:
    """The running fleet's handle, or None."""
    try:
        return ray.get_actor(config.fleet_name, namespace=config.namespace)
    except ValueError:
        return None


def stop_fleet(fleet: Any, config: ClusterConfig | None = None, timeout_s: float = 60.0) -> None:
    """Kill the fleet's workers, free their bundles, then kill the fleet actor. A fleet actor
    that does not answer has its workers and groups killed by name from here (given `config`)."""
    try:
        ray.get(fleet.stop.remote(), timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - dead or hung: its workers are found by name
        log.warning("stopping the fleet: %r", exc)
    ray.kill(fleet, no_restart=True)
    if config is None:
        return
    left = adoption.kill_all(config.fleet_name, config.namespace)
    if left:
        log.warning("killed %d worker(s) the fleet left running", left)


def _fleet_options(config: ClusterConfig, get_if_exists: bool = False) -> Any:
    # On the caller's node (the head, where `radixray serve` and the Serve replicas run): a
    # lost worker node must not take the fleet, and with it every worker, along.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return _RemoteFleet.options(
        name=config.fleet_name,
        namespace=config.namespace,
        lifetime="detached",  # outlives the driver, the router and the Serve replica
        get_if_exists=get_if_exists,
        num_cpus=0,  # it only waits on its workers; CPUs go to them
        max_restarts=-1,  # a restarted fleet adopts the running workers (module docstring)
        scheduling_strategy=here,
    )
