"""The router as a Ray Serve application, for KubeRay `RayService` (zero-downtime rollouts).

`serveConfigV2` names `cluster.serve_app:build_app` and passes `args` with the same knobs as
`radixray serve` in snake_case (model, workers, gpus_per_worker, device, policy, kv_tokens,
page_size, host_kv_tokens, host_policy, api_key, ...). `host`, `port` and `address` are
accepted and ignored: Serve's HTTP proxy listens, and the replica runs inside the cluster.

The one router replica creates and owns the worker actors (and their placement group), so a
rollout that replaces the replica replaces its workers with it, and nothing outlives the app.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray
from ray import serve

from cluster.config import ClusterConfig
from cluster.placement import Placement
from cluster.router_link import build_router, pool_backends
from cluster.worker_pool import WorkerPool
from worker.models.builtin import resolve_model

IGNORED_ARGS = ("host", "port", "address")


@serve.deployment(
    num_replicas=1,  # the prefix index and sessions live in the one router
    ray_actor_options={"num_cpus": 0},  # the router waits on I/O; CPUs go to the workers
    max_ongoing_requests=1000,
    health_check_period_s=10,
)
@serve.ingress()
class RadixrayRouter:
    """One replica: the worker pool plus the FastAPI router over it."""

    async def __init__(self, args: dict[str, Any]) -> None:
        values = {k: v for k, v in args.items() if k not in IGNORED_ARGS}
        self.config = ClusterConfig.from_dict(values)
        gpus = ray.cluster_resources().get("GPU", 0.0)
        device = self.config.resolve_device(gpus)
        count = self.config.resolve_workers(device, gpus)
        model_dir = str(resolve_model(self.config.model))
        self.pool = WorkerPool(self.config, device, Placement(self.config.bundle(device)))
        await self.pool.start(count)
        self.router_app = build_router(self.config, model_dir, self.pool, pool_backends(self.pool))
        self._watch = asyncio.get_running_loop().create_task(self.pool.watch())

    def __serve_build_asgi_app__(self) -> Any:
        return self.router_app

    def __del__(self) -> None:
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown()


def build_app(args: dict[str, Any]) -> serve.Application:
    """The Serve application (import path `cluster.serve_app:build_app`)."""
    return RadixrayRouter.bind(dict(args or {}))
