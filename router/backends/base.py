"""Where requests go: one `Backend` per worker, behind one interface.

`RayBackend` (`router.backends.ray`) talks to a `WorkerActor` handle; `HttpBackend`
(`router.backends.http`) to any OpenAI-compatible server (vLLM, SGLang, another radixray).
This module imports neither Ray nor aiohttp, so the routing registry can name `Backend`.

Errors are two kinds, and the dispatch treats them differently:
`BackendDead` (the worker is gone or unreachable: fail over to another worker) and
`BackendRequestError` (the worker refused this request: no point retrying elsewhere).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

from worker.protocol import GenerateRequest, TokenChunk, WorkerStats


class BackendDead(Exception):
    """The worker died or cannot be reached."""


class BackendRequestError(Exception):
    """The worker rejected the request itself (bad parameters); retrying elsewhere won't help."""


class Backend(ABC):
    """One worker as the router sees it. All methods are called from the router's event loop."""

    worker_id: str

    @abstractmethod
    async def ready(self) -> dict[str, Any]:
        """Waits until the worker serves; returns at least `model`, and the engine's shape as
        far as the worker knows it (the keys of `worker.protocol.EngineShape`; the router takes
        the documented defaults for the others)."""

    @abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        """Streams the request's chunks; the last one has `finish_reason` set. Stopping the
        iteration early does not abort the request on the worker: call `abort`."""

    @abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abstractmethod
    async def stats(self) -> WorkerStats: ...

    @abstractmethod
    async def kv_events(self, epoch: int, after_seq: int) -> list[bytes]:
        """Encoded KV event batches after `after_seq` of `epoch`, or a snapshot batch
        (starting with AllCleared) when the epoch differs or the batches are gone."""

    @abstractmethod
    async def close_session(self, session_id: str) -> bool: ...

    async def calibrate(self) -> None:  # noqa: B027 - most workers measure themselves
        """Measures the worker's speeds before it takes requests, where only the router can
        (an external engine: `HttpBackend.calibrate`); called once it is `ready()`."""

    async def close(self) -> None:  # noqa: B027 - most backends hold nothing to release
        """Releases connections; the worker itself keeps running."""
