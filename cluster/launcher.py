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
4. Serve the router (uvicorn + `router.app.create_app` over Ray backends) in this process, on
   the head node: it joins the fleet's workers and follows the fleet's changes
   (`cluster/router_link.py`); adding, draining and removing workers are asked of the fleet.
5. On Ctrl-C / SIGTERM: stop the server, then stop the fleet explicitly (it kills the workers
   and frees the bundles), and stop the local Ray if this process started it, so no Ray
   process is left behind.

The router and its link to the fleet share one asyncio loop in a background thread, so the
main thread stays free for signals (and a test can run a launcher in-process).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import ray
import uvicorn
from ray.exceptions import RayTaskError

from cluster.config import ClusterConfig
from cluster.fleet import Member, create_fleet, stop_fleet
from cluster.router_link import build_router
from worker.models.builtin import resolve_model

log = logging.getLogger("radixray.cluster")


class Launcher:
    """Start with `start()` (returns when the router answers), stop with `stop()`."""

    def __init__(self, config: ClusterConfig, echo: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.echo = echo or (lambda line: print(line, file=sys.stderr, flush=True))
        self.fleet: Any = None  # the fleet actor's handle
        self.app: Any = None
        self._owns_ray = False
        self._local_ray = False  # a Ray this launcher started on this machine (cannot grow)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: uvicorn.Server | None = None
        self._follow: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return self.config.url()

    def start(self) -> str:
        """Bring the cluster up; returns the router's URL once it serves. On any failure (or
        Ctrl-C) everything started so far is stopped again and the error raised."""
        _check_port(self.config.host, self.config.port)
        t0 = time.monotonic()
        try:
            self._start_ray()
            # Ray builds its serializer on first use and imports pydantic.v1 then. Done here,
            # before the router's threads start, it cannot race their own pydantic imports
            # (that race failed a CI run once: KeyError 'pydantic.v1' in placement_group.ready)
            ray.put(None)
            gpus = ray.cluster_resources().get("GPU", 0.0)
            device = self.config.resolve_device(gpus)
            count = self.config.resolve_workers(device, gpus)
            model_dir = resolve_model(self.config.model)  # a built-in model is generated here
            self.echo(f"radixray: {count} {device} worker(s) of {self.config.model} ({model_dir})")
            bundle = self.config.bundle(device, self._worker_cpus(device, count))
            self.fleet = create_fleet(self.config, device, bundle, fixed=self._local_ray)
            started: Future = Future()
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=self._run, args=(count, str(model_dir), started), name="radixray-router",
                daemon=True,
            )
            self._thread.start()
            started.result()
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
        """Stop serving, then the fleet (every worker, every bundle); stop Ray if we started it."""
        if self._loop and self._thread and self._thread.is_alive():
            # A failed start wakes us before its thread has closed the loop: it may be closing.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._request_exit)
            self._thread.join(timeout=30)
        if self.fleet is not None and ray.is_initialized():
            stop_fleet(self.fleet)
            self.fleet = None
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

    def _run(self, count: int, model_dir: str, started: Future) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve(count, model_dir, started))
        except BaseException as exc:  # the thread must report, never die silently
            if isinstance(exc, SystemExit):  # uvicorn exits when it cannot start
                exc = RuntimeError(f"the router could not listen on {self.url}")
            if not started.done():
                started.set_exception(exc)
            else:
                log.exception("router loop stopped")
        finally:
            self._loop.close()

    async def _serve(self, count: int, model_dir: str, started: Future) -> None:
        loop = asyncio.get_running_loop()
        # The router (its tokenizer) loads in a thread while the workers load their models.
        built = loop.run_in_executor(None, build_router, self.config, model_dir, self.fleet)
        await self._start_fleet(count)
        self.app, link = await built
        uv = uvicorn.Config(
            self.app, host=self.config.host, port=self.config.port,
            log_level="warning", lifespan="on", timeout_graceful_shutdown=5,
        )
        self._server = uvicorn.Server(uv)
        serving = asyncio.create_task(self._server.serve())
        while not self._server.started and not serving.done():
            await asyncio.sleep(0.05)
        if serving.done():
            serving.result()
            raise RuntimeError(f"the router could not listen on {self.url}")
        await link.join()
        self._follow = asyncio.create_task(link.follow())
        started.set_result(None)
        await serving
        self._follow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._follow

    async def _start_fleet(self, count: int) -> None:
        """Start the fleet's workers, showing each as it becomes ready; a failure of the fleet
        (a `PlacementError`, a model that does not load) is raised as itself."""
        progress = _Progress(count, self.echo)
        beat = asyncio.create_task(progress.heartbeat(self.fleet))
        starting = asyncio.ensure_future(self.fleet.start.remote(count))
        version, shown = -1, set()
        try:
            while not starting.done():
                change = asyncio.ensure_future(self.fleet.changes.remote(version, 5.0))
                await asyncio.wait({starting, change}, return_when=asyncio.FIRST_COMPLETED)
                if change.done():
                    version, members = change.result()
                    for m in members:
                        if m.state == "ready" and m.worker_id not in shown:
                            shown.add(m.worker_id)
                            progress.update(m.worker_id)
                else:
                    change.cancel()
            starting.result()
        except RayTaskError as exc:
            raise (exc.cause if isinstance(exc.cause, Exception) else exc) from None
        finally:
            beat.cancel()

    def _request_exit(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        else:  # still loading workers: cancel everything on the loop
            for task in asyncio.all_tasks(self._loop):
                task.cancel()


class _Progress:
    """One line per worker as it becomes ready (`[1/2] worker-0 ready (4.1s)`), and a
    heartbeat line while they load."""

    def __init__(self, total: int, echo: Callable[[str], None]) -> None:
        self.total, self.done, self.echo = total, 0, echo
        self.t0 = time.monotonic()
        echo(f"radixray: loading the model on {total} worker(s)...")

    def update(self, worker_id: str) -> None:
        self.done += 1
        elapsed = time.monotonic() - self.t0
        self.echo(f"  [{self.done}/{self.total}] {worker_id} ready ({elapsed:.1f}s)")

    async def heartbeat(self, fleet: Any, every_s: float = 15.0) -> None:
        """A line now and then while big models load, so a slow start never looks hung; none
        while Ray places the workers (the placement says what it waits for)."""
        while True:
            await asyncio.sleep(every_s)
            if not await fleet.placing.remote():
                elapsed = time.monotonic() - self.t0
                self.echo(f"  ... {self.done}/{self.total} ready after {elapsed:.0f}s")


def _check_port(host: str, port: int) -> None:
    """Fail before loading any model when the router's port is taken."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise RuntimeError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
