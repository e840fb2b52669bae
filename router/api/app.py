"""The router's HTTP face (`create_app`): the OpenAI API plus workers, sessions, health and
metrics.

`backends` are the workers known at start (e.g. `RayBackend(worker_id, actor_handle)`); they
join when the app starts (lifespan, or the first request when the host runs no lifespan, as in
some Ray Serve set-ups: `_Guard` starts the router then). Workers can come and go later through
`app.state.router.workers` (`WorkerSync`: `attach(backend)`, `detach(worker_id)`,
`mark_dead(worker_id)`, called on the app's event loop; their records, with state and in-flight
counts, are `app.state.router.registry`'s) or the admin endpoints (`app.state.admin`:
`router.api.admin.WorkerAdmin`; request bodies become jobs in `app.state.jobs`). `control` (see
`router.api.admin.WorkerControl`: `add_worker()`, `remove_worker(worker_id)`) lets the admin
endpoints start and stop workers; without it, adding answers 501. `tokenizer` defaults to the
HF tokenizer of `config.tokenizer or config.model`.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics, GET /v1/workers, DELETE /v1/sessions/{id}; admin: POST /v1/workers
(body {"count": n}, or {"url", "events", "replay"}: an external engine),
POST /v1/workers/{id}/drain, DELETE /v1/workers/{id} (also under /v1/admin/workers/...).
Every response carries `X-Radixray-Worker` (the serving worker, or "none"). Who may call what
(`config.api_key`, `config.admin_key`, loopback clients) is `router.api.access`'s rule.

Deadlines and bounds on what a client controls: request headers (`config.max_header_bytes`,
431; `X-Session-ID` at most 256 characters, 400), the body (`config.max_body_bytes`, 413; in
full within `config.body_timeout_s` of the headers, else 408), and the response (a send the
client does not take within `config.send_timeout_s` drops the connection and aborts the
request on its worker). Completions and chat requests are admitted once their body is read,
parsed and tokenized: past `config.max_concurrent` in flight they get 429 with `Retry-After`
(`router.api.admission`); on shutdown the app waits up to `config.drain_timeout_s` for those
in flight to end before it stops the workers' link.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from router.api import access
from router.api.admin import WorkerAdmin, WorkerControl
from router.api.admission import Admission
from router.api.openai_types import ChatRequest, CompletionRequest, parse_body
from router.api.render import SSE_DONE, Renderer, sse
from router.api.requests import JobBuilder
from router.backends.base import Backend
from router.config import RouterConfig
from router.dispatch import Choice, account, merged, open_choices
from router.errors import (
    APIError,
    bad_request,
    body_too_large,
    headers_too_large,
    request_timeout,
)
from router.job import Job
from router.router import Router
from router.routing.core import RoutingCore
from router.tokenizer import Tokenizer

WORKER_HEADER = "X-Radixray-Worker"
MAX_SESSION_ID = 256  # characters, as the body field `session_id`

log = logging.getLogger("radixray.router")


_ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/workers", "/health"}


def endpoint_label(path: str) -> str:
    """A bounded set of metric labels, whatever paths clients send."""
    if path in _ENDPOINTS:
        return path
    for prefix in ("/v1/sessions", "/v1/admin", "/v1/workers"):
        if path.startswith(prefix + "/"):
            return prefix + "/*"
    return "other"


def _json(obj: Any, status: int = 200, worker: str = "none") -> Response:
    body = json.dumps(obj, separators=(",", ":"))
    return Response(body, status, {WORKER_HEADER: worker}, "application/json")


def _error(exc: APIError, headers: dict[str, str] | None = None) -> Response:
    headers = {WORKER_HEADER: "none", **(headers or {})}
    return Response(exc.body_bytes(), exc.status, headers, "application/json")


class SlowReader(Exception):
    """The client took no byte of its response for `send_timeout_s`."""


class _Guard:
    """ASGI middleware: header bounds, credentials (`router.api.access`), body size from
    Content-Length, the send deadline, the router started (the one place besides the lifespan:
    a host that runs no lifespan, such as some Ray Serve set-ups, starts it with its first
    request), the worker header."""

    def __init__(self, app: Any, router: Router) -> None:
        self.app = app
        self.router = router

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        failure = self._check(scope)
        if failure is not None:
            self.router.metrics.requests.labels(
                endpoint_label(scope["path"]), str(failure.status)
            ).inc()
            return await _error(failure)(scope, receive, send)
        await self.router.start()  # cheap once started
        deadline = self.router.config.send_timeout_s or None

        async def send_with_header(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = message.setdefault("headers", [])
                if not any(k.lower() == b"x-radixray-worker" for k, _ in headers):
                    headers.append((b"x-radixray-worker", b"none"))
            try:
                async with asyncio.timeout(deadline):
                    await send(message)  # uvicorn waits here while the client reads nothing
            except TimeoutError:
                raise SlowReader from None

        try:
            await self.app(scope, receive, send_with_header)
        except SlowReader:  # the stream was closed (its request aborted) on the way out
            self.router.metrics.slow_readers.inc()
            log.warning("dropped a client that read nothing of its response for %g s (%s %s)",
                        deadline, scope["method"], scope["path"])

    def _check(self, scope: dict) -> APIError | None:
        config = self.router.config
        raw = scope["headers"]
        if sum(len(k) + len(v) + 4 for k, v in raw) > config.max_header_bytes:
            return headers_too_large(config.max_header_bytes)
        headers = dict(raw)
        session = headers.get(b"x-session-id")
        if session is not None and len(session) > MAX_SESSION_ID:
            return bad_request(f"X-Session-ID must be at most {MAX_SESSION_ID} characters",
                               param="X-Session-ID")
        denied = access.check(config, scope, headers)
        if denied is not None:
            return denied
        length = headers.get(b"content-length")
        limit = config.max_body_bytes
        if length is not None and (not length.isdigit() or int(length) > limit):
            return body_too_large(limit) if length.isdigit() else bad_request("bad Content-Length")
        return None


async def _read_body(request: Request, config: RouterConfig) -> bytes:
    """The whole body, at most `max_body_bytes` (413), in full within `body_timeout_s` (408);
    a client that leaves meanwhile raises starlette's `ClientDisconnect`."""
    chunks, size, limit = [], 0, config.max_body_bytes
    try:
        async with asyncio.timeout(config.body_timeout_s or None):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise body_too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise request_timeout(config.body_timeout_s) from None
    return b"".join(chunks)


