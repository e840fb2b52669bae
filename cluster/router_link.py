"""The router app over a `WorkerPool`: Ray backends for its workers, and the pool as the
`WorkerControl` behind the router's admin endpoints (add, drain, remove).

Who does what on a change:
- add: the admin endpoint calls `PoolControl.add_worker()`; the pool reserves a bundle, starts
  the actor and waits for its model; the router registers the returned backend (it fetches the
  worker's snapshot, which is empty).
- drain / remove: the router stops routing to the worker (a drain first waits for its
  in-flight requests), then calls `remove_worker(id)`: the pool kills the actor and frees its
  bundle.
- death: the pool's watcher calls `WorkerSync.mark_dead` (the router's own polls notice
  too); the router purges the worker's index entries, probes it, and re-adds it when Ray has
  restarted it.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI

from cluster.config import ClusterConfig
from cluster.placement import PlacementError
from cluster.worker_pool import WorkerPool
from router.app import create_app
from router.backends import RayBackend
from router.config import RouterConfig
from router.errors import APIError


class PoolControl:
    """`router.admin.WorkerControl` over a `WorkerPool` (runs on the router's loop)."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    async def add_worker(self) -> RayBackend:
        """Start one worker; returns once its model is loaded (the router then registers it).

        No room on the cluster, or a worker that fails to load: 503 with the reason."""
        try:
            [worker_id] = await self.pool.add(1)
        except (PlacementError, RuntimeError) as exc:
            reason = f"could not add a worker: {exc}"
            raise APIError(503, reason, code="worker_unavailable") from exc
        return RayBackend(worker_id, self.pool.workers[worker_id].actor)

    async def remove_worker(self, worker_id: str) -> None:
        """Kill the worker's actor and free its bundle (the router has already let go)."""
        if worker_id in self.pool.workers:
            await self.pool.remove(worker_id)


def router_config(config: ClusterConfig, model_dir: str) -> RouterConfig:
    """The router's config: clients name the model as it was given to `--model`."""
    return RouterConfig(
        model=config.model,
        tokenizer=model_dir,
        policy=config.policy,
        api_key=config.api_key,
        block_size=config.block_size,
        cost_config=dict(config.cost_config),
    )


def pool_backends(pool: WorkerPool) -> list[RayBackend]:
    """A Ray backend for each of the pool's workers."""
    return [RayBackend(w.worker_id, w.actor) for w in pool.workers.values()]


def build_router(
    config: ClusterConfig, model_dir: str, pool: WorkerPool, backends: Sequence[RayBackend] = ()
) -> FastAPI:
    """The FastAPI router over `backends` (they join when it starts), linked to the pool.

    Safe to call in another thread while the pool's workers load (the tokenizer loads here)."""
    app = create_app(router_config(config, model_dir), backends, control=PoolControl(pool))
    pool.link = app.state.router.workers
    return app


async def join(app: FastAPI, backends: Sequence[RayBackend]) -> None:
    """Register workers with a running router (each joins with its snapshot)."""
    for backend in backends:
        await app.state.router.workers.add(backend)
