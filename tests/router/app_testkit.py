"""Test doubles for the router's API tests: a deterministic worker and a live uvicorn server.

`FakeWorker` stands in for a radixray worker (a `WorkerActor` behind `RayBackend`): it
implements the `Backend` interface, generates tokens as a pure function of the context (so a
request resumed on another FakeWorker continues exactly as it would have), reports real prefix
reuse from a block-hash cache of what it served, and publishes numbered KV event batches with a
snapshot for resync, like a worker does. It can be told to die after N tokens of a request.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

from mem_cache.events import AllCleared, BlockStored, block_hashes, encode_batch
from router.api.http_server import server_config
from router.backends.base import Backend, BackendDead
from worker.protocol import GenerateRequest, TokenChunk, WorkerStats

BLOCK = 16
EOS = 3  # <|im_end|> of the built-in tiny model
# Token ids of the tiny tokenizer that decode to plain ASCII letters and spaces.
SAFE_IDS = list(range(68, 94)) + [224, 224, 224]  # a..z and spaces


def tiny_dir() -> str:
    from worker.loader.builtin import builtin_model_path

    return str(builtin_model_path("tiny"))


def next_token(context: list[int], script: list[int] | None, produced: int) -> int:
    """The fake model: deterministic in the whole context (or a fixed script)."""
    if script is not None:
        return script[produced % len(script)]
    h = (sum(t * (31 + i) for i, t in enumerate(context[-4:])) + len(context)) % len(SAFE_IDS)
    return SAFE_IDS[h]


class FakeWorker(Backend):
    """A deterministic in-process worker; see the module docstring."""

    def __init__(
        self,
        worker_id: str,
        tokens_per_chunk: int = 1,
        delay_s: float = 0.0,
        script: list[int] | None = None,
        max_context: int = 2048,
    ) -> None:
        self.worker_id = worker_id
        self.tokens_per_chunk = tokens_per_chunk
        self.delay_s = delay_s
        self.script = script
        self.max_context = max_context
        self.dead = False
        self.die_after: int | None = None  # next request: die after this many tokens
        self.fault: dict | None = None
        self.parent: dict[int, int | None] = {}  # cached block hash -> the block before it
        self.epoch, self.seq = 1, 0
        self.batches: list[tuple[int, bytes]] = []
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.requests: list[GenerateRequest] = []
        self.sessions: set[str] = set()

    def _alive(self) -> None:
        if self.dead:
            raise BackendDead(f"{self.worker_id} is dead")

    async def ready(self) -> dict[str, Any]:
        self._alive()
        return {
            "model": "tiny",
            "block_size": BLOCK,
            "page_size": 1,
            "max_context": self.max_context,
        }

    def cached_tokens(self, ids: list[int], namespace: str | None) -> int:
        n = 0
        for h in block_hashes(ids, namespace, BLOCK):
            if h not in self.parent:
                break
            n += BLOCK
        return min(n, max(len(ids) - 1, 0))

    def _store(self, ids: list[int], namespace: str | None) -> None:
        hashes, new, parent = block_hashes(ids, namespace, BLOCK), [], None
        first_parent = None
        for h in hashes:
            if h not in self.parent:
                if not new:
                    first_parent = parent
                self.parent[h] = parent
                new.append(h)
            parent = h
        if new:
            self._publish([BlockStored(new, first_parent)])

    def _publish(self, events: list) -> None:
        self.seq += 1
        self.batches.append((self.seq, encode_batch(self.worker_id, self.epoch, self.seq, events)))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        self._alive()
        self.requests.append(request)
        rid, s = request.request_id, request.sampling
        die_after, self.die_after = self.die_after, None
        if self.fault is not None and "after" in self.fault:
            die_after = self.fault.pop("after")  # shared by several fakes: the first one dies
        context = request.input_ids + request.resume_ids
        cached = self.cached_tokens(context, request.namespace)
        produced, out = len(request.resume_ids), []
        self.active.add(rid)
        try:
            while True:
                ids, finish = [], None
                while len(ids) < self.tokens_per_chunk and finish is None:
                    if die_after is not None and len(out) + len(ids) >= die_after:
                        break
                    tok = next_token(context, self.script, produced)
                    context.append(tok)
                    produced += 1
                    ids.append(tok)
                    if (tok == EOS and not s.ignore_eos) or tok in s.stop_token_ids:
                        finish = "stop" if produced > s.min_tokens else None
                    if finish is None and produced >= s.max_tokens:
                        finish = "length"
                if die_after is not None and len(out) + len(ids) >= die_after and finish is None:
                    if ids:
                        out.extend(ids)
                        yield self._chunk(rid, ids, None, len(request.input_ids), cached, s)
                    self.dead = True
                    raise BackendDead(f"{self.worker_id} died")
                out.extend(ids)
                if finish is not None:
                    self._store(context, request.namespace)
                if request.session_id:
                    self.sessions.add(request.session_id)
                yield self._chunk(rid, ids, finish, len(request.input_ids), cached, s)
                if finish is not None:
                    return
                if rid in self.aborted:
                    return
                await asyncio.sleep(self.delay_s)
        finally:
            self.active.discard(rid)

    def _chunk(
        self, rid: str, ids: list[int], finish: str | None, prompt: int, cached: int, s: Any
    ) -> TokenChunk:
        chunk = TokenChunk(rid, ids, finish, prompt_tokens=prompt, cached_tokens=cached)
        if s.logprobs is not None:
            chunk.logprobs = [-0.25 for _ in ids]
            letters = range(68, 94)
            chunk.top_logprobs = [
                ([(t, -0.25)] + [(a, -3.0 - a) for a in letters if a != t])[: s.logprobs]
                for t in ids
            ]
        return chunk

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def stats(self) -> WorkerStats:
        self._alive()
        return WorkerStats(
            worker_id=self.worker_id,
            kv_total=4096,
            kv_free=4096 - len(self.parent) * BLOCK,
            kv_evictable=len(self.parent) * BLOCK,
            running=len(self.active),
            block_size=BLOCK,
            max_context=self.max_context,
            model="tiny",
            sessions=len(self.sessions),
        )

    async def kv_events(self, epoch: int, after_seq: int) -> list[bytes]:
        self._alive()
        if epoch != self.epoch or (self.batches and self.batches[0][0] > after_seq + 1):
            events: list = [AllCleared()]
            events += [BlockStored([h], p) for h, p in self.parent.items()]
            return [encode_batch(self.worker_id, self.epoch, self.seq, events)]
        return [b for seq, b in self.batches if seq > after_seq]

    async def close_session(self, session_id: str) -> bool:
        self._alive()
        if session_id in self.sessions:
            self.sessions.discard(session_id)
            return True
        return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def openai_server(worker: FakeWorker, tokenizer: Any) -> LiveServer:
    """A radixray app over one FakeWorker, to be served live (enter it): an OpenAI-compatible
    server with the vLLM-style `return_token_ids` that `HttpBackend` fronts."""
    from router.api.app import create_app
    from router.config import RouterConfig

    config = RouterConfig(model="tiny", event_poll_s=0.01)
    return LiveServer(create_app(config, [worker], tokenizer=tokenizer))


class LiveServer:
    """An ASGI app served by uvicorn on 127.0.0.1 in a background thread (a context manager)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        router = getattr(getattr(app, "state", None), "router", None)
        limit = router.config.max_header_bytes if router is not None else 64 * 1024
        config = server_config(  # uvicorn as `radixray serve` runs it
            app, limit, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())

    def __enter__(self) -> LiveServer:
        self.thread.start()
        for _ in range(600):
            if self.server.started:
                return self
            if not self.thread.is_alive():
                break
            threading.Event().wait(0.05)
        raise RuntimeError("uvicorn did not start")

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        """Runs a coroutine on the server's loop (the loop that owns the router)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call_soon(self, coro: Any) -> Any:
        """Starts a coroutine on the server's loop; returns its concurrent future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
