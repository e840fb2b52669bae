"""A router over the fleet (`cluster/fleet.py`): it joins the running workers, follows the fleet's
changes, and asks the fleet to add or remove workers behind the admin endpoints.

A router never creates or kills a worker as a side effect of its own life: it starts by reading
the fleet's members and joining the ready ones (each joins with its KV snapshot, so a router
that starts or restarts rebuilds its index from the workers), then follows the fleet's long
poll (`FleetActor.changes`) on its own event loop:

- a member it has not seen becomes ready (added by any router, or by the fleet's start): it
  is attached (its snapshot, then its events);
- a member turns `down` (the fleet's watcher found the actor dead): the router stops routing
  to it and purges its index entries at once (its in-flight requests fail over on their own),
  then probes it and re-adds it, empty, when Ray has restarted it;
- a member is gone from the fleet (removed through any router): the router detaches it.

Admin calls (`FleetControl`): add asks the fleet for a worker, waits for its model and hands
its backend to this router (other routers see it in the fleet's next change); drain / remove
stop routing here first (a drain waits for this router's in-flight requests), then ask the
fleet to kill the actor and free its bundle.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI
from ray.exceptions import RayActorError, RayTaskError

from cluster.config import ClusterConfig
from cluster.fleet import Member
from router.app import create_app
from router.backends import RayBackend
from router.config import RouterConfig
from router.errors import APIError

log = logging.getLogger("radixray.cluster")

CHANGES_POLL_S = 10.0  # the fleet answers a change at once; this only bounds one long poll
FLEET_RETRY_S = 1.0  # after a failed poll (the fleet is being stopped, or busy)


class FleetLink:
    """Keeps one router's workers in step with the fleet (all methods on the router's loop)."""

    def __init__(self, fleet: Any) -> None:
        self.fleet = fleet
        self.registry: Any = None  # the router's `WorkerSync`, set by `build_router`
        self.version = -1
        self.attached: set[str] = set()  # members this router has attached (ready or dead)

    async def join(self) -> None:
        """Attach every ready worker of the fleet now (each with its snapshot)."""
        version, members = await self.fleet.members.remote()
        new = self._new_ready(members)
        self.version = version
        await self.registry.join([RayBackend(m.worker_id, m.actor) for m in new])
        self._apply(members)

    async def follow(self) -> None:
        """Forever: apply the fleet's changes as they come."""
        while True:
            try:
                version, members = await self.fleet.changes.remote(self.version, CHANGES_POLL_S)
            except RayActorError as exc:
                log.warning("the fleet does not answer: %s", type(exc).__name__)
                await asyncio.sleep(FLEET_RETRY_S)
                continue
            self.version = version
            for member in self._new_ready(members):
                self.registry.attach(RayBackend(member.worker_id, member.actor))
            self._apply(members)

    def _new_ready(self, members: list[Member]) -> list[Member]:
        """Ready members not attached yet; they count as attached from now on."""
        new = [m for m in members if m.state == "ready" and m.worker_id not in self.attached]
        self.attached.update(m.worker_id for m in new)
        return new

    def _apply(self, members: list[Member]) -> None:
        """Detach members gone from the fleet; mark the ones found dead."""
        present = {m.worker_id: m for m in members}
        for worker_id in sorted(self.attached - set(present)):
            self.attached.discard(worker_id)
            self.registry.detach(worker_id)
        for member in members:
            if member.state == "down" and member.worker_id in self.attached:
                self.registry.mark_dead(member.worker_id)


class FleetControl:
    """`router.admin.WorkerControl` over the fleet (runs on the router's loop)."""

    def __init__(self, link: FleetLink) -> None:
        self.link = link

    async def add_worker(self) -> RayBackend:
        """Start one worker; returns its backend once its model is loaded (the router then
        registers it; the fleet's change that announces it is not attached again here).

        No room on the cluster, or a worker that fails to load: 503 with the reason."""
        try:
            [member] = await self.link.fleet.add.remote(1)
        except (RayTaskError, RayActorError) as exc:
            cause = getattr(exc, "cause", None) or exc
            raise APIError(503, f"could not add a worker: {cause}",
                           code="worker_unavailable") from exc
        self.link.attached.add(member.worker_id)
        return RayBackend(member.worker_id, member.actor)

    async def remove_worker(self, worker_id: str) -> None:
        """Kill the worker's actor and free its bundle (this router has already let go)."""
        self.link.attached.discard(worker_id)
        await self.link.fleet.remove.remote(worker_id)


def router_config(config: ClusterConfig, model_dir: str) -> RouterConfig:
    """The router's config: clients name the model as it was given to `--model`."""
    return RouterConfig(
        model=config.model,
        tokenizer=model_dir,
        policy=config.policy,
        api_key=config.api_key,
        block_size=config.block_size,
        cost_config=dict(config.cost_config),
        stall_timeout_s=config.stall_timeout_s,
        max_concurrent=config.max_concurrent,
        drain_timeout_s=config.drain_timeout_s,
        tokenize_threads=config.tokenize_threads,
    )


def build_router(config: ClusterConfig, model_dir: str, fleet: Any) -> tuple[FastAPI, FleetLink]:
    """The FastAPI router with no workers yet, and its link to the fleet: `await link.join()`
    then run `link.follow()` on the router's loop.

    Safe to call in another thread while the fleet's workers load (the tokenizer loads here)."""
    link = FleetLink(fleet)
    app = create_app(router_config(config, model_dir), control=FleetControl(link))
    link.registry = app.state.router.workers
    return app, link


def member_backends(members: list[Member]) -> list[RayBackend]:
    """A Ray backend for each ready member (a router of one's own over the same workers)."""
    return [RayBackend(m.worker_id, m.actor) for m in members if m.state == "ready"]
