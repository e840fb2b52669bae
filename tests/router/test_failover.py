"""Failover through the live app: a worker dies before or after the first token.

FakeWorkers (app_testkit) stand in for workers; their fake model depends only on the context,
so the tokens a resumed request produces are exactly those an unbroken one would have.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_testkit import FakeWorker, LiveServer, next_token, tiny_dir  # noqa: E402

from router.api.app import create_app  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.tokenizer import Tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(tiny_dir())


def serve(tokenizer, count=2, fault_after=None, **config):
    workers = [FakeWorker(f"w{i}", delay_s=0.002) for i in range(count)]
    fault = {} if fault_after is None else {"after": fault_after}
    for w in workers:
        w.fault = fault
    config = {"revive_s": 3600.0, **config}
    cfg = RouterConfig(model="tiny", event_poll_s=0.01, stats_poll_s=0.05, **config)
    app = create_app(cfg, workers, tokenizer=tokenizer)
    server = LiveServer(app)
    server.workers, server.router = workers, app.state.router
    return server


def expected_text(tokenizer, prompt_ids, n):
    context, out = list(prompt_ids), []
    for i in range(n):
        tok = next_token(context, None, i)
        context.append(tok)
        out.append(tok)
    return tokenizer.decode(out)


def dead_and_alive(server):
    dead = [w for w in server.workers if w.dead]
    alive = [w for w in server.workers if not w.dead]
    return dead, alive


def test_worker_dies_before_first_token_request_retried_elsewhere(tokenizer):
    with serve(tokenizer, fault_after=0) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt="before the first token", max_tokens=10
        )
        resp = raw.parse()
        dead, alive = dead_and_alive(server)
        assert len(dead) == 1 and raw.headers["x-radixray-worker"] == alive[0].worker_id
        ids = tokenizer.encode("before the first token")
        assert resp.choices[0].text == expected_text(tokenizer, ids, 10)
        assert resp.usage.completion_tokens == 10
        router = server.router
        assert dead[0].worker_id not in {v.worker_id for v in router.core.workers()}
        rows = {r["id"]: r for r in httpx.get(server.url + "/v1/workers").json()["data"]}
        assert rows[dead[0].worker_id]["state"] == "dead"
        assert "radixray_failovers_total 1.0" in httpx.get(server.url + "/metrics").text


def test_worker_dies_mid_stream_client_stream_goes_on(tokenizer):
    with serve(tokenizer, fault_after=5) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "keep streaming"}],
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        dead, alive = dead_and_alive(server)
        assert len(dead) == 1
        resumed = alive[0].requests[-1]
        assert len(resumed.resume_ids) == 5  # continued from the 5 tokens already streamed
        prompt = resumed.input_ids
        assert text == expected_text(tokenizer, prompt, 24)
        assert chunks[-1].usage.completion_tokens == 24
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "length"


def test_every_worker_dead_gives_openai_error_not_a_hang(tokenizer):
    with serve(tokenizer, count=2) as server:
        for w in server.workers:
            w.dead = True
        r = httpx.post(
            server.url + "/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 3},
            timeout=30,
        )
        assert r.status_code == 503
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert not any(w.active for w in server.workers)


def test_retries_are_bounded(tokenizer):
    with serve(tokenizer, count=4, max_failovers=1) as server:
        for w in server.workers:
            w.die_after = 0
        r = httpx.post(
            server.url + "/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 3},
            timeout=30,
        )
        assert r.status_code == 503
        assert sum(w.dead for w in server.workers) == 2  # first try + one failover


def test_dead_worker_is_readded_when_it_answers_again(tokenizer):
    with serve(tokenizer, fault_after=0, revive_s=0.05) as server:
        httpx.post(
            server.url + "/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 2},
            timeout=30,
        )
        dead, _ = dead_and_alive(server)
        assert len(dead) == 1
        dead[0].dead = False
        deadline = time.monotonic() + 10
        while server.router.registry[dead[0].worker_id].state != "ready":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert server.router.registry[dead[0].worker_id].state == "ready"


def test_the_first_streamed_token_marks_its_booking_started(tokenizer):
    """The live path calls `first_token` when a stream's first chunk arrives: the booking's
    prefill leaves the worker's queue while it is still decoding."""
    with serve(tokenizer, count=1) as server:
        server.workers[0].delay_s = 0.3  # a slow decode: the request stays booked a while
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        stream = client.completions.create(
            model="tiny", prompt="mark me started", max_tokens=4, stream=True
        )
        next(iter(stream))
        ledger = server.router.core.ledger
        booked = ledger.bookings()
        assert len(booked) == 1 and booked[0].started and booked[0].prefilled
        assert ledger.load(booked[0].worker_id, time.monotonic()).prefill_tokens == 0
        for _ in stream:
            pass
        assert ledger.bookings() == []
