"""`WorkerActor`: one engine as a Ray async actor.

The engine runs in one background thread, the only thread that touches it: every actor method
hands it a call through an inbox and awaits the result, and between calls the thread steps the
engine while it has work. `generate` is a Ray streaming generator: callers use
`handle.generate.options(num_returns="streaming").remote(request)` and iterate the refs; each
item is one `TokenChunk` holding everything the request produced since the previous item
(usually one engine step), so a slow reader gets fewer, larger chunks. A generator closed or
cancelled before its last chunk aborts its request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import ray

from worker.engine import Engine, EngineConfig
from worker.protocol import GenerateRequest, TokenChunk, WorkerStats

logger = logging.getLogger(__name__)
T = TypeVar("T")
_IDLE_WAIT_S = 0.5  # idle wake-up period (session TTLs are checked then)


@ray.remote
class WorkerActor:
    def __init__(self, config: EngineConfig, worker_id: str) -> None:
        self.worker_id = worker_id
        self.engine = Engine(config, worker_id)
        self.engine.warm_up()  # before the router sees it: its first client pays nothing extra
        self._stats = self.engine.stats()
        self._info = self._describe()
        self._inbox: deque[tuple[Callable[[], Any], Future]] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._failure: str | None = None
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # --- actor methods -----------------------------------------------------------------------

    async def ready(self) -> dict:
        """What the router needs to know about this worker. Answers at once, even mid-step, so
        it doubles as a liveness ping; raises once the engine has failed."""
        if self._failure is not None:
            raise RuntimeError(f"worker {self.worker_id} engine failed: {self._failure}")
        return self._info

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        """Stream the request's chunks. ValueError (before any chunk) for a bad request."""
        rid = request.request_id
        if rid in self._streams:
            raise ValueError(f"request {rid!r} is already running")
        queue: asyncio.Queue[TokenChunk] = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), queue)
        finished = False
        try:
            await self._call(lambda: self.engine.add_request(request))
            while not finished:
                chunks = [await queue.get()]
                while not queue.empty():
                    chunks.append(queue.get_nowait())
                chunk = merge_chunks(chunks)
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            self._streams.pop(rid, None)
            if not finished:  # the client went away (or add_request failed: a no-op abort)
                self._submit(lambda: self.engine.abort(rid))

    async def abort(self, request_id: str) -> None:
        await self._call(lambda: self.engine.abort(request_id))

    async def stats(self) -> WorkerStats:
        """The stats as of the end of the latest engine step (never waits for a step)."""
        return self._stats

    async def kv_events(self, epoch: int, after_seq: int) -> list[bytes]:
        """Encoded event batches with seq > after_seq of `epoch`; [snapshot] when the epoch
        differs or they are no longer buffered (the snapshot starts with AllCleared). Buffered
        batches are answered at once; only a snapshot waits for the engine thread."""
        batches = self.engine.events.since(epoch, after_seq)
        if batches is not None:
            return batches
        return await self._call(lambda: self.engine.events_since(epoch, after_seq))

    async def close_session(self, session_id: str) -> bool:
        return await self._call(lambda: self.engine.close_session(session_id))

    async def check_integrity(self) -> None:
        await self._call(self.engine.check_integrity)

    # --- the engine thread -------------------------------------------------------------------

    def _describe(self) -> dict:
        engine = self.engine
        return {
            "worker_id": self.worker_id,
            "model": engine.model.config.name,
            "device": str(engine.device),
            "page_size": engine.config.page_size,
            "block_size": engine.config.block_size,
            "max_context": engine.max_context,
            "max_running": engine.config.max_running,
            "prefill_budget": engine.config.prefill_budget,
            "kv_tokens": engine.memory.allocator.size,
            "vocab_size": engine.model.config.vocab_size,
            "eos_token_ids": list(engine.eos_token_ids),
            "epoch": engine.events.epoch,
        }

    def _submit(self, fn: Callable[[], T]) -> Future:
        future: Future = Future()
        if self._failure is not None:
            future.set_exception(RuntimeError(f"engine failed: {self._failure}"))
            return future
        self._inbox.append((fn, future))
        self._wake.set()
        return future

    async def _call(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self._submit(fn))

    def _loop(self) -> None:
        while True:
            self._wake.clear()
            while self._inbox:
                fn, future = self._inbox.popleft()
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed to the caller
                    future.set_exception(exc)
            self.engine.take_event_batch()  # calls (close_session...) may have changed the cache
            if self.engine.has_work():
                try:
                    self._deliver(self.engine.step(settle=False))
                    self.engine.settle_if_idle()  # after the chunks are on their way
                except Exception as exc:
                    self._fail(exc)
                    return
            else:
                if self.engine.expire_sessions():
                    self.engine.take_event_batch()
                self._wake.wait(_IDLE_WAIT_S)
            self._stats = self.engine.stats()

    def _deliver(self, chunks: list[TokenChunk]) -> None:
        for chunk in chunks:
            stream = self._streams.get(chunk.request_id)
            if stream is not None:
                loop, queue = stream
                loop.call_soon_threadsafe(queue.put_nowait, chunk)

    def _fail(self, exc: Exception) -> None:
        """The engine broke: end every stream with an error; later calls raise."""
        logger.exception("engine of %s failed", self.worker_id)
        self._failure = repr(exc)
        for rid in list(self._streams):
            self._deliver([TokenChunk(rid, [], finish_reason="abort", error=self._failure)])
        while self._inbox:
            _, future = self._inbox.popleft()
            future.set_exception(RuntimeError(self._failure))


def merge_chunks(chunks: list[TokenChunk]) -> TokenChunk:
    """One chunk with the tokens (and logprobs) of several consecutive chunks of a request."""
    if len(chunks) == 1:
        return chunks[0]
    last = chunks[-1]
    want = any(c.logprobs is not None for c in chunks)
    return TokenChunk(
        request_id=last.request_id,
        token_ids=[t for c in chunks for t in c.token_ids],
        finish_reason=last.finish_reason,
        prompt_tokens=last.prompt_tokens,
        cached_tokens=last.cached_tokens,
        logprobs=[x for c in chunks for x in (c.logprobs or [])] if want else None,
        top_logprobs=[x for c in chunks for x in (c.top_logprobs or [])] if want else None,
        error=next((c.error for c in chunks if c.error), None),
    )
