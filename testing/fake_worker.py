"""Cache-simulating OpenAI workers: real prefix caching, modelled time, no model.

Each fake worker answers `/v1/completions` and `/v1/chat/completions` (streaming or not) from a
`SimWorker` (a `RadixCache` with no memory behind it, continuous batching and the time model of
`cluster.sim.time_model`) running in real time: a prompt waits, prefills in chunks and decodes
exactly as long as the profile says, and `usage.prompt_tokens_details.cached_tokens` is the real
prefix hit of its cache. Output tokens are dummies. Routers can thus be compared live on one
machine: ours (`HttpBackend`) and `sglang-router`, in front of the same workers.

For `sglang-router` it also serves what that router calls on a worker: `/health`,
`/health_generate`, `/get_server_info`, `/get_model_info`, `/get_load`, `/flush_cache` (and
the unprefixed `/server_info`, `/model_info`), and `/v1/models` for ours. sglang-router 0.3.2
was seen calling `/get_server_info`, `/server_info` and `/model_info` when a worker registers,
then `/health` periodically. It also opens a gRPC call (HTTP/2 with prior knowledge) to each
worker, which aiohttp refuses with 400; that is logged once, in one line, not as a traceback
per attempt. Every response names the worker in header `X-Radixray-Worker` and in
`system_fingerprint`. Unknown paths get 404 and are counted in `/get_server_info`.

Prompts given as token ids are used as they are; text goes through `--tokenizer` (a built-in
model name or an HF directory, as the router uses) or, by default, one token per word.

    python -m testing.fake_worker --port 9001 --count 4     # ports 9001..9004
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from cluster.sim.time_model import TimeProfile, h100_llama3_8b
from cluster.sim.trace import SimRequest
from cluster.sim.worker import RequestState, SimWorker
from testing.fake_protocol import (
    HTTP2_PROBES,
    ResponseShape,
    error,
    load_tokenizer,
    parse_request,
)

WORKER_HEADER = "X-Radixray-Worker"


@dataclass
class FakeWorkerConfig:
    """time_scale multiplies every step (0: answer at once); kv_tokens None: the profile's."""

    worker_id: str = "fake-0"
    model: str = "fake"
    profile: TimeProfile | None = None
    kv_tokens: int | None = None
    time_scale: float = 1.0
    max_context: int = 1 << 20


class FakeEngine:
    """A `SimWorker` stepped in real time; each request's tokens go to its queue."""

    def __init__(self, config: FakeWorkerConfig) -> None:
        self.config = config
        profile = config.profile or h100_llama3_8b()
        kv = config.kv_tokens or profile.kv_tokens
        self.sim = SimWorker(0, profile, kv, 1, max_run_steps=1, cache_block_size=16)
        self.queues: dict[str, asyncio.Queue] = {}
        self.emitted: dict[str, int] = {}
        self.wake = asyncio.Event()
        self.t0 = time.monotonic()
        self.task: asyncio.Task | None = None

    def now(self) -> float:
        return time.monotonic() - self.t0

    def submit(self, request_id: str, tokens: list[int], max_tokens: int) -> asyncio.Queue:
        req = SimRequest(request_id, self.now(), len(tokens), max_tokens, tokens)
        self.queues[request_id] = queue = asyncio.Queue()
        self.emitted[request_id] = 0
        self.sim.enqueue(RequestState(req))
        self.wake.set()
        return queue

    async def run(self) -> None:
        while True:
            start = self.now()
            end = self.sim.begin_step(start)
            if end < 0:
                self.wake.clear()
                await self.wake.wait()
                continue
            await asyncio.sleep((end - start) * self.config.time_scale)
            first, finished = self.sim.end_step(self.now())
            for state in [*self.sim.running, *finished]:
                self._emit(state, state in finished)

    def _emit(self, state: RequestState, done: bool) -> None:
        rid = state.req.request_id
        new = state.generated - self.emitted[rid]
        self.emitted[rid] = state.generated
        queue = self.queues[rid]
        if new > 0 or done:
            queue.put_nowait((new, state.cached_tokens, done))
        if done:
            del self.queues[rid], self.emitted[rid]


