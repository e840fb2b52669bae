"""`RayBackend`: a `WorkerActor` handle (token ids in, `TokenChunk`s out, KV events and stats
pulled). Ray is imported when a call is made, not when this module is."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from router.backends.base import Backend, BackendDead, BackendRequestError
from worker.protocol import GenerateRequest, TokenChunk, WorkerStats

# Streamed items a worker may have sent that this router has not consumed yet; past it the
# worker's generator waits (its engine goes on: its chunks merge on the worker, a few ids
# each). A client that stops reading so holds a bounded buffer here, not its whole output.
STREAM_BUFFER = 16


def _chunks(item: Any) -> list[TokenChunk]:
    """A streamed item is one TokenChunk or a list of them (one engine step)."""
    return list(item) if isinstance(item, (list, tuple)) else [item]


class RayBackend(Backend):
    """A `WorkerActor` handle. Needs `ray.init` done in this process (or a Serve replica)."""

    def __init__(self, worker_id: str, handle: Any) -> None:
        self.worker_id = worker_id
        self.handle = handle

    async def _call(self, method: Any, *args: Any) -> Any:
        import ray.exceptions as rex

        try:
            return await method.remote(*args)
        except rex.RayTaskError as exc:
            raise _task_error(exc) from exc
        except rex.RayError as exc:
            raise BackendDead(f"{self.worker_id}: {exc}") from exc

    async def ready(self) -> dict[str, Any]:
        return dict(await self._call(self.handle.ready))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        import ray.exceptions as rex

        stream = None
        finished = False
        try:
            stream = self.handle.generate.options(
                num_returns="streaming", _generator_backpressure_num_objects=STREAM_BUFFER
            ).remote(request)
            async for ref in stream:
                for chunk in _chunks(await ref):
                    finished = chunk.finish_reason is not None
                    yield chunk
        except rex.RayTaskError as exc:
            raise _task_error(exc) from exc
        except rex.RayError as exc:
            raise BackendDead(f"{self.worker_id}: {exc}") from exc
        finally:
            if stream is not None and not finished:
                _cancel(stream)  # the worker aborts a request whose generator is cancelled

    async def abort(self, request_id: str) -> None:
        try:
            await self._call(self.handle.abort, request_id)
        except (BackendDead, BackendRequestError):
            pass  # a dead worker has nothing left to abort

    async def stats(self) -> WorkerStats:
        return await self._call(self.handle.stats)

    async def kv_events(self, epoch: int, after_seq: int) -> list[bytes]:
        return list(await self._call(self.handle.kv_events, epoch, after_seq))

    async def close_session(self, session_id: str) -> bool:
        return bool(await self._call(self.handle.close_session, session_id))


def _cancel(stream: Any) -> None:
    import ray

    try:
        ray.cancel(stream)
    except Exception:  # noqa: BLE001 - already finished or the worker is gone: nothing to stop
        pass


def _task_error(exc: Exception) -> Exception:
    """A worker-side exception: ValueError means a rejected request, anything else a failure."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, ValueError) or isinstance(exc, ValueError):
        return BackendRequestError(str(cause))
    return BackendDead(str(exc))
