"""The admin verbs: list, add, drain and remove workers (`/v1/workers`, `/v1/admin/workers`).

`WorkerAdmin` reads the registry for the workers' JSON and changes membership through
`WorkerSync` (the registry follows); starting and stopping worker processes is the job of a
`WorkerControl` (the cluster launcher), without which adding answers 501.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable
from typing import Any, Protocol

from router.backends.base import Backend, BackendDead
from router.backends.sync import WorkerSync
from router.errors import APIError, bad_request, not_implemented
from router.routing.registry import DEAD, WorkerRegistry

_WORKER_KEYS = (
    "kv_total",
    "kv_free",
    "kv_evictable",
    "kv_protected",
    "kv_session",
    "kv_host_total",
    "kv_host_free",
    "running",
    "waiting",
    "sessions",
    "prefill_tokens_per_s",
    "decode_step_s",
)


class WorkerControl(Protocol):
    """What the admin endpoints need from whoever starts workers (the cluster launcher).

    `add_worker()` starts one worker and returns its `Backend` once it serves (the router then
    registers it). `remove_worker(id)` stops it for good; the router has already stopped
    routing to it. Either may be a plain function or a coroutine function. A control over
    engines it did not start (`cluster.route`) also has `url_worker(body) -> Backend`: the
    backend of the engine a `{"url", "events", "replay"}` body names.
    """

    def add_worker(self) -> Backend | Awaitable[Backend]: ...
    def remove_worker(self, worker_id: str) -> Any: ...


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class WorkerAdmin:
    """Membership changes asked for over HTTP."""

    def __init__(
        self, registry: WorkerRegistry, workers: WorkerSync, control: WorkerControl | None
    ) -> None:
        self.registry = registry
        self.workers = workers
        self.control = control

    def workers_json(self) -> list[dict]:
        out = []
        for worker in self.registry:
            stats = worker.stats
            row: dict[str, Any] = {
                "id": worker.worker_id,
                "state": worker.state,
                "in_flight": worker.in_flight,
            }
            row.update({k: getattr(stats, k, 0) if stats else 0 for k in _WORKER_KEYS})
            row["max_context"] = worker.shape.max_context
            # this router's view of the worker's cache: equal on two routers that agree
            blocks, digest = self.workers.core.index.confirmed(worker.worker_id)
            row["index_blocks"], row["index_digest"] = blocks, f"{digest & (1 << 64) - 1:016x}"
            out.append(row)
        return out

    async def add_workers(self, count: int) -> list[str]:
        if self.control is None:
            raise not_implemented("Adding workers")
        added = []
        for _ in range(count):
            backend = await _maybe_await(self.control.add_worker())
            await self.workers.add(backend)
            added.append(backend.worker_id)
        return added

    async def add_url_worker(self, body: dict) -> str:
        """Registers the external engine `body` names (`{"url", "events", "replay"}`), through
        the control's `url_worker`; 501 without one, 409 when it is a worker already, 400 when the
        engine does not answer."""
        make = getattr(self.control, "url_worker", None)
        if make is None:
            raise not_implemented("Adding a worker by url")
        backend = make(body)
        if backend.worker_id in self.registry:
            await backend.close()
            raise APIError(409, f"worker {backend.worker_id!r} already added", param="url",
                           code="worker_exists")
        try:
            await self.workers.add(backend)
        except (TimeoutError, BackendDead) as exc:
            if backend.worker_id in self.registry:
                self.workers.detach(backend.worker_id)  # closes the backend
            else:
                await backend.close()
            await _maybe_await(self.control.remove_worker(backend.worker_id))
            raise bad_request(f"the engine does not answer: {exc}", param="url",
                              code="worker_unreachable") from None
        return backend.worker_id

    def _known(self, worker_id: str) -> None:
        if worker_id not in self.registry:
            raise APIError(
                404, f"no worker {worker_id!r}", param="worker_id", code="worker_not_found"
            )

    async def drain(self, worker_id: str, timeout_s: float = 600.0) -> dict:
        """Stops routing to the worker, waits for its requests to end, then removes it."""
        self._known(worker_id)
        worker = self.registry[worker_id]
        if worker.state != DEAD:
            self.registry.set_draining(worker_id, True)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while worker.in_flight > 0 and loop.time() < deadline:
                await asyncio.sleep(0.05)
        return await self.remove(worker_id)

    async def remove(self, worker_id: str) -> dict:
        """Removes the worker from routing at once (and stops it, when a control is given)."""
        self._known(worker_id)
        self.workers.detach(worker_id)
        if self.control is not None:
            await _maybe_await(self.control.remove_worker(worker_id))
        return {"id": worker_id, "state": "removed"}
