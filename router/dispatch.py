"""One choice of one request, from route to last token: failover, stop strings, text.

A request asks for one or more choices (prompts x n); each is one `Choice`. `Dispatcher.open`
routes a choice, sends it and waits for its first chunk, so that a worker failing before the
first token costs the client nothing but time: the choice is routed again to the next best
worker, the failed one excluded. After tokens have been streamed, a failure sends it to another
worker with `resume_ids` = the tokens streamed so far; that worker prefills prompt + those
tokens and continues, so the client's stream goes on. At most `max_failovers` moves per choice.
A worker found dead is purged from routing at once.

A worker that sends a choice nothing for `stall_timeout_s` (before its first token or between
two) while its polled stats do not change either counts as dead the same way: a stopped
process or a stuck kernel does not hold its requests forever. It is marked dead (purged from
routing) and, like any dead worker, probed until it answers again, then re-added with a fresh
snapshot of its cache.

`Choice.deltas` turns the chunks into `ChoiceDelta`s of text (incremental detokenization);
stop strings end a choice in the router, and the worker is told to abort.

Load booked by `core.route` is released by exactly one `core.finish` per routed attempt, and
each attempt is counted on its worker's record by one `begin` and one `end`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from mem_cache.events import block_hashes
from router.backends.base import Backend, BackendDead, BackendRequestError
from router.backends.sync import WorkerSync
from router.errors import APIError, no_workers
from router.job import Job
from router.metrics import RouterMetrics
from router.routing.core import RoutingCore
from router.routing.registry import WorkerRegistry, WorkerState
from router.tokenizer import TextStream, Tokenizer
from worker.protocol import GenerateRequest, TokenChunk, WorkerStats

TokenLogprob = tuple[int, float, list[tuple[int, float]]]  # token, logprob, top alternatives


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None


class Dispatcher:
    """What every choice uses: the routing core, the workers' link, the metrics, the
    tokenizer and the failover limits."""

    def __init__(
        self,
        core: RoutingCore,
        workers: WorkerSync,
        metrics: RouterMetrics,
        tokenizer: Tokenizer,
        max_failovers: int = 2,
        namespace: str | None = None,
        stall_timeout_s: float | None = None,
    ) -> None:
        self.core = core
        self.registry: WorkerRegistry = core.registry
        self.workers = workers
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.max_failovers = max_failovers
        self.namespace = namespace
        # None: the router's configured deadline (the workers' link carries the config)
        if stall_timeout_s is None:
            stall_timeout_s = workers.config.stall_timeout_s
        self.stall_timeout_s = stall_timeout_s

    async def open(self, index: int, request: GenerateRequest, job: Job) -> Choice:
        """Routes and starts choice `index` of `job`; returns once its first chunk is in.

        Raises APIError: 503 when no worker can take it, 400 when the worker rejects it.
        """
        choice = Choice(self, index, request, job)
        try:
            await choice.start()
        except BaseException:
            choice._disarm()
            raise
        return choice


class Choice:
    """One choice in flight. Iterate `deltas()` for its text; `close()` it in every case."""

    def __init__(self, dispatcher: Dispatcher, index: int, request: GenerateRequest,
                 job: Job) -> None:
        self.core = dispatcher.core
        self.registry = dispatcher.registry
        self.dispatcher = dispatcher
        self.index = index
        self.request = request
        self.job = job
        self.expected = job.sampling.max_tokens
        self.token_ids: list[int] = []  # output ids passed on so far (the resume point)
        self.finish_reason: str | None = None
        self.deltas_seen: list[ChoiceDelta] = []  # kept only when logprobs are asked for
        self._text: TextStream | None = None  # the text side, from the first `deltas()`
        self.failed: set[str] = set()
        self.failovers = 0
        self.worker_id = ""  # the worker serving now
        self.first_worker = ""  # the worker that produced the first token (response header)
        self.cached_tokens = 0
        self.predicted_tokens = 0  # the index's hit on the worker routed to last
        self.first_predicted = 0  # ... on the first worker (whose real hit `cached_tokens` is)
        self.block_size = 0  # of the hashes the prediction came from
        self.finished = False  # the worker's part is over (finished, or aborted by `close`)
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

    # --- route and start ----------------------------------------------------------------------

    async def start(self) -> None:
        self._first = await self._attempt()
        self.first_worker = self.worker_id
        self.first_predicted = self.predicted_tokens
        self.cached_tokens = min(self._first.cached_tokens, len(self.request.input_ids))

    def _route(self) -> Backend:
        hashes = block_hashes(
            self.request.input_ids + self.token_ids,
            self.dispatcher.namespace,
            self.registry.block_size,
        )
        try:
            decision = self.core.route(
                self.request.request_id,
                hashes,
                len(self.request.input_ids) + len(self.token_ids),
                max(self.expected - len(self.token_ids), 1),
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
        self.block_size = self.registry.block_size
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
                request = dataclasses.replace(self.request, resume_ids=list(self.token_ids))
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

    # --- stream --------------------------------------------------------------------------------

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """The choice's text as it comes, across failovers; closes the choice when done."""
        metrics = self.dispatcher.metrics
        job = self.job
        self._text = TextStream(self.dispatcher.tokenizer, job.stop, job.skip_special_tokens)
        last = time.perf_counter()
        chunk, self._first = self._first, None
        try:
            while chunk is not None:
                t = time.perf_counter()
                if not self.token_ids:
                    metrics.ttft.observe(t - job.arrival)
                elif chunk.token_ids:
                    metrics.inter_token.observe((t - last) / len(chunk.token_ids))
                last = t
                delta = self._apply(chunk)
                if delta.text or delta.token_ids or delta.finish_reason:
                    yield delta
                if self.finish_reason:
                    return
                chunk = await self._next()
        finally:
            await self.close()

    def _apply(self, chunk: TokenChunk) -> ChoiceDelta:
        """Takes one chunk: its tokens join the resume point, its text the stream."""
        if self.worker_id == self.first_worker and not self._resumed:
            # some servers (HTTP) report the prefix hit only with the last chunk
            cached = min(chunk.cached_tokens, len(self.request.input_ids))
            self.cached_tokens = max(self.cached_tokens, cached)
        ids = list(chunk.token_ids)
        self.token_ids.extend(ids)
        if chunk.finish_reason is None and len(self.token_ids) >= self.request.sampling.max_tokens:
            chunk.finish_reason = "length"  # a resumed worker may not know the budget spent
        if chunk.finish_reason is not None:
            self._finish()
        assert self._text is not None, "deltas() reads the text"
        text = self._text.push(ids)
        finish = chunk.finish_reason
        if self._text.stopped:
            finish = "stop"
        elif finish is not None:
            text += self._text.finish()
        self.finish_reason = finish
        delta = ChoiceDelta(self.index, text, ids, _logprobs(chunk), finish)
        if delta.logprobs:
            self.deltas_seen.append(delta)
        return delta

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


