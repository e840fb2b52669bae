"""A router over the fleet (`cluster/fleet.py`): it joins the running workers, follows the fleet's
changes, and asks the fleet to add or remove workers behind the admin endpoints.

A router never creates or kills a worker as a side effect of its own life: it starts by reading
the fleet's members and joining the ready ones (each joins with its KV snapshot, so a router
that starts or restarts rebuilds its index from the workers), then follows the fleet's long
poll (`FleetActor.changes`) on its own event loop:

- a member it has not seen becomes ready (added by any router, or by the fleet's start): it
  is attached (its snapshot, then its events). Our engine's workers are reached through Ray
  (`RayBackend`); vLLM workers over HTTP at their `endpoints`, their KV events followed on ZMQ
  (`HttpBackend`, made as `radixray route` makes it);
- a member turns `down` (the fleet's watcher found the actor dead): the router stops routing
  to it and purges its index entries at once (its in-flight requests fail over on their own),
  then probes it and re-adds it, empty, when Ray has restarted it (a vLLM worker comes back on
  new endpoints: its old backend is closed and the new one attached, empty);
- a member is gone from the fleet (removed through any router): the router detaches it.

Admin calls (`FleetControl`): add asks the fleet for a worker, waits for its model and hands
its backend to this router (other routers see it in the fleet's next change); drain / remove
stop routing here first (a drain waits for this router's in-flight requests), then ask the
fleet to kill the actor and free its bundle.

While the fleet actor is away (dead and being restarted by Ray, or hung), the router goes on
serving on the workers it knows; an admin call that cannot reach the fleet within
`FLEET_CALL_S` answers 503 (`fleet_unavailable`), and a remove asked meanwhile is undone: the
worker, still in the fleet, is attached again at the fleet's next change.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import FastAPI
from ray.exceptions import RayActorError, RayTaskError

from cluster.config import ClusterConfig
from cluster.fleet import Member
from cluster.route import EngineEventsCollector, spec_backend, worker_spec
from router.api.app import create_app
from router.backends.base import Backend
from router.backends.ray import RayBackend
from router.config import RouterConfig
from router.errors import APIError

log = logging.getLogger("radixray.cluster")

CHANGES_POLL_S = 10.0  # the fleet answers a change at once; this only bounds one long poll
FLEET_RETRY_S = 1.0  # after a failed poll (the fleet is being stopped, or restarted)
FLEET_CALL_S = 10.0  # an admin call that cannot reach the fleet in this time answers 503


class FleetLink:
    """Keeps one router's workers in step with the fleet (all methods on the router's loop)."""

    def __init__(self, fleet: Any, api_key: str | None = None) -> None:
        self.fleet = fleet
        self.api_key = api_key  # vLLM workers require the routers' key
        self.registry: Any = None  # the router's `WorkerSync`, set by `build_router`
        self.version = -1
        # members this router has attached (ready or dead), each with the endpoints it was
        # attached at (None: our engine, reached through Ray)
        self.attached: dict[str, dict | None] = {}

    async def join(self) -> None:
        """Attach every ready worker of the fleet now (each with its snapshot)."""
        version, members = await self.fleet.members.remote()
        new = self._new_ready(members)
        self.version = version
        await self.registry.join([self.adopt(m) for m in new])
        self._apply(members)

    async def follow(self) -> None:
        """Forever: apply the fleet's changes as they come."""
        while True:
            try:
                version, members = await self.fleet.changes.remote(self.version, CHANGES_POLL_S)
            except (RayActorError, RayTaskError) as exc:  # away, or restarting
                log.warning("the fleet does not answer: %s", type(exc).__name__)
                await asyncio.sleep(FLEET_RETRY_S)
                continue
            self.version = version
            for member in self._new_ready(members):
                self.registry.attach(self.adopt(member))
            self._apply(members)

    def adopt(self, member: Member) -> Backend:
        """The member's backend; the member counts as attached from now on."""
        self.attached[member.worker_id] = member.endpoints
        return member_backend(member, self.api_key)

    def _new_ready(self, members: list[Member]) -> list[Member]:
        """Ready members to attach: new ones, and those that serve on other endpoints than
        the ones attached (a vLLM worker Ray restarted: its old backend is detached here)."""
        new = []
        for m in members:
            if m.state != "ready":
                continue
            if m.worker_id not in self.attached:
                new.append(m)
            elif m.endpoints != self.attached[m.worker_id]:
                self.registry.detach(m.worker_id)
                new.append(m)
        return new

    def _apply(self, members: list[Member]) -> None:
        """Detach members gone from the fleet; mark the ones found dead."""
        present = {m.worker_id: m for m in members}
        for worker_id in sorted(self.attached.keys() - present.keys()):
            del self.attached[worker_id]
            self.registry.detach(worker_id)
        for member in members:
            if member.state == "down" and member.worker_id in self.attached:
                self.registry.mark_dead(member.worker_id)


