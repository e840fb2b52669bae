"""The router as a Ray Serve application, for KubeRay `RayService` (zero-downtime rollouts).

`serveConfigV2` names `cluster.serve_app:build_app` and passes `args` with the same knobs as
`radixray serve` in snake_case (model, workers, gpus_per_worker, device, policy, kv_tokens,
page_size, host_kv_tokens, host_policy, api_key, admin_key, fleet_name, ...). `host`, `port`
and `address` are accepted and ignored: Serve's HTTP proxy listens, and the replica runs inside
the cluster. Keys are best left out of `args` (which the RayService manifest shows): a replica
takes `RADIXRAY_API_KEY` and `RADIXRAY_ADMIN_KEY` from its environment (a Kubernetes Secret).
Without an admin key the admin verbs answer loopback clients only, which behind Serve's proxy
is seldom anyone: give the app an admin key to scale it live.

The router replica does not own the workers. The fleet (`cluster/fleet.py`, a detached actor
named `fleet_name`) does: the first replica creates it (get-or-create by name), and a replica
that Serve restarts, or a new replica of a rollout, joins the running fleet and rebuilds its
index from the workers' snapshots. `router_replicas` replicas run side by side, each over every
worker. A redeploy that changes the workers' own knobs (model, KV sizes) must name a new
`fleet_name`: a replica refuses to join a fleet whose workers run another engine config.
Deleting the app leaves the fleet running (its workers keep their caches for the next
deployment); `cluster.fleet.stop_fleet` stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import ray
from ray import serve

from cluster.config import ClusterConfig
from cluster.fleet import get_or_create_fleet
from cluster.router_link import build_router
from worker.loader.builtin import resolve_model

IGNORED_ARGS = ("host", "port", "address")


@serve.deployment(
    num_replicas=1,
    ray_actor_options={"num_cpus": 0},  # the router waits on I/O; CPUs go to the workers
    max_ongoing_requests=1000,
    health_check_period_s=10,
)
@serve.ingress()
class RadixrayRouter:
    """One replica: the FastAPI router over the fleet's workers."""

    async def __init__(self, args: dict[str, Any]) -> None:
        values = {k: v for k, v in args.items() if k not in IGNORED_ARGS}
        self.config = ClusterConfig.from_dict(values)
        gpus = ray.cluster_resources().get("GPU", 0.0)
        device = self.config.resolve_device(gpus)
        count = self.config.resolve_workers(device, gpus)
        model_dir = str(resolve_model(self.config.model))
        fleet = await get_or_create_fleet(self.config, device, self.config.bundle(device))
        await fleet.start.remote(count)  # at once when the fleet already runs
        self.router_app, link = build_router(self.config, model_dir, fleet)
        await link.join()
        self._follow = asyncio.get_running_loop().create_task(link.follow())

    def __serve_build_asgi_app__(self) -> Any:
        return self.router_app

    def __del__(self) -> None:
        follow = getattr(self, "_follow", None)
        if follow is not None:
            with contextlib.suppress(RuntimeError):  # its loop may be closed already
                follow.cancel()


def build_app(args: dict[str, Any]) -> serve.Application:
    """The Serve application (import path `cluster.serve_app:build_app`), with
    `router_replicas` replicas."""
    args = dict(args or {})
    config = ClusterConfig.from_dict({k: v for k, v in args.items() if k not in IGNORED_ARGS})
    return RadixrayRouter.options(num_replicas=config.router_replicas).bind(args)
