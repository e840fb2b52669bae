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
GET /metrics, GET /v1/workers, DELETE /v1/sessions/{id}; admin: POST /v1/admin/workers
(body {"count": n}, or {"url", "events", "replay"}: an external engine),
POST /v1/admin/workers/{id}/drain, DELETE /v1/admin/workers/{id} (also
under /v1/workers/...). Every response carries `X-Radixray-Worker` (the serving worker, or
"none"). With `config.api_key`, every /v1/* call needs `Authorization: Bearer <key>`.
Completions and chat requests past `config.max_concurrent` in flight get 429 with
`Retry-After` (`router.api.admission`); on shutdown the app waits up to `config.drain_timeout_s`
for those in flight to end before it stops the workers' link.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.api.admin import WorkerAdmin, WorkerControl
from router.api.admission import Admission
from router.api.openai_types import ChatRequest, CompletionRequest, parse_body
from router.api.render import SSE_DONE, Renderer, sse
from router.api.requests import JobBuilder
from router.backends.base import Backend
from router.config import RouterConfig
from router.dispatch import Choice, account, merged, open_choices
from router.errors import APIError, bad_request, body_too_large, invalid_api_key
from router.job import Job
from router.router import Router
from router.routing.core import RoutingCore
from router.tokenizer import Tokenizer

WORKER_HEADER = "X-Radixray-Worker"


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


class _Guard:
    """ASGI middleware: API key on /v1/*, body size from Content-Length, the router started
    (the one place besides the lifespan: a host that runs no lifespan, such as some Ray Serve
    set-ups, starts it with its first request), the worker header."""

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

        async def send_with_header(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = message.setdefault("headers", [])
                if not any(k.lower() == b"x-radixray-worker" for k, _ in headers):
                    headers.append((b"x-radixray-worker", b"none"))
            await send(message)

        await self.app(scope, receive, send_with_header)

    def _check(self, scope: dict) -> APIError | None:
        headers = dict(scope["headers"])
        key = self.router.config.api_key
        if key and scope["path"].startswith("/v1/"):
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return invalid_api_key()
        length = headers.get(b"content-length")
        limit = self.router.config.max_body_bytes
        if length is not None and (not length.isdigit() or int(length) > limit):
            return body_too_large(limit) if length.isdigit() else bad_request("bad Content-Length")
        return None


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def _job(
    request: Request, cls: type, make: Callable[[Any, str | None], Job], router: Router
) -> tuple[Any, Job]:
    """The parsed body and its job, built on the router's tokenize threads (`off_loop`), so
    the loop goes on streaming meanwhile."""
    raw = await _read_body(request, router.config.max_body_bytes)
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
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return _error(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def server_error(_: Request, exc: Exception) -> Response:
        return _error(APIError(500, f"internal error: {type(exc).__name__}"))


def _add_openai_routes(
    app: FastAPI, router: Router, jobs: JobBuilder, admission: Admission
) -> None:
    async def completions(request: Request) -> Response:
        body, job = await _job(request, CompletionRequest, jobs.completion_job, router)
        renderer = Renderer(job, router.tokenizer, False, body.logprobs, body.return_token_ids)
        return await _serve(
            router, job, renderer, body.stream, body.include_usage(), "/v1/completions"
        )

    async def chat(request: Request) -> Response:
        body, job = await _job(request, ChatRequest, jobs.chat_job, router)
        top = (body.top_logprobs or 0) if body.logprobs else None
        renderer = Renderer(job, router.tokenizer, True, top, body.return_token_ids)
        return await _serve(
            router, job, renderer, body.stream, body.include_usage(), "/v1/chat/completions"
        )

    # Plain Starlette routes: the hot path skips FastAPI's per-request dependency solving.
    for path, handler in (("/v1/completions", completions), ("/v1/chat/completions", chat)):
        app.add_route(path, _admitted(handler, path, router, admission), methods=["POST"])

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
    handler: Callable[[Request], Any], endpoint: str, router: Router, admission: Admission
) -> Callable[[Request], Any]:
    """`handler` within the concurrency limit: 429 with `Retry-After` past it. The slot is
    held until the response is sent in full (a stream's last byte), or the request fails."""

    async def admit(request: Request) -> Response:
        if not admission.enter():
            router.metrics.rejected.inc()
            router.metrics.requests.labels(endpoint, "429").inc()
            return _error(admission.too_busy(), {"Retry-After": str(admission.retry_after_s)})
        router.metrics.in_flight.set(admission.in_flight)
        try:
            response = await handler(request)
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


async def _serve(
    router: Router, job: Job, renderer: Renderer, stream: bool, include_usage: bool, endpoint: str
) -> Response:
    runs = await open_choices(job, router.dispatcher)
    worker = runs[0].first_worker
    router.metrics.requests.labels(endpoint, "200").inc()
    if stream:
        return StreamingResponse(
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
        raw = await _read_body(request, router.config.max_body_bytes)
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