async def _job(
    request: Request, cls: type, make: Callable[[Any, str | None], Job], router: Router
) -> tuple[Any, Job]:
    """The parsed body and its job, built on the router's tokenize threads (`off_loop`), so
    the loop goes on streaming meanwhile."""
    raw = await _read_body(request, router.config)
    session_id = request.headers.get("x-session-id")

    def build() -> tuple[Any, Job]:
        body = parse_body(cls, raw)
        return body, make(body, session_id)

    return await router.off_loop(build)


def create_app(
    config: RouterConfig,
    backends: Sequence[Backend] = (),
    *,
    control: WorkerControl | None = None,
    tokenizer: Tokenizer | None = None,
    core: RoutingCore | None = None,
) -> FastAPI:
    """The router app over `backends`; see the module docstring for the whole contract."""
    router = Router(config, backends, tokenizer, core)
    jobs = JobBuilder(config, router.tokenizer, router.registry)
    admin = WorkerAdmin(router.registry, router.workers, control)
    admission = Admission(config.max_concurrent, config.retry_after_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        yield
        # the server stopped taking requests; the ones in flight finish before the workers go
        await admission.drained(config.drain_timeout_s)
        await router.stop()

    app = FastAPI(title="radixray", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = router
    app.state.jobs = jobs
    app.state.admin = admin
    app.state.admission = admission
    _add_handlers(app, router)
    _add_openai_routes(app, router, jobs, admission)
    _add_admin_routes(app, router, admin)
    app.add_middleware(_Guard, router=router)
    return app


def _add_handlers(app: FastAPI, router: Router) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        router.metrics.requests.labels(endpoint_label(request.url.path), str(exc.status)).inc()
        # a body not read in full leaves the connection unusable for another request
        return _error(exc, {"Connection": "close"} if exc.status == 408 else None)

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, _: ClientDisconnect) -> Response:
        endpoint = endpoint_label(request.url.path)
        router.metrics.requests.labels(endpoint, "499").inc()
        client = request.client.host if request.client else "?"
        log.info("client %s left before its request body to %s arrived", client, endpoint)
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return _error(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def server_error(_: Request, exc: Exception) -> Response:
        return _error(APIError(500, f"internal error: {type(exc).__name__}"))


def _add_openai_routes(
    app: FastAPI, router: Router, jobs: JobBuilder, admission: Admission
) -> None:
    async def completions(body: CompletionRequest, job: Job) -> Response:
        renderer = Renderer(job, router.tokenizer, False, body.logprobs, body.return_token_ids)
        return await _serve(
            router, job, renderer, body.stream, body.include_usage(), "/v1/completions"
        )

    async def chat(body: ChatRequest, job: Job) -> Response:
        top = (body.top_logprobs or 0) if body.logprobs else None
        renderer = Renderer(job, router.tokenizer, True, top, body.return_token_ids)
        return await _serve(
            router, job, renderer, body.stream, body.include_usage(), "/v1/chat/completions"
        )

    # Plain Starlette routes: the hot path skips FastAPI's per-request dependency solving.
    # (the job builders are looked up per request: `app.state.jobs` may be wrapped later)
    routes = (
        ("/v1/completions", CompletionRequest, lambda b, s: jobs.completion_job(b, s),
         completions),
        ("/v1/chat/completions", ChatRequest, lambda b, s: jobs.chat_job(b, s), chat),
    )
    for path, cls, make, handler in routes:
        admitted = _admitted(cls, make, handler, path, router, admission)
        app.add_route(path, admitted, methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Response:
        card = {
            "id": router.config.model,
            "object": "model",
            "created": 0,
            "owned_by": "radixray",
            "max_model_len": jobs.context_limit(),
        }
        return _json({"object": "list", "data": [card]})

    @app.get("/health")
    async def health() -> Response:
        ready = router.registry.routable()
        status = 200 if ready else 503
        return _json({"status": "ok" if ready else "no_workers", "workers": len(ready)}, status)

    @app.get("/metrics")
    async def metrics() -> Response:
        router.metrics.index_blocks.set(router.core.index_blocks())
        router.metrics.sessions.set(len(router.core.sessions))
        return Response(router.metrics.render(), media_type=router.metrics.content_type)

    @app.delete("/v1/sessions/{session_id}")
    async def close_session(session_id: str) -> Response:
        deleted = await router.close_session(session_id)
        return _json({"id": session_id, "object": "session", "deleted": deleted})


def _admitted(
    cls: type,
    make: Callable[[Any, str | None], Job],
    handler: Callable[[Any, Job], Any],
    endpoint: str,
    router: Router,
    admission: Admission,
) -> Callable[[Request], Any]:
    """`handler(body, job)` within the concurrency limit: 429 with `Retry-After` past it.
    The slot is taken once the body has arrived and its job is built (a client that is slow
    to send, or sends a bad body, holds none) and held until the response is sent in full (a
    stream's last byte), or the request fails."""

    async def admit(request: Request) -> Response:
        body, job = await _job(request, cls, make, router)
        if not admission.enter():
            router.metrics.rejected.inc()
            router.metrics.requests.labels(endpoint, "429").inc()
            return _error(admission.too_busy(), {"Retry-After": str(admission.retry_after_s)})
        router.metrics.in_flight.set(admission.in_flight)
        try:
            response = await handler(body, job)
        except BaseException:
            _leave(router, admission)
            raise
        if isinstance(response, StreamingResponse):
            response.body_iterator = _leaving(response.body_iterator, router, admission)
        else:
            _leave(router, admission)
        return response

    return admit


def _leave(router: Router, admission: Admission) -> None:
    admission.leave()
    router.metrics.in_flight.set(admission.in_flight)


async def _leaving(
    body: AsyncIterator[bytes], router: Router, admission: Admission
) -> AsyncIterator[bytes]:
    """A stream's body that gives its admission slot back when it ends, however it ends."""
    try:
        async for part in body:
            yield part
    finally:
        _leave(router, admission)
        if hasattr(body, "aclose"):
            await body.aclose()


class _ClosingStream(StreamingResponse):
    """A stream that closes its body iterator however sending ends (the client left, or stopped
    reading past the send deadline), so its request is aborted on the worker and its slot given
    back now rather than when the iterator is collected."""

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _serve(
    router: Router, job: Job, renderer: Renderer, stream: bool, include_usage: bool, endpoint: str
) -> Response:
    runs = await open_choices(job, router.dispatcher)
    worker = runs[0].first_worker
    router.metrics.requests.labels(endpoint, "200").inc()
    if stream:
        return _ClosingStream(
            _sse(router, job, renderer, runs, include_usage),
            media_type="text/event-stream",
            headers={WORKER_HEADER: worker},
        )
    texts = ["" for _ in runs]
    try:
        async for delta in merged(runs):
            texts[delta.index] += delta.text
    finally:
        for run in runs:
            await run.close()
    usage = account(job, runs, router.metrics)
    return _json(renderer.body(runs, texts, usage), worker=runs[0].worker_id)


async def _sse(
    router: Router, job: Job, renderer: Renderer, runs: list[Choice], include_usage: bool
) -> AsyncIterator[bytes]:
    try:
        if renderer.chat:
            for run in runs:
                yield renderer.first_chunk(run.index)
        async for delta in merged(runs):
            yield renderer.chunk(delta)
        usage = account(job, runs, router.metrics)
        if include_usage:
            yield renderer.usage_chunk(usage)
        yield SSE_DONE
    except APIError as exc:  # every worker failed mid-stream: say so in the stream
        yield sse(exc.body())
        yield SSE_DONE
    finally:
        for run in runs:
            await run.close()


def _add_admin_routes(app: FastAPI, router: Router, admin: WorkerAdmin) -> None:
    @app.get("/v1/workers")
    async def workers() -> Response:
        return _json({"object": "list", "data": admin.workers_json()})

    async def add(request: Request) -> Response:
        raw = await _read_body(request, router.config)
        count: Any = 1
        if raw.strip():
            try:
                data = json.loads(raw)
            except (ValueError, RecursionError):
                data = None
            if isinstance(data, dict) and "url" in data:  # an external engine, by address
                added = [await admin.add_url_worker(data)]
                return _json({"added": added, "data": admin.workers_json()})
            count = data.get("count", 1) if isinstance(data, dict) else None
            if not isinstance(count, int) or not 1 <= count <= 64:
                raise bad_request("count must be an integer in [1, 64]", param="count")
        added = await admin.add_workers(count)
        return _json({"added": added, "data": admin.workers_json()})

    async def drain(worker_id: str) -> Response:
        return _json(await admin.drain(worker_id))

    async def remove(worker_id: str) -> Response:
        return _json(await admin.remove(worker_id))

    for prefix in ("/v1/admin/workers", "/v1/workers"):
        app.add_api_route(prefix, add, methods=["POST"])
        app.add_api_route(prefix + "/{worker_id}/drain", drain, methods=["POST"])
        app.add_api_route(prefix + "/{worker_id}", remove, methods=["DELETE"])
