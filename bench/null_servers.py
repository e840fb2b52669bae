"""The two servers bench/bench_router_http.py measures against: our router in front of a
`NullBackend` (answers every request at once), and a null OpenAI server (aiohttp, canned
answers: what any HTTP hop costs with the same client). Each runs in its own process."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from router.backends.base import Backend
from worker.protocol import GenerateRequest, TokenChunk, WorkerStats


class NullBackend(Backend):
    """Answers at once: one chunk of all tokens, or one chunk per token when streaming."""

    def __init__(self, worker_id: str, chunks: int) -> None:
        self.worker_id = worker_id
        self.chunks = chunks

    async def ready(self) -> dict[str, Any]:
        return {"model": "tiny", "block_size": 16, "page_size": 1, "max_context": 4096}

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        n = request.sampling.max_tokens
        per = max(n // self.chunks, 1)
        sent = 0
        while sent < n:
            ids = [70 + (sent + i) % 20 for i in range(min(per, n - sent))]
            sent += len(ids)
            yield TokenChunk(
                request.request_id,
                ids,
                "length" if sent >= n else None,
                prompt_tokens=len(request.input_ids),
            )

    async def abort(self, request_id: str) -> None:
        return None

    async def stats(self) -> WorkerStats:
        return WorkerStats(worker_id=self.worker_id, kv_total=1 << 20, kv_free=1 << 20)

    async def kv_events(self, epoch: int, after_seq: int) -> list[bytes]:
        return []

    async def close_session(self, session_id: str) -> bool:
        return False


def serve_router(port: int, chunks: int) -> None:
    import uvicorn

    from router.api.app import create_app
    from router.config import RouterConfig
    from worker.loader.builtin import builtin_model_path

    config = RouterConfig(model="tiny", tokenizer=str(builtin_model_path("tiny")))
    app = create_app(config, [NullBackend("null0", chunks)])
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        log_level="error",
        access_log=False,
        loop="uvloop",
        http="httptools",
    )


def serve_null(port: int) -> None:
    from aiohttp import web

    words = "abcdefghijklmnop"
    body = json.dumps(
        {
            "id": "cmpl-0",
            "object": "text_completion",
            "created": 0,
            "model": "tiny",
            "choices": [{"index": 0, "text": words, "logprobs": None, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 40, "completion_tokens": 16, "total_tokens": 56},
        }
    ).encode()
    chunks = [
        b"data: "
        + json.dumps(
            {
                "id": "cmpl-0",
                "object": "text_completion",
                "created": 0,
                "model": "tiny",
                "choices": [{"index": 0, "text": c, "logprobs": None, "finish_reason": None}],
            }
        ).encode()
        + b"\n\n"
        for c in words
    ]

    async def completions(request: web.Request) -> web.StreamResponse:
        data = await request.json()
        if not data.get("stream"):
            return web.Response(body=body, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in chunks:
            await resp.write(chunk)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)
