"""A router at its concurrency limit answers 429 with `Retry-After` and an OpenAI error body
instead of queueing, and gives every slot back (streamed, non-streamed, failed requests)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_testkit import FakeWorker, LiveServer, tiny_dir  # noqa: E402

from router.api.app import create_app  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.tokenizer import Tokenizer  # noqa: E402

LIMIT = 3
SLOW = {"model": "tiny", "prompt": "hold the slot", "max_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def live():
    workers = [FakeWorker("w0", delay_s=0.02), FakeWorker("w1", delay_s=0.02)]
    config = RouterConfig(
        model="tiny", event_poll_s=0.01, stats_poll_s=0.05, max_concurrent=LIMIT,
        retry_after_s=2,
    )
    app = create_app(config, workers, tokenizer=Tokenizer(tiny_dir()))
    with LiveServer(app) as server:
        server.admission = app.state.admission
        server.router = app.state.router
        yield server


async def _burst(url: str, count: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:

        async def one(i: int) -> httpx.Response:
            body = {**SLOW, "stream": i % 2 == 0}
            return await client.post("/v1/completions", json=body)

        return await asyncio.gather(*(one(i) for i in range(count)))


def _in_flight_settles(live) -> int:
    for _ in range(100):
        if live.admission.in_flight == 0:
            break
        time.sleep(0.02)
    return live.admission.in_flight


def test_past_the_limit_429_with_retry_after_and_nothing_leaks(live):
    responses = asyncio.run(_burst(live.url, 3 * LIMIT))
    ok = [r for r in responses if r.status_code == 200]
    busy = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(busy) == len(responses)
    assert LIMIT <= len(ok) < len(responses) and busy  # the limit held; the rest were refused
    for r in busy:
        assert r.headers["retry-after"] == "2"
        error = r.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "too_many_requests"
        assert str(LIMIT) in error["message"]
    for r in ok:  # the admitted ones were served in full
        if r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]")
        else:
            assert r.json()["usage"]["completion_tokens"] == SLOW["max_tokens"]
    assert _in_flight_settles(live) == 0
    assert all(w.in_flight == 0 for w in live.router.registry)
    metrics = httpx.get(live.url + "/metrics").text
    assert f"radixray_rejected_total {float(len(busy))}" in metrics
    assert "radixray_in_flight 0.0" in metrics
    # with the slots back, a request is served again
    again = httpx.post(live.url + "/v1/completions", json={**SLOW, "max_tokens": 2})
    assert again.status_code == 200


def test_failed_requests_give_their_slot_back(live):
    for _ in range(2 * LIMIT):  # each is refused by validation after it was admitted
        bad = httpx.post(live.url + "/v1/completions", json={**SLOW, "model": "nope"})
        assert bad.status_code == 404
    bad_chat = httpx.post(live.url + "/v1/chat/completions", json={"model": "tiny"})
    assert bad_chat.status_code == 400
    assert _in_flight_settles(live) == 0
    ok = httpx.post(live.url + "/v1/completions", json={**SLOW, "max_tokens": 2})
    assert ok.status_code == 200


def test_client_gone_mid_stream_gives_its_slot_back(live):
    async def run() -> None:
        async with httpx.AsyncClient(base_url=live.url, timeout=30) as client:
            for _ in range(LIMIT + 1):
                body = {**SLOW, "max_tokens": 400, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    async for _line in resp.aiter_lines():
                        break  # leave after the first line: the connection closes

    asyncio.run(run())
    assert _in_flight_settles(live) == 0
