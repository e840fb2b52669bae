"""One OpenAI request, timed: TTFT, inter-token gaps, end-to-end, usage and serving worker."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import aiohttp

from cluster.loadgen.prompts import BenchRequest
from router.backends.sse import sse_json

WORKER_HEADER = "X-Radixray-Worker"


@dataclass(slots=True)
class Outcome:
    """What one request measured; `error` is set (and timings partial) when it failed."""

    request_id: str
    start_s: float = 0.0
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    worker: str | None = None
    error: str | None = None


@dataclass(slots=True)
class Target:
    """Where and how to send: base URL (without /v1), model, API key, streaming, endpoint."""

    url: str
    model: str
    api_key: str | None = None
    stream: bool = True
    chat: bool = False

    def endpoint(self) -> str:
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        return self.url.rstrip("/") + path

    def body(self, req: BenchRequest) -> dict:
        body: dict = {"model": self.model, "max_tokens": req.max_tokens, "temperature": 0.0,
                      "ignore_eos": True, "stream": self.stream}
        if self.chat:
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if req.session_id:
            body["session_id"] = req.session_id
        return body

    def headers(self, req: BenchRequest) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if req.session_id:
            headers["X-Session-ID"] = req.session_id
        return headers


def _usage(out: Outcome, usage: dict | None) -> None:
    if not usage:
        return
    out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    out.output_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    out.cached_tokens = int(details.get("cached_tokens") or 0)


def _content(choice: dict) -> bool:
    """Whether a streamed choice carries generated output."""
    delta = choice.get("delta") or {}
    return bool(choice.get("text") or delta.get("content") or choice.get("token_ids"))


async def send(http: aiohttp.ClientSession, target: Target, req: BenchRequest) -> Outcome:
    """Send `req`, read the whole answer, and time it."""
    out = Outcome(req.request_id, start_s=time.perf_counter())
    try:
        async with http.post(
            target.endpoint(), json=target.body(req), headers=target.headers(req)
        ) as resp:
            out.worker = resp.headers.get(WORKER_HEADER)
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return out
            if target.stream:
                await _read_stream(resp, out)
            else:
                _usage(out, (await resp.json()).get("usage"))
                out.ttft_s = time.perf_counter() - out.start_s
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.e2e_s = time.perf_counter() - out.start_s
    return out


async def _read_stream(resp: aiohttp.ClientResponse, out: Outcome) -> None:
    last = None
    async for body in sse_json(resp.content):
        if "error" in body:
            out.error = str(body["error"])[:200]
            return
        if any(_content(c) for c in body.get("choices") or []):
            now = time.perf_counter()
            if last is None:
                out.ttft_s = now - out.start_s
            else:
                out.itl_s.append(now - last)
            last = now
        _usage(out, body.get("usage"))
