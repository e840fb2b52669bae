"""`Launcher`: one radixray cluster run from this process (what `radixray serve` does).

1. Start a local Ray, or join one (`address="auto"` on a node of a running cluster).
2. Start the fleet (`cluster/fleet.py`): a detached, named actor that owns the workers. It
   reserves one placement-group bundle per worker, SPREAD across the nodes (GPUs when the
   cluster has them, else CPU workers), and starts one `WorkerActor` per bundle. A local Ray
   started here is fixed: bundles that do not fit fail at once, naming the missing resource,
   and CPU workers outnumbering its CPUs each reserve an equal share of them
   (`ClusterConfig.worker_cpus`). A joined Ray may grow (an autoscaler), so there a shortage is
   reported every 15 s while the fleet waits (`cluster/placement.py`).
3. Wait, with a progress display, until every worker has loaded its model.
4. Start `router_replicas` router replicas (`cluster/router_actor.py`), Ray actors on this node that
   answer on the same host:port: each joins the fleet's workers and follows the fleet's changes
   (`cluster/router_link.py`); adding, draining and removing workers are asked of the fleet.
   Ray restarts a replica that dies; the workers do not notice.
5. On Ctrl-C / SIGTERM: stop the replicas (each finishes its requests in flight first, up to
   `drain_timeout_s`), then stop the fleet explicitly (it kills the workers
   and frees the bundles), and stop the local Ray if this process started it, so no Ray
   process is left behind.
"""

from __future__ import annotations

import logging
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.config import ClusterConfig
from cluster.fleet import Member, create_fleet, stop_fleet
from cluster.router_actor import RouterActor
from worker.loader.builtin import resolve_model

log = logging.getLogger("radixray.cluster")


