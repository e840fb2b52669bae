"""The router's one record per worker (`WorkerState`), held by one `WorkerRegistry`.

Everything the router knows of a worker lives in its record: the backend that reaches it, its
state, the engine shape it reported, its latest stats, the cursor of the KV events applied
from it, and the requests this router has in flight on it. The routing core, the dispatcher,
the metrics and the admin endpoints read the record; none keeps a copy.

States: `ready` (routed to), `draining` (finishes what it has, gets nothing new), `dead`
(failed: kept only so that it can be probed and re-added; nothing routes to it and the parts
that keep per-worker data have already forgotten it).

Membership changes are single calls that every part follows: the registry tells its listeners
(`WorkerListener`: the routing core with its index, ledger, sessions and rates; the metrics)
when a worker joins and when it leaves routing (removed, or dead). Not thread-safe: one owner
(the router's event loop, or the simulator) calls it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from worker.protocol import EngineShape, WorkerStats

if TYPE_CHECKING:  # the routing room imports no transport: the simulator runs it
    from router.backends.base import Backend

READY, DRAINING, DEAD = "ready", "draining", "dead"


@dataclass(slots=True)
class WorkerState:
    """One worker as the router knows it."""

    worker_id: str
    shape: EngineShape
    backend: Backend | None = None  # None in the simulator, which calls no worker
    state: str = READY
    stats: WorkerStats | None = None  # last reported, None until the first report
    cursor: tuple[int, int] | None = None  # (epoch, seq) of the last applied event batch
    in_flight: int = 0  # requests this router sent it that have not ended (`begin` / `end`)
    # requests its last stats counted beyond this router's bookings when they arrived (other
    # routers'): fixed until the next stats, so releases since then do not look like load
    foreign_requests: int = 0

    @property
    def routable(self) -> bool:
        return self.state == READY


class WorkerListener(Protocol):
    """A part that keeps data per worker and follows the registry's membership."""

    def worker_joined(self, worker: WorkerState) -> None: ...
    def worker_left(self, worker_id: str) -> None: ...


class WorkerRegistry:
    """worker id -> `WorkerState`, in order of joining; see the module docstring."""

    def __init__(self, default_shape: EngineShape | None = None) -> None:
        self.default_shape = default_shape or EngineShape()
        self._workers: dict[str, WorkerState] = {}
        self._listeners: list[WorkerListener] = []
        self._block_size = self.default_shape.block_size

    def subscribe(self, listener: WorkerListener) -> None:
        self._listeners.append(listener)

    # --- reading ------------------------------------------------------------------------------

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    def __iter__(self) -> Iterator[WorkerState]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def __getitem__(self, worker_id: str) -> WorkerState:
        return self._workers[worker_id]

    def get(self, worker_id: str) -> WorkerState | None:
        return self._workers.get(worker_id)

    def live(self) -> list[WorkerState]:
        """Ready and draining workers (routed to or finishing), in order of joining."""
        return [w for w in self._workers.values() if w.state != DEAD]

    def routable(self) -> list[WorkerState]:
        """Ready workers, in order of joining."""
        return [w for w in self._workers.values() if w.state == READY]

    @property
    def block_size(self) -> int:
        """Tokens per hashed block, for the whole index: the last joined worker's (the workers
        of one fleet share it), the default shape's before any joined."""
        return self._block_size

    def max_context(self) -> int | None:
        """The smallest context any live worker reported, None when none did."""
        known = [w.shape.max_context for w in self.live() if w.shape.max_context > 0]
        return min(known) if known else None

    # --- membership ---------------------------------------------------------------------------

    def add(
        self, worker_id: str, shape: EngineShape | None = None, backend: Backend | None = None
    ) -> WorkerState:
        """A worker is ready (new, restarted or revived): a fresh record, routed to at once.
        A record of the same id is removed first, so nothing of its past life remains.
        Without a shape it takes `default_shape` (the router's configured block size)."""
        self.remove(worker_id)
        worker = WorkerState(worker_id, shape or self.default_shape, backend)
        self._workers[worker_id] = worker
        self._block_size = worker.shape.block_size
        for listener in self._listeners:
            listener.worker_joined(worker)
        return worker

    def add_dead(self, worker_id: str, backend: Backend) -> WorkerState:
        """A worker that failed to join: recorded dead, to be probed (`add` once it answers)."""
        self.remove(worker_id)
        worker = WorkerState(worker_id, self.default_shape, backend, state=DEAD)
        self._workers[worker_id] = worker
        return worker

    def remove(self, worker_id: str) -> WorkerState | None:
        """The worker is gone for good: every part forgets it. Unknown ids return None."""
        worker = self._workers.pop(worker_id, None)
        if worker is not None and worker.state != DEAD:
            self._left(worker_id)
        return worker

    def mark_dead(self, worker_id: str) -> bool:
        """The worker failed: nothing routes to it and every part forgets its data; the record
        (with its backend) stays for probing. False when it is unknown or dead already."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.state == DEAD:
            return False
        worker.state = DEAD
        worker.cursor = None
        self._left(worker_id)
        return True

    def set_draining(self, worker_id: str, draining: bool = True) -> None:
        """A draining worker gets no new requests (its sessions move); `KeyError` unless the
        worker is ready or draining."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.state == DEAD:
            raise KeyError(worker_id)
        worker.state = DRAINING if draining else READY

    def _left(self, worker_id: str) -> None:
        for listener in self._listeners:
            listener.worker_left(worker_id)

    # --- requests -----------------------------------------------------------------------------

    def begin(self, worker_id: str) -> WorkerState:
        """A request is sent to the worker; returns its record, for `end`."""
        worker = self._workers[worker_id]
        worker.in_flight += 1
        return worker

    @staticmethod
    def end(worker: WorkerState) -> None:
        """A request `begin` counted on this record ended (finished, failed or aborted). The
        record, not the id: a worker re-added meanwhile has a fresh record, not this count."""
        worker.in_flight -= 1
