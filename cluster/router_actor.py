"""`RouterActor`: one router replica of `radixray serve`, a Ray actor (so Ray restarts it).

Each replica serves the whole router app (uvicorn over `router.api.app.create_app`) on the cluster's
address, joins the fleet's workers (each with its snapshot) and follows the fleet's changes
(`cluster/router_link.py`). Several replicas on one host answer on the same port: each binds
its own listening socket with `SO_REUSEPORT`, and the kernel spreads new connections over the
live ones; a replica that dies closes its socket, so new connections go to the others until
Ray has restarted it (its `__init__` runs again: it binds, joins the fleet and rebuilds its
index from the workers' snapshots). Every replica polls every worker's events and stats, so
their indexes converge and the load booked through one replica reaches the others in the
workers' reported running and waiting counts (one stats poll late, 0.5 s by default).

The replica runs its server on an asyncio loop in a thread of its own, started by `__init__`,
so that a restart by Ray serves again without anyone calling it. Its process title is Ray's,
`ray::RouterActor...`. Each response carries `X-Radixray-Router` (the replica's pid). Each
replica also listens on a port of its own (`ready()` says which), so that one replica can be
addressed alone (a health check, a test).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

import uvicorn
from ray.exceptions import RayActorError

from cluster.config import ClusterConfig
from cluster.fleet import find_fleet
from cluster.router_link import FLEET_RETRY_S, build_router
from router.api.http_server import server_config

log = logging.getLogger("radixray.cluster")

ROUTER_HEADER = b"x-radixray-router"


class RouterActor:
    """One replica: its thread serves the router until `stop()` (or the process dies)."""

    def __init__(self, config: ClusterConfig, model_dir: str) -> None:
        self.config = config
        self.model_dir = model_dir
        self._started: Future = Future()
        self._server: uvicorn.Server | None = None
        self._own_port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="radixray-router", daemon=True)
        self._thread.start()

    def ready(self, timeout_s: float = 300.0) -> dict:
        """Once the replica serves: `{"pid": ..., "port": its own port}`. Raises what stopped
        its start."""
        self._started.result(timeout_s)
        return {"pid": os.getpid(), "port": self._own_port}

    def stop(self) -> None:
        """Stop serving: new connections are refused, requests in flight get
        `drain_timeout_s` to finish (uvicorn's graceful shutdown, then the app's own wait)."""
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop may be closing already
                self._loop.call_soon_threadsafe(self._exit)
            self._thread.join(timeout=2 * self.config.drain_timeout_s + 10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # the thread must report, never die silently
            if isinstance(exc, SystemExit):  # uvicorn exits when it cannot start
                exc = RuntimeError(f"a router could not listen on {self.config.url()}")
            if not self._started.done():
                self._started.set_exception(exc)
            else:
                log.exception("router loop stopped")
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        fleet = find_fleet(self.config)
        if fleet is None:
            raise RuntimeError(f"no fleet named {self.config.fleet_name!r} runs on this Ray")
        app, link = build_router(self.config, self.model_dir, fleet)  # loads the tokenizer
        await _past_fleet_restarts(fleet.started.remote)  # serve once the workers are up
        limit = app.state.router.config.max_header_bytes
        uv = server_config(
            _RouterHeader(app, str(os.getpid()).encode()), limit, log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=max(1, round(self.config.drain_timeout_s)),
        )
        self._server = uvicorn.Server(uv)
        shared = listen_socket(self.config.host, self.config.port, reuse_port=True)
        own = listen_socket(self.config.host, 0, reuse_port=False)
        self._own_port = own.getsockname()[1]
        serving = asyncio.create_task(self._server.serve(sockets=[shared, own]))
        while not self._server.started and not serving.done():
            await asyncio.sleep(0.05)
        if serving.done():
            serving.result()
            raise RuntimeError(f"a router could not listen on {self.config.url()}")
        await _past_fleet_restarts(link.join)
        follow = asyncio.create_task(link.follow())
        self._started.set_result(None)
        await serving
        follow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follow

    def _exit(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        else:
            for task in asyncio.all_tasks(self._loop):
                task.cancel()


async def _past_fleet_restarts(call: Callable[[], Awaitable[Any]]) -> Any:
    """`await call()`, again after a second while the fleet actor is away (Ray restarts it): a
    replica that Ray restarts while the fleet is restarting too must still come to serve, not
    stay up without listening (seen in the chaos soak: both replicas then refused every
    connection)."""
    while True:
        try:
            return await call()
        except RayActorError as exc:
            log.warning("joining the fleet: %s; trying again", type(exc).__name__)
            await asyncio.sleep(FLEET_RETRY_S)


def listen_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A listening socket on host:port (port 0: a free one); with `reuse_port`, one that other
    replicas of this user bind too."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


class _RouterHeader:
    """ASGI wrapper: every HTTP response says which replica answered (`X-Radixray-Router`)."""

    def __init__(self, app: Any, value: bytes) -> None:
        self.app, self.value = app, value

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (ROUTER_HEADER, self.value)]}
            await send(message)

        await self.app(scope, receive, tagged)