class Launcher:
    """Start with `start()` (returns when every router replica answers), stop with `stop()`."""

    def __init__(self, config: ClusterConfig, echo: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.echo = echo or (lambda line: print(line, file=sys.stderr, flush=True))
        self.fleet: Any = None  # the fleet actor's handle
        self.routers: list[Any] = []  # the router replicas' actor handles
        self._owns_ray = False
        self._local_ray = False  # a Ray this launcher started on this machine (cannot grow)

    @property
    def url(self) -> str:
        return self.config.url()

    def start(self) -> str:
        """Bring the cluster up; returns the routers' URL once they serve. On any failure (or
        Ctrl-C) everything started so far is stopped again and the error raised."""
        _check_port(self.config.host, self.config.port)
        t0 = time.monotonic()
        try:
            self._start_ray()
            gpus = ray.cluster_resources().get("GPU", 0.0)
            device = self.config.resolve_device(gpus)
            count = self.config.resolve_workers(device, gpus)
            model_dir = resolve_model(self.config.model)  # a built-in model is generated here
            self.echo(f"radixray: {count} {device} {self.config.engine} worker(s) of "
                      f"{self.config.model} ({model_dir})")
            bundle = self.config.bundle(device, self._worker_cpus(device, count))
            self.fleet = create_fleet(self.config, device, bundle, fixed=self._local_ray)
            starting = self.fleet.start.remote(count)
            self._start_routers(str(model_dir))  # they load while the workers load
            self._wait_fleet(starting, count)
            self._wait_routers()
        except BaseException:
            self.stop()
            raise
        self.echo(f"radixray: ready in {time.monotonic() - t0:.1f}s at {self.url}")
        return self.url

    def workers(self) -> dict[str, Member]:
        """The fleet's workers now, by id."""
        _, members = ray.get(self.fleet.members.remote())
        return {m.worker_id: m for m in members}

    def stop(self) -> None:
        """Stop the routers, then the fleet (every worker, every bundle); stop Ray if we
        started it."""
        if ray.is_initialized():
            # every replica drains its requests in flight at once (up to drain_timeout_s)
            stopping = [router.stop.remote() for router in self.routers]
            timeout = 2 * self.config.drain_timeout_s + 20
            for router, stopped in zip(self.routers, stopping, strict=True):
                try:
                    ray.get(stopped, timeout=timeout)
                except Exception as exc:  # noqa: BLE001 - dead already, or hung: killed below
                    log.warning("stopping a router: %r", exc)
                ray.kill(router, no_restart=True)
            if self.fleet is not None:
                stop_fleet(self.fleet, self.config)
        self.routers, self.fleet = [], None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False

    def _start_ray(self) -> None:
        if ray.is_initialized():
            return  # a test (or a notebook) already holds a Ray: use it, leave it running
        if self.config.address:
            ray.init(address=self.config.address, namespace=self.config.namespace)
        else:
            # "local": a new Ray even when a `ray start` one runs here (--address auto joins it)
            ray.init(
                address="local",
                num_cpus=self.config.num_cpus,
                include_dashboard=False,
                namespace=self.config.namespace,
            )
            self._local_ray = True
        self._owns_ray = True

    def _worker_cpus(self, device: str, count: int) -> float:
        """CPUs per worker; on a local Ray with fewer CPUs than CPU workers, a share of them."""
        local = None
        if self._local_ray and device == "cpu":
            local = ray.cluster_resources().get("CPU", 0.0)
        cpus = self.config.worker_cpus(count, local)
        if self.config.cpus_per_worker is None and cpus != 1.0:
            self.echo(f"radixray: this local Ray has {local:g} CPU(s) for {count} workers: each "
                      f"reserves {cpus:g} CPU (--cpus-per-worker sets it)")
        return cpus

    def _wait_fleet(self, starting: ray.ObjectRef, count: int) -> None:
        """Wait for the fleet's start, showing each worker as it becomes ready; a failure of the
        fleet (a `PlacementError`, a model that does not load) is raised as itself."""
        progress = _Progress(count, self.echo)
        version, shown = -1, set()
        try:
            while not ray.wait([starting], timeout=0)[0]:
                version, members = ray.get(self.fleet.changes.remote(version, 1.0))
                for m in members:
                    if m.state == "ready" and m.worker_id not in shown:
                        shown.add(m.worker_id)
                        progress.update(m.worker_id)
                progress.heartbeat(lambda: ray.get(self.fleet.placing.remote()))
            ray.get(starting)
        except RayTaskError as exc:
            raise (exc.cause if isinstance(exc.cause, Exception) else exc) from None

    def _start_routers(self, model_dir: str) -> None:
        """`router_replicas` replicas on this node (they share its port); each serves once the
        fleet has started."""
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        options = _RemoteRouter.options(
            num_cpus=0,  # a router waits on I/O; CPUs go to the workers
            max_restarts=-1,  # Ray restarts a replica that dies; it rejoins the fleet
            max_concurrency=4,  # `ready` waits while `stop` may come
            scheduling_strategy=here,
        )
        count = self.config.router_replicas
        self.routers = [options.remote(self.config, model_dir) for _ in range(count)]

    def _wait_routers(self) -> None:
        try:
            ray.get([r.ready.remote() for r in self.routers])
        except RayTaskError as exc:
            raise (exc.cause if isinstance(exc.cause, Exception) else exc) from None


class _Progress:
    """One line per worker as it becomes ready (`[1/2] worker-0 ready (4.1s)`), and a
    heartbeat line while they load."""

    def __init__(self, total: int, echo: Callable[[str], None], every_s: float = 15.0) -> None:
        self.total, self.done, self.echo, self.every_s = total, 0, echo, every_s
        self.t0 = self.beat = time.monotonic()
        echo(f"radixray: loading the model on {total} worker(s)...")

    def update(self, worker_id: str) -> None:
        self.done += 1
        elapsed = time.monotonic() - self.t0
        self.echo(f"  [{self.done}/{self.total}] {worker_id} ready ({elapsed:.1f}s)")

    def heartbeat(self, placing: Callable[[], bool]) -> None:
        """A line every `every_s` while big models load, so a slow start never looks hung;
        none while Ray places the workers (the placement says what it waits for)."""
        now = time.monotonic()
        if now - self.beat >= self.every_s:
            self.beat = now
            if not placing():
                self.echo(f"  ... {self.done}/{self.total} ready after {now - self.t0:.0f}s")


_RemoteRouter = ray.remote(RouterActor)


def _check_port(host: str, port: int) -> None:
    """Fail before loading any model when the router's port is taken."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise RuntimeError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