def _logprobs(chunk) -> list[TokenLogprob]:
    if chunk.logprobs is None:
        return []
    tops = chunk.top_logprobs or [[] for _ in chunk.logprobs]
    return [
        (t, lp, list(top))
        for t, lp, top in zip(chunk.token_ids, chunk.logprobs, tops, strict=False)
    ]


async def open_choices(job: Job, dispatcher: Dispatcher) -> list[Choice]:
    """Starts every choice; on any failure closes the ones started and re-raises."""
    requests = job.generate_requests()
    if len(requests) == 1:  # the common case, without a task per choice
        return [await dispatcher.open(0, requests[0], job)]
    results = await asyncio.gather(
        *(dispatcher.open(i, r, job) for i, r in enumerate(requests)), return_exceptions=True
    )
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for r in results:
            if isinstance(r, Choice):
                await r.close()
        raise errors[0]
    return list(results)


MERGE_BUFFER = 8  # deltas per choice that may wait for a slow consumer before its pump waits


async def merged(runs: list[Choice]) -> AsyncIterator[ChoiceDelta]:
    """Deltas of all choices as they come; one choice needs no queue. The queue is bounded:
    a consumer that stops (a client that reads nothing) stops the choices' pumps too, so the
    router holds a few deltas per choice instead of the whole output."""
    if len(runs) == 1:
        async for delta in runs[0].deltas():
            yield delta
        return
    queue: asyncio.Queue = asyncio.Queue(MERGE_BUFFER * len(runs))

    async def pump(run: Choice) -> None:
        try:
            async for delta in run.deltas():
                await queue.put(delta)
        except asyncio.CancelledError:
            raise  # the consumer is gone: nothing waits for the end mark
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer below
            await queue.put(exc)
        else:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(r)) for r in runs]
    try:
        for _ in range(len(runs)):
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def account(job: Job, runs: list[Choice], metrics: RouterMetrics) -> dict:
    """The usage object of a finished job, and its metrics."""
    prompt = sum(len(p) for p in job.prompts)
    completion = sum(len(r.token_ids) for r in runs)
    cached = sum(runs[p * job.n].cached_tokens for p in range(len(job.prompts)))
    predicted = sum(runs[p * job.n].predicted_tokens for p in range(len(job.prompts)))
    metrics.prompt_tokens.inc(prompt)
    metrics.generation_tokens.inc(completion)
    metrics.cached_actual.inc(cached)
    metrics.cached_predicted.inc(predicted)
    for p in range(len(job.prompts)):
        metrics.hit(runs[p * job.n])
    metrics.e2e.observe(time.perf_counter() - job.arrival)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
