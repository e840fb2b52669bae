"""One generation from route to last token, with failover.

`Dispatcher.open` routes the request, sends it and waits for its first chunk, so that a worker
failing before the first token costs the client nothing but time: the request is routed again
to the next best worker, the failed one excluded. After tokens have been streamed, a failure
sends the request to another worker with `resume_ids` = the tokens streamed so far; that worker
prefills prompt + those tokens and continues, so the client's stream goes on. At most
`max_failovers` moves per request. A worker found dead is purged from routing at once.

A worker that sends a request nothing for `stall_timeout_s` (before its first token or
between two) while its polled stats do not change either counts as dead the same way: a
stopped process or a stuck kernel does not hold its requests forever. It is marked dead
(purged from routing) and, like any dead worker, probed until it answers again, then re-added
with a fresh snapshot of its cache.

Load booked by `core.route` is released by exactly one `core.finish` per routed attempt, and
each attempt is counted on its worker's record by one `begin` and one `end`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from mem_cache.events import block_hashes
from router.backends.base import Backend, BackendDead, BackendRequestError
from router.backends.sync import WorkerSync
from router.errors import APIError, no_workers
from router.metrics import RouterMetrics
from router.routing.core import RoutingCore
from router.routing.registry import WorkerRegistry, WorkerState
from worker.protocol import GenerateRequest, TokenChunk, WorkerStats


class Dispatcher:
    """Sends requests to workers chosen by the routing core."""

    def __init__(
        self,
        core: RoutingCore,
        workers: WorkerSync,
        metrics: RouterMetrics,
        max_failovers: int = 2,
        namespace: str | None = None,
        stall_timeout_s: float | None = None,
    ) -> None:
        self.core = core
        self.registry: WorkerRegistry = core.registry
        self.workers = workers
        self.metrics = metrics
        self.max_failovers = max_failovers
        self.namespace = namespace
        # None: the router's configured deadline (the workers' link carries the config)
        if stall_timeout_s is None:
            stall_timeout_s = workers.config.stall_timeout_s
        self.stall_timeout_s = stall_timeout_s

    async def open(self, request: GenerateRequest, expected_output: int) -> Dispatch:
        """Routes and starts `request`; returns once its first chunk is in.

        Raises APIError: 503 when no worker can take it, 400 when the worker rejects it.
        """
        run = Dispatch(self, request, expected_output)
        try:
            await run.start()
        except BaseException:
            run._disarm()
            raise
        return run


class Dispatch:
    """One request in flight. Iterate it for chunks; `close()` it in every case."""

    def __init__(self, dispatcher: Dispatcher, request: GenerateRequest, expected: int) -> None:
        self.core = dispatcher.core
        self.registry = dispatcher.registry
        self.dispatcher = dispatcher
        self.request = request
        self.expected = expected
        self.tokens: list[int] = []  # output ids passed on so far (the resume point)
        self.failed: set[str] = set()
        self.failovers = 0
        self.worker_id = ""  # the worker serving now
        self.first_worker = ""  # the worker that produced the first token (response header)
        self.cached_tokens = 0
        self.predicted_tokens = 0
        self.finished = False
        self._backend: Backend | None = None
        self._worker: WorkerState | None = None  # the record `begin` counted this attempt on
        self._stream: AsyncIterator[TokenChunk] | None = None
        self._first: TokenChunk | None = None
        self._routed = False
        self._resumed = False  # a failover happened after the first token
        # the stall watchdog (`_receive`, `_check`): its timer, the task waiting for a chunk
        # (None between waits), when that wait began and the worker's stats then
        self._watch: asyncio.TimerHandle | None = None
        self._waiter: asyncio.Task | None = None
        self._since = 0.0
        self._seen: WorkerStats | None = None
        self._stalled = False  # `_check` cancelled the wait

    async def start(self) -> None:
        self._first = await self._attempt()
        self.first_worker = self.worker_id
        self.cached_tokens = min(self._first.cached_tokens, len(self.request.input_ids))

    def _route(self) -> Backend:
        hashes = block_hashes(
            self.request.input_ids + self.tokens,
            self.dispatcher.namespace,
            self.registry.block_size,
        )
        try:
            decision = self.core.route(
                self.request.request_id,
                hashes,
                len(self.request.input_ids) + len(self.tokens),
                max(self.expected - len(self.tokens), 1),
                session_id=self.request.session_id,
                exclude=tuple(self.failed),
            )
        except (LookupError, ValueError, RuntimeError) as exc:
            raise no_workers() from exc
        worker = self.registry.get(decision.worker_id)
        if worker is None or worker.backend is None:  # a worker with nothing to send to
            self.core.finish(self.request.request_id, None)
            self.failed.add(decision.worker_id)
            raise BackendDead(decision.worker_id)
        self._routed = True
        self.worker_id = decision.worker_id
        self.predicted_tokens = decision.cached_tokens
        self.dispatcher.metrics.routed.labels(decision.worker_id, decision.reason).inc()
        self._worker = self.registry.begin(self.worker_id)
        return worker.backend

    async def _attempt(self) -> TokenChunk:
        """Route, send, and return the first chunk; fail over while workers die."""
        while True:
            if not self.registry.live():
                raise no_workers()
            try:
                self._backend = self._route()
                request = dataclasses.replace(self.request, resume_ids=list(self.tokens))
                self._stream = self._backend.generate(request).__aiter__()
                chunk = await self._receive()
                if chunk.error and not chunk.token_ids:
                    raise BackendRequestError(chunk.error)
                self.core.first_token(self.request.request_id)
                return chunk
            except (BackendDead, StopAsyncIteration) as exc:
                self._fail(exc)
            except BackendRequestError as exc:
                self._release()
                raise APIError(400, f"the worker rejected the request: {exc}") from exc

    async def _receive(self) -> TokenChunk:
        """The next chunk of the current attempt; `BackendDead` when the worker sends nothing
        for `stall_timeout_s` and its stats did not change meanwhile (the stream is cancelled,
        which aborts it on the worker). A worker whose polled stats move is working (this
        request queued or preempted behind others), so the wait goes on.

        One timer per request watches the waits (`_check`): a chunk only records when its wait
        began, so the deadline costs a chunk no task and no timer of its own.
        """
        assert self._stream is not None
        timeout = self.dispatcher.stall_timeout_s
        if not timeout:
            return await self._stream.__anext__()
        loop = asyncio.get_running_loop()
        self._since = loop.time()
        self._seen = self._worker.stats if self._worker is not None else None
        if self._watch is None:
            self._watch = loop.call_at(self._since + timeout, self._check)
        task = self._waiter = asyncio.current_task()
        assert task is not None
        cancelling = task.cancelling()
        try:
            return await self._stream.__anext__()
        except asyncio.CancelledError:
            stalled, self._stalled = self._stalled, False
            # a cancel from elsewhere (the client left) stays a cancel, as in asyncio.timeout
            if not stalled or task.uncancel() > cancelling:
                raise
        finally:
            self._waiter = None
        self.dispatcher.metrics.stalls.inc()
        raise BackendDead(f"{self.worker_id}: sent nothing for {timeout:g} s")

    def _check(self) -> None:
        """The watchdog's timer: cancels the wait in `_receive` once it has lasted
        `stall_timeout_s` with the worker's stats unchanged since the wait (or the last change)
        began; otherwise sleeps until the wait could have lasted that long. Between waits it
        lapses, and the next `_receive` arms it again."""
        self._watch = None
        task = self._waiter
        if task is None or self.finished:
            return
        loop = asyncio.get_running_loop()
        now, timeout = loop.time(), self.dispatcher.stall_timeout_s
        if now < self._since + timeout:
            self._watch = loop.call_at(self._since + timeout, self._check)
            return
        stats = self._worker.stats if self._worker is not None else None
        if stats is not None and stats != self._seen:  # working on others: wait on
            self._since, self._seen = now, stats
            self._watch = loop.call_at(now + timeout, self._check)
            return
        self._stalled = True
        task.cancel()

    def _disarm(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def _fail(self, exc: BaseException) -> None:
        """The current worker died: release its booking, purge it, count a failover."""
        wid = self.worker_id
        self._release()
        if wid:
            self.failed.add(wid)
            self.dispatcher.workers.mark_dead(wid)
            self.worker_id = ""
        self.failovers += 1
        self.dispatcher.metrics.failovers.inc()
        if self.failovers > self.dispatcher.max_failovers:
            raise APIError(
                503, f"workers failed {self.failovers} times: {exc}", code="worker_failed"
            ) from exc

    def _release(self, cached_tokens: int | None = None) -> None:
        """Ends the current attempt: its booking in the core, its count on its worker."""
        if self._routed:
            self._routed = False
            self.core.finish(self.request.request_id, cached_tokens)
            if self._worker is not None:
                self.registry.end(self._worker)
                self._worker = None

    async def __aiter__(self) -> AsyncIterator[TokenChunk]:
        chunk = self._first
        self._first = None
        while chunk is not None:
            if self.worker_id == self.first_worker and not self._resumed:
                # some servers (HTTP) report the prefix hit only with the last chunk
                cached = min(chunk.cached_tokens, len(self.request.input_ids))
                self.cached_tokens = max(self.cached_tokens, cached)
            self.tokens.extend(chunk.token_ids)
            if chunk.finish_reason is None and len(self.tokens) >= self.request.sampling.max_tokens:
                chunk.finish_reason = "length"  # a resumed worker may not know the budget spent
            if chunk.finish_reason is not None:
                self._finish()
            yield chunk
            if self.finished:
                return
            chunk = await self._next()

    async def _next(self) -> TokenChunk:
        try:
            chunk = await self._receive()
            if chunk.error and chunk.finish_reason is None:
                chunk.finish_reason = "abort"
            return chunk
        except (BackendDead, StopAsyncIteration) as exc:
            self._fail(exc)
        self._resumed = True
        return await self._attempt()

    def _finish(self) -> None:
        self.finished = True
        self._disarm()
        self._release(self.cached_tokens)

    async def close(self) -> None:
        """Ends the request: aborts it on the worker if it is still running there."""
        self._disarm()
        if not self.finished and self._backend is not None:
            backend, rid = self._backend, self.request.request_id
            self._release()
            self.finished = True
            task = asyncio.get_running_loop().create_task(_quiet_abort(backend, rid))
            _aborts.add(task)  # keep a reference until done (the loop holds only a weak one)
            task.add_done_callback(_aborts.discard)
        if self._stream is not None and hasattr(self._stream, "aclose"):
            stream, self._stream = self._stream, None
            await stream.aclose()


_aborts: set[asyncio.Task] = set()


async def _quiet_abort(backend: Backend, request_id: str) -> None:
    try:
        await backend.abort(request_id)
    except Exception:  # noqa: BLE001 - the worker may be gone; nothing is left to abort then
        pass
