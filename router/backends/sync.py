"""`WorkerSync`: the router's link to its workers' backends: joining, polling, reviving.

It keeps the registry's records (`router.routing.registry`) in step with the workers: a worker joins
once its backend answers `ready()` and `calibrate()` (its engine shape, its speeds where the
router must measure them, then its stats and a snapshot of its cache); KV events are pulled
every `event_poll_s`, stats every `stats_poll_s`; a worker whose poll fails is marked dead
(purged from routing at once) and tried again every `revive_s`, re-added with a fresh snapshot
when it answers again.

The cluster launcher drives it through plain methods that run on the router's event loop:
`attach(backend)` (a worker is ready, or was restarted), `detach(worker_id)` (it is gone),
`mark_dead(worker_id)`. Draining and in-flight counts are the registry's
(`WorkerRegistry.set_draining`, `WorkerState.in_flight`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from router.backends.base import Backend, BackendDead
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.routing.core import RoutingCore
from router.routing.registry import DEAD, WorkerState
from worker.protocol import EngineShape, WorkerStats

log = logging.getLogger("radixray.router")

_CALL_TIMEOUT_S = 10.0  # a poll that hangs longer than this counts as a failed poll


class WorkerSync:
    """Joins backends into the core's registry and owns the polling task."""

    def __init__(self, config: RouterConfig, core: RoutingCore, metrics: RouterMetrics) -> None:
        self.config = config
        self.core = core
        self.registry = core.registry
        self.metrics = metrics
        self._pending: set[asyncio.Task] = set()
        self._task: asyncio.Task | None = None

    # --- membership ---------------------------------------------------------------------------

    async def add(self, backend: Backend) -> WorkerState:
        """Waits for the worker (and its probe, `Backend.calibrate`), then routes to it; its
        cache arrives as a snapshot."""
        info = await backend.ready()
        await backend.calibrate()
        shape = EngineShape.from_info(info, self.registry.default_shape)
        worker = self.registry.add(backend.worker_id, shape, backend)
        stats = await _stats_or_none(backend)
        if stats is not None:
            self.core.update_stats(stats)
        await self.poll_events(worker.worker_id)
        return worker

    async def join(self, backends: list[Backend]) -> None:
        """Adds several workers at once; one that fails to join is probed again later."""
        await asyncio.gather(*(self._attach(b) for b in backends))

    def attach(self, backend: Backend) -> None:
        """`add` in the background (for a launcher whose callbacks are not coroutines)."""
        self._spawn(self._attach(backend))

    async def _attach(self, backend: Backend) -> None:
        try:
            await self.add(backend)
        except Exception as exc:  # noqa: BLE001 - a worker that fails to join is left out
            log.warning("worker %s could not join: %s", backend.worker_id, exc)
            self.registry.add_dead(backend.worker_id, backend)

    def detach(self, worker_id: str) -> None:
        """The worker is gone for good: stop routing to it and purge its index entries."""
        worker = self.registry.remove(worker_id)
        if worker is not None and worker.backend is not None:
            self._spawn(worker.backend.close())

    def mark_dead(self, worker_id: str) -> None:
        """A request or poll found the worker dead: purge it from routing now, probe later."""
        if self.registry.mark_dead(worker_id):
            log.warning("worker %s marked dead", worker_id)

    # --- polling ------------------------------------------------------------------------------

    def _live(self, worker_id: str) -> Backend | None:
        worker = self.registry.get(worker_id)
        return None if worker is None or worker.state == DEAD else worker.backend

    async def poll_events(self, worker_id: str) -> None:
        """Pulls new KV event batches into the core; a gap resets the cursor (next: snapshot)."""
        backend = self._live(worker_id)
        if backend is None:
            return
        cursor = self.core.event_cursor(worker_id) or (-1, -1)
        batches = await asyncio.wait_for(backend.kv_events(*cursor), _CALL_TIMEOUT_S)
        if self._live(worker_id) is not backend:
            return  # removed or replaced while we waited
        for batch in batches:
            if not self.core.apply_events(batch):
                self.registry[worker_id].cursor = None
                break
        for stale_id, session_id in self.core.take_stale_sessions():
            stale = self._live(stale_id)
            if stale is not None:
                self._spawn(self._close_stale(stale, session_id))

    async def _close_stale(self, backend: Backend, session_id: str) -> None:
        """Frees a session's copy on a worker its turns left (each replica may send it: the
        second close finds nothing)."""
        try:
            await asyncio.wait_for(backend.close_session(session_id), _CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the copy expires with its TTL anyway
            log.info("closing the stale copy of session %s on %s: %r",
                     session_id, backend.worker_id, exc)

    async def poll_stats(self, worker_id: str) -> None:
        backend = self._live(worker_id)
        if backend is None:
            return
        stats = await asyncio.wait_for(backend.stats(), _CALL_TIMEOUT_S)
        if self._live(worker_id) is not backend:
            return
        self.core.update_stats(stats)
        self.metrics.kv_free.labels(worker_id).set(stats.kv_free)
        self.metrics.running.labels(worker_id).set(stats.running)
        self.metrics.waiting.labels(worker_id).set(stats.waiting)

    async def revive(self, worker_id: str) -> None:
        worker = self.registry.get(worker_id)
        if worker is None or worker.state != DEAD or worker.backend is None:
            return
        backend = worker.backend
        await asyncio.wait_for(backend.ready(), _CALL_TIMEOUT_S)
        if self.registry.get(worker_id) is worker and worker.state == DEAD:
            log.info("worker %s answers again: re-added", worker_id)
            await self.add(backend)

    async def _each(
        self, method: Callable[[str], Awaitable[None]], worker_ids: list[str], probe: bool = False
    ) -> None:
        results = await asyncio.gather(*(method(w) for w in worker_ids), return_exceptions=True)
        for wid, result in zip(worker_ids, results, strict=True):
            if isinstance(result, (BackendDead, asyncio.TimeoutError)) and not probe:
                self.mark_dead(wid)
            elif isinstance(result, Exception) and not isinstance(result, BackendDead):
                log.warning("polling worker %s: %r", wid, result)

    async def run(self) -> None:
        """The polling loop: events every `event_poll_s`, stats and revival less often."""
        loop = asyncio.get_running_loop()
        next_stats = next_revive = 0.0
        while True:
            now = loop.time()
            live = [w.worker_id for w in self.registry.live()]
            await self._each(self.poll_events, live)
            if now >= next_stats:
                next_stats = now + self.config.stats_poll_s
                await self._each(self.poll_stats, [w.worker_id for w in self.registry.live()])
            dead = [w.worker_id for w in self.registry if w.state == DEAD]
            if now >= next_revive and dead:
                next_revive = now + self.config.revive_s
                await self._each(self.revive, dead, probe=True)
            await asyncio.sleep(self.config.event_poll_s)

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for worker in self.registry:
            if worker.backend is not None:
                await worker.backend.close()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)


async def _stats_or_none(backend: Backend) -> WorkerStats | None:
    try:
        return await asyncio.wait_for(backend.stats(), _CALL_TIMEOUT_S)
    except (TimeoutError, BackendDead):
        return None
