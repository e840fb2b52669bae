"""The router's OpenAI API through the official `openai` client, against a live app.

uvicorn serves `create_app` on 127.0.0.1 over two `FakeWorker`s (see app_testkit: each stands in
for a worker, with a deterministic fake model, a block cache and KV events).
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_testkit import FakeWorker, LiveServer, tiny_dir  # noqa: E402

from router.api.app import create_app  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.tokenizer import Tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(tiny_dir())


@pytest.fixture(scope="module")
def live(tokenizer):
    workers = [FakeWorker("w0"), FakeWorker("w1")]
    config = RouterConfig(model="tiny", event_poll_s=0.01, stats_poll_s=0.05)
    app = create_app(config, workers, tokenizer=tokenizer)
    with LiveServer(app) as server:
        server.workers = workers
        server.router = app.state.router
        yield server


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def test_chat_completion_text_usage_and_worker_header(client, live):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hello there"}], max_tokens=12
    )
    resp = raw.parse()
    assert raw.headers["x-radixray-worker"] in ("w0", "w1")
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 12
    assert len(choice.message.content) == 12  # the fake model emits one ASCII char per token
    assert resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12


def test_completion_streaming_matches_non_streaming(client):
    kwargs = dict(model="tiny", prompt="the same prompt each time", max_tokens=20)
    whole = client.completions.create(**kwargs)
    parts = list(client.completions.create(stream=True, **kwargs))
    streamed = "".join(c.choices[0].text for c in parts if c.choices)
    assert streamed == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason == "length"


def test_chat_stream_with_usage_reports_real_cache_hits(client, live):
    messages = [
        {"role": "system", "content": "You are terse. " * 8},
        {"role": "user", "content": "A long shared question " * 4},
    ]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    time.sleep(0.2)  # let the router pull the worker's KV events
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage.completion_tokens == 4
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 * (usage.prompt_tokens // 16) - 16  # routed to the worker that has it
    assert chunks[0].choices[0].delta.role == "assistant"


def test_n_choices_and_logprobs(client):
    resp = client.completions.create(model="tiny", prompt="abc", max_tokens=5, n=3, logprobs=2)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    for choice in resp.choices:
        assert len(choice.logprobs.tokens) == 5
        assert len(choice.logprobs.top_logprobs[0]) == 2
        assert "".join(choice.logprobs.tokens) == choice.text
    assert resp.usage.completion_tokens == 15
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and len(content[0].top_logprobs) == 2


def test_stop_string_cuts_text_and_aborts_worker(client, live, tokenizer):
    full = client.completions.create(model="tiny", prompt="stop test", max_tokens=30)
    text = full.choices[0].text
    stop = text[10:13]
    cut = client.completions.create(model="tiny", prompt="stop test", max_tokens=30, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    streamed = client.completions.create(
        model="tiny", prompt="stop test", max_tokens=30, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text


def test_extensions_pass_through_to_the_worker(client, live):
    client.completions.create(
        model="tiny",
        prompt="ext",
        max_tokens=6,
        extra_body={
            "ignore_eos": True,
            "min_tokens": 2,
            "top_k": 5,
            "min_p": 0.1,
            "repetition_penalty": 1.1,
            "stop_token_ids": [9],
            "session_id": "s-ext",
            "some_unknown_field": 1,
        },
    )
    request = next(
        r
        for w in live.workers
        for r in reversed(w.requests)
        if r.input_ids[-3:] == Tokenizer(tiny_dir()).encode("ext")[-3:]
    )
    s = request.sampling
    assert (s.ignore_eos, s.min_tokens, s.top_k, s.min_p, s.repetition_penalty) == (
        True,
        2,
        5,
        0.1,
        1.1,
    )
    assert s.stop_token_ids == [9] and request.session_id == "s-ext"


def test_session_header_pins_and_delete_closes(live):
    url = live.url
    body = {"model": "tiny", "prompt": "session turn", "max_tokens": 2}
    seen = set()
    for _ in range(4):
        r = httpx.post(url + "/v1/completions", json=body, headers={"X-Session-ID": "s1"})
        assert r.status_code == 200
        seen.add(r.headers["x-radixray-worker"])
    assert len(seen) == 1
    r = httpx.delete(url + "/v1/sessions/s1")
    assert r.status_code == 200 and r.json()["deleted"] is True


def test_models_health_workers_metrics(client, live):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = httpx.get(live.url + "/health")
    assert health.status_code == 200 and health.json()["workers"] == 2
    assert health.headers["x-radixray-worker"] == "none"
    rows = httpx.get(live.url + "/v1/workers").json()["data"]
    assert {r["id"] for r in rows} == {"w0", "w1"}
    for key in (
        "kv_total",
        "kv_free",
        "kv_evictable",
        "kv_protected",
        "kv_session",
        "kv_host_total",
        "kv_host_free",
        "running",
        "waiting",
        "state",
    ):
        assert key in rows[0]
    assert rows[0]["kv_total"] == 4096
    text = httpx.get(live.url + "/metrics").text
    for name in (
        "radixray_requests_total",
        "radixray_ttft_seconds_bucket",
        "radixray_routed_total",
        "radixray_cached_tokens_actual_total",
        "radixray_index_blocks",
        "radixray_worker_kv_free",
        "radixray_failovers_total",
        "radixray_e2e_seconds_count",
        "radixray_prompt_tokens_total",
    ):
        assert name in text


def test_nothing_leaks_after_requests(live):
    time.sleep(0.1)
    assert all(not w.active for w in live.workers)
    assert all(live.router.registry[w].in_flight == 0 for w in ("w0", "w1"))
    assert live.router.core.ledger.load("w0", time.monotonic()).requests == 0


def test_api_key_required_when_configured(tokenizer):
    config = RouterConfig(model="tiny", api_key="sekrit")
    app = create_app(config, [FakeWorker("k0")], tokenizer=tokenizer)
    with LiveServer(app) as server:
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as err:
            bad.completions.create(model="tiny", prompt="x", max_tokens=1)
        assert err.value.body["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="sekrit", max_retries=0)
        assert good.completions.create(model="tiny", prompt="x", max_tokens=1).choices
        assert httpx.get(server.url + "/health").status_code == 200  # health needs no key


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/v1/workers"])
def test_a_host_without_lifespan_starts_the_router_with_its_first_request(tokenizer, path):
    """Some hosts (Ray Serve set-ups) run no ASGI lifespan: the workers join on the first
    request, whichever endpoint it is for."""

    async def main() -> tuple[int, list[str]]:
        app = create_app(RouterConfig(model="tiny"), [FakeWorker("w0")], tokenizer=tokenizer)
        transport = httpx.ASGITransport(app=app)  # no lifespan events
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                reply = await http.get(path)
            return reply.status_code, [w.worker_id for w in app.state.router.registry]
        finally:
            await app.state.router.stop()

    status, workers = asyncio.run(main())
    assert status == 200 and workers == ["w0"]