class FleetControl:
    """`router.api.admin.WorkerControl` over the fleet (runs on the router's loop)."""

    def __init__(self, link: FleetLink) -> None:
        self.link = link

    async def add_worker(self) -> Backend:
        """Start one worker; returns its backend once its model is loaded (the router then
        registers it; the fleet's change that announces it is not attached again here).

        No room on the cluster, or a worker that fails to load: 503 with the reason; no fleet
        to ask: 503 `fleet_unavailable`."""
        await self._reach()
        try:
            [member] = await self.link.fleet.add.remote(1)
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None) or exc
            raise APIError(503, f"could not add a worker: {cause}",
                           code="worker_unavailable") from exc
        except RayActorError as exc:
            raise _away(exc) from exc
        return self.link.adopt(member)

    async def remove_worker(self, worker_id: str) -> None:
        """Kill the worker's actor and free its bundle (this router has already let go).
        No fleet to ask: 503, and the worker is attached again at the fleet's next change."""
        self.link.attached.pop(worker_id, None)
        deadline = time.time() + FLEET_CALL_S  # a fleet that gets the call later ignores it
        try:
            await asyncio.wait_for(_result(self.link.fleet.remove.remote(worker_id, deadline)),
                                   FLEET_CALL_S)
        except (TimeoutError, RayActorError, RayTaskError) as exc:
            raise _away(exc) from exc

    async def _reach(self) -> None:
        """503 unless the fleet answers within `FLEET_CALL_S`."""
        try:
            await asyncio.wait_for(_result(self.link.fleet.members.remote()), FLEET_CALL_S)
        except (TimeoutError, RayActorError, RayTaskError) as exc:
            raise _away(exc) from exc


async def _result(ref: Any) -> Any:
    return await ref


def _away(exc: BaseException) -> APIError:
    what = "did not answer in time" if isinstance(exc, asyncio.TimeoutError) else "is down"
    return APIError(503, f"the worker fleet {what} (Ray restarts it); try again shortly",
                    code="fleet_unavailable")


def router_config(config: ClusterConfig, model_dir: str) -> RouterConfig:
    """The router's config: clients name the model as it was given to `--model`."""
    return RouterConfig(
        model=config.model,
        tokenizer=model_dir,
        policy=config.policy,
        api_key=config.api_key,
        admin_key=config.admin_key,
        metrics_public=config.metrics_public,
        block_size=config.block_size,
        cost_config=dict(config.cost_config),
        stall_timeout_s=config.stall_timeout_s,
        max_concurrent=config.max_concurrent,
        drain_timeout_s=config.drain_timeout_s,
        tokenize_threads=config.tokenize_threads,
        body_timeout_s=config.body_timeout_s,
        send_timeout_s=config.send_timeout_s,
    )


def build_router(config: ClusterConfig, model_dir: str, fleet: Any) -> tuple[FastAPI, FleetLink]:
    """The FastAPI router with no workers yet, and its link to the fleet: `await link.join()`
    then run `link.follow()` on the router's loop.

    Safe to call in another thread while the fleet's workers load (the tokenizer loads here)."""
    link = FleetLink(fleet, config.api_key)
    app = create_app(router_config(config, model_dir), control=FleetControl(link))
    link.registry = app.state.router.workers
    if config.engine == "vllm":
        router = app.state.router
        router.metrics.registry.register(EngineEventsCollector(router.registry))
    return app, link


def member_backend(member: Member, api_key: str | None = None) -> Backend:
    """How a router reaches a member: through Ray (our engine), or over HTTP at its endpoints
    with its KV events followed (vLLM; hashed at the engine's own block size), priced with the
    speeds its worker probed (the router does not probe it again)."""
    if member.endpoints is None:
        return RayBackend(member.worker_id, member.actor)
    backend = spec_backend(worker_spec(**member.endpoints), member.worker_id, None, api_key,
                           probe_tokens=0)
    if member.speeds:
        backend.speed.calibrate(float(member.speeds.get("prefill_tokens_per_s") or 0.0),
                                float(member.speeds.get("decode_step_s") or 0.0))
    return backend


def member_backends(members: list[Member], api_key: str | None = None) -> list[Backend]:
    """A backend for each ready member (a router of one's own over the same workers)."""
    return [member_backend(m, api_key) for m in members if m.state == "ready"]