class FakeWorker:
    """The HTTP face of one `FakeEngine`."""

    def __init__(self, config: FakeWorkerConfig, encode: Callable[[str], list[int]]) -> None:
        self.config = config
        self.encode = encode
        self.engine = FakeEngine(config)
        self.served = 0
        self.unknown_paths: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self._ids = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._count])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        for path in ("/health", "/health_generate", "/readiness", "/liveness"):
            app.router.add_get(path, self.health)
        for path in ("/get_server_info", "/server_info"):
            app.router.add_get(path, self.server_info)
        for path in ("/get_model_info", "/model_info"):
            app.router.add_get(path, self.model_info)
        app.router.add_get("/get_load", self.load)
        app.router.add_route("*", "/flush_cache", self.flush)
        app.router.add_delete("/v1/sessions/{sid}", self.close_session)
        app.router.add_route("*", "/{tail:.*}", self.unknown)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    @web.middleware
    async def _count(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """Counts every path asked for, to see what a router calls (`/get_server_info`)."""
        key = f"{request.method} {request.path}"
        self.calls[key] = self.calls.get(key, 0) + 1
        return await handler(request)

    async def _start(self, app: web.Application) -> None:
        self.engine.task = asyncio.create_task(self.engine.run())

    async def _stop(self, app: web.Application) -> None:
        if self.engine.task:
            self.engine.task.cancel()

    def _headers(self) -> dict:
        return {WORKER_HEADER: self.config.worker_id}

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "worker_id": self.config.worker_id})

    async def close_session(self, request: web.Request) -> web.Response:
        return web.json_response({"deleted": False})  # fake workers keep no sessions

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.complete(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.complete(request, chat=True)

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.config.model, "object": "model", "owned_by": "radixray",
                "max_model_len": self.config.max_context}
        return web.json_response({"object": "list", "data": [card]}, headers=self._headers())

    async def server_info(self, request: web.Request) -> web.Response:
        sim = self.engine.sim
        return web.json_response({
            "model_path": self.config.model, "worker_id": self.config.worker_id,
            "max_total_num_tokens": sim.capacity_blocks, "page_size": 1,
            "served": self.served, "unknown_paths": self.unknown_paths, "calls": self.calls,
        })

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.config.model,
                                  "tokenizer_path": self.config.model, "is_generation": True})

    async def load(self, request: web.Request) -> web.Response:
        sim = self.engine.sim
        running = len(sim.running) + len(sim.prefilling) + len(sim.waiting)
        return web.json_response({"load": running, "worker_id": self.config.worker_id})

    async def flush(self, request: web.Request) -> web.Response:
        sim = self.engine.sim
        if sim.running or sim.prefilling or sim.waiting:
            return error(400, "cannot flush while requests run")
        sim.cache.reset()
        return web.json_response({"flushed": True})

    async def unknown(self, request: web.Request) -> web.Response:
        key = f"{request.method} {request.path}"
        self.unknown_paths[key] = self.unknown_paths.get(key, 0) + 1
        return error(404, f"no route {key}", "not_found_error")

    async def complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
            tokens, max_tokens = parse_request(body, chat, self.encode)
        except (ValueError, UnicodeDecodeError) as exc:
            return error(400, str(exc))
        if len(tokens) + max_tokens > self.config.max_context:
            return error(400, "prompt + max_tokens exceed the context")
        self._ids += 1
        rid = f"{self.config.worker_id}-{self._ids}"
        queue = self.engine.submit(rid, tokens, max_tokens)
        shape = ResponseShape(rid, self.config.model, self.config.worker_id, chat, len(tokens))
        if not body.get("stream"):
            cached = await _drain(queue)
            self.served += 1
            return web.json_response(shape.full(max_tokens, cached), headers=self._headers())
        resp = web.StreamResponse(headers={**self._headers(), "Content-Type": "text/event-stream"})
        await resp.prepare(request)
        cached, sent = 0, 0
        while True:
            new, cached, done = await queue.get()
            for i in range(new):
                last = done and i == new - 1
                await resp.write(shape.sse(shape.chunk(sent, "length" if last else None)))
                sent += 1
            if done:
                break
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(shape.sse(shape.usage_chunk(sent, cached)))
        await resp.write(b"data: [DONE]\n\n")
        self.served += 1
        return resp


async def _drain(queue: asyncio.Queue) -> int:
    while True:
        _, cached, done = await queue.get()
        if done:
            return cached


async def serve(configs: list[FakeWorkerConfig], host: str, ports: list[int],
                encode: Callable[[str], list[int]]) -> list[web.AppRunner]:
    """Start one fake worker per config on `host:port`; returns the runners (cleanup() stops)."""
    server_log = logging.getLogger("aiohttp.server")
    if HTTP2_PROBES not in server_log.filters:
        server_log.addFilter(HTTP2_PROBES)
    runners = []
    for config, port in zip(configs, ports, strict=True):
        runner = web.AppRunner(FakeWorker(config, encode).app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        runners.append(runner)
    return runners


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m testing.fake_worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9001)
    parser.add_argument("--count", type=int, default=1, help="workers on consecutive ports")
    parser.add_argument("--model", default="fake")
    parser.add_argument("--kv-tokens", type=int, default=None)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--profile", default=None, help="time profile JSON")
    parser.add_argument("--tokenizer", default="words", help="words | built-in name | HF dir")
    args = parser.parse_args()
    profile = TimeProfile.load(args.profile) if args.profile else None
    configs = [FakeWorkerConfig(f"fake-{i}", args.model, profile, args.kv_tokens,
                                args.time_scale) for i in range(args.count)]
    ports = [args.port + i for i in range(args.count)]

    async def forever() -> None:
        await serve(configs, args.host, ports, load_tokenizer(args.tokenizer))
        print(f"fake workers on {args.host}:{ports[0]}..{ports[-1]}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(forever())


if __name__ == "__main__":
    main()
