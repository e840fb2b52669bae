"""The router's set of workers: their backends, states and stats, and the task that keeps the
routing core in step with them (KV events, stats, dead-worker probes).

Worker states: `ready` (routed to), `draining` (finishes what it has, gets nothing new),
`dead` (failed: its index entries are purged at once; probed every `revive_s` and re-added with
a fresh snapshot when it answers again). A removed worker leaves no trace.

The cluster launcher drives this through plain methods that run on the router's event loop:
`attach(backend)` (a worker is ready, or was restarted), `detach(worker_id)` (it is gone),
`set_draining(worker_id, flag)`, `in_flight(worker_id)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from typing import Any

import msgpack

from router.backends import Backend, BackendDead
from router.config import RouterConfig
from router.metrics import RouterMetrics
from worker.protocol import WorkerStats

log = logging.getLogger("radixray.router")

_CALL_TIMEOUT_S = 10.0  # a poll that hangs longer than this counts as a failed poll


def batch_position(batch: bytes) -> tuple[int, int]:
    """(epoch, seq) of an encoded event batch, read without decoding its events."""
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(batch)
    unpacker.read_array_header()
    unpacker.skip()  # worker id
    return int(unpacker.unpack()), int(unpacker.unpack())


class WorkerRegistry:
    """Backends by worker id plus what the router knows of each; owns the polling task."""

    def __init__(self, config: RouterConfig, core: Any, metrics: RouterMetrics) -> None:
        self.config = config
        self.core = core
        self.metrics = metrics
        self.backends: dict[str, Backend] = {}  # ready or draining
        self.dead: dict[str, Backend] = {}
        self.draining: set[str] = set()
        self.info: dict[str, dict] = {}
        self.stats: dict[str, WorkerStats] = {}
        self.cursors: dict[str, tuple[int, int]] = {}  # worker -> (epoch, seq) applied
        self.inflight: Counter[str] = Counter()
        self.block_size = config.block_size
        self.encode: Any = None  # text -> token ids, set by the router (its tokenizer)
        self._pending: set[asyncio.Task] = set()
        self._task: asyncio.Task | None = None

    # --- membership ---------------------------------------------------------------------------

    async def add(self, backend: Backend) -> dict:
        """Waits for the worker, then routes to it; its cache arrives as a snapshot."""
        if getattr(backend, "encode", False) is None:
            backend.encode = self.encode  # an HTTP server that returns text only
        info = await backend.ready()
        wid = backend.worker_id
        self.forget(wid)
        self.info[wid] = info
        self.block_size = int(info.get("block_size") or self.block_size)
        self.backends[wid] = backend
        stats = await _stats_or_none(backend)
        if stats is not None:
            self.stats[wid] = stats
        self.core.add_worker(wid, stats)
        self.cursors[wid] = (-1, -1)
        await self.poll_events(wid)
        return info

    async def join(self, backends: list[Backend]) -> None:
        """Adds several workers at once; one that fails to join is probed again later."""
        await asyncio.gather(*(self._attach(b) for b in backends))

    def attach(self, backend: Backend) -> None:
        """`add` in the background (for a launcher whose callbacks are not coroutines)."""
        task = asyncio.get_running_loop().create_task(self._attach(backend))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _attach(self, backend: Backend) -> None:
        try:
            await self.add(backend)
        except Exception as exc:  # noqa: BLE001 - a worker that fails to join is left out
            log.warning("worker %s could not join: %s", backend.worker_id, exc)
            self.dead[backend.worker_id] = backend

    def detach(self, worker_id: str) -> None:
        """The worker is gone for good: stop routing to it and purge its index entries."""
        backend = self.backends.get(worker_id) or self.dead.get(worker_id)
        self.forget(worker_id)
        if backend is not None:
            self._spawn(backend.close())

    def forget(self, worker_id: str) -> None:
        if worker_id in self.backends:
            self.core.remove_worker(worker_id)
        self.backends.pop(worker_id, None)
        self.dead.pop(worker_id, None)
        self.draining.discard(worker_id)
        for table in (self.info, self.stats, self.cursors):
            table.pop(worker_id, None)
        self.metrics.forget_worker(worker_id)

    def mark_dead(self, worker_id: str) -> None:
        """A request or poll found the worker dead: purge it from routing now, probe later."""
        backend = self.backends.pop(worker_id, None)
        if backend is None:
            return
        log.warning("worker %s marked dead", worker_id)
        self.core.remove_worker(worker_id)
        self.draining.discard(worker_id)
        self.cursors.pop(worker_id, None)
        self.metrics.forget_worker(worker_id)
        self.dead[worker_id] = backend

    def set_draining(self, worker_id: str, draining: bool) -> None:
        if worker_id not in self.backends:
            raise KeyError(worker_id)
        self.core.set_draining(worker_id, draining)
        (self.draining.add if draining else self.draining.discard)(worker_id)

    def in_flight(self, worker_id: str) -> int:
        return self.inflight[worker_id]

    def state(self, worker_id: str) -> str:
        if worker_id in self.dead:
            return "dead"
        return "draining" if worker_id in self.draining else "ready"

    def max_context(self) -> int | None:
        known = [int(i.get("max_context") or 0) for i in self.info.values()]
        known = [k for k in known if k > 0]
        return min(known) if known else None

    # --- polling ------------------------------------------------------------------------------

    async def poll_events(self, worker_id: str) -> None:
        """Pulls new KV event batches into the core; a gap resets the cursor (next: snapshot)."""
        backend = self.backends.get(worker_id)
        if backend is None:
            return
        epoch, seq = self.cursors.get(worker_id, (-1, -1))
        batches = await asyncio.wait_for(backend.kv_events(epoch, seq), _CALL_TIMEOUT_S)
        if worker_id not in self.backends:
            return  # removed while we waited
        for batch in batches:
            if not self.core.apply_events(batch):
                self.cursors[worker_id] = (-1, -1)
                return
            self.cursors[worker_id] = batch_position(batch)

    async def poll_stats(self, worker_id: str) -> None:
        backend = self.backends.get(worker_id)
        if backend is None:
            return
        stats = await asyncio.wait_for(backend.stats(), _CALL_TIMEOUT_S)
        if worker_id not in self.backends:
            return
        self.stats[worker_id] = stats
        self.core.update_stats(stats)
        self.metrics.kv_free.labels(worker_id).set(stats.kv_free)
        self.metrics.running.labels(worker_id).set(stats.running)
        self.metrics.waiting.labels(worker_id).set(stats.waiting)

    async def revive(self, worker_id: str) -> None:
        backend = self.dead.get(worker_id)
        if backend is None:
            return
        await asyncio.wait_for(backend.ready(), _CALL_TIMEOUT_S)
        if self.dead.get(worker_id) is backend:
            log.info("worker %s answers again: re-added", worker_id)
            await self.add(backend)

    async def _each(self, method: Any, worker_ids: list[str]) -> None:
        results = await asyncio.gather(*(method(w) for w in worker_ids), return_exceptions=True)
        for wid, result in zip(worker_ids, results, strict=True):
            if isinstance(result, (BackendDead, asyncio.TimeoutError)) and method != self.revive:
                self.mark_dead(wid)
            elif isinstance(result, Exception) and not isinstance(result, BackendDead):
                log.warning("polling worker %s: %r", wid, result)

    async def run(self) -> None:
        """The polling loop: events every `event_poll_s`, stats and revival less often."""
        loop = asyncio.get_running_loop()
        next_stats = next_revive = 0.0
        while True:
            now = loop.time()
            await self._each(self.poll_events, list(self.backends))
            if now >= next_stats:
                next_stats = now + self.config.stats_poll_s
                await self._each(self.poll_stats, list(self.backends))
            if now >= next_revive and self.dead:
                next_revive = now + self.config.revive_s
                await self._each(self.revive, list(self.dead))
            await asyncio.sleep(self.config.event_poll_s)

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for backend in [*self.backends.values(), *self.dead.values()]:
            await backend.close()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)


async def _stats_or_none(backend: Backend) -> WorkerStats | None:
    try:
        return await asyncio.wait_for(backend.stats(), _CALL_TIMEOUT_S)
    except (BackendDead, asyncio.TimeoutError):
        return None
