"""HttpBackend: a radixray router fronting another OpenAI-compatible server over HTTP.

The server behind is itself a radixray app over a FakeWorker (app_testkit; it stands in for a
worker), which speaks the vLLM-style `return_token_ids` extension the backend relies on.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_testkit import FakeWorker, LiveServer, free_port, openai_server, tiny_dir  # noqa: E402

from router.api.app import create_app  # noqa: E402
from router.backends.base import BackendDead  # noqa: E402
from router.backends.http import HttpBackend  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.tokenizer import Tokenizer  # noqa: E402
from worker.protocol import GenerateRequest, SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(tiny_dir())


@pytest.fixture(scope="module")
def upstream(tokenizer):
    with openai_server(FakeWorker("up0"), tokenizer) as server:
        yield server


@pytest.fixture(scope="module")
def front(tokenizer, upstream):
    dead = HttpBackend("gone", f"http://127.0.0.1:{free_port()}")
    live = HttpBackend("h0", upstream.url, encode=tokenizer.encode)
    app = create_app(RouterConfig(model="tiny"), [dead, live], tokenizer=tokenizer)
    with LiveServer(app) as server:
        server.router = app.state.router
        yield server


def test_generate_streams_token_ids_and_usage(upstream, tokenizer):
    backend = HttpBackend("h", upstream.url)
    ids = tokenizer.encode("a prompt long enough to fill at least one block of tokens")

    async def run():
        await backend.ready()
        request = GenerateRequest("r1", ids, SamplingParams(max_tokens=7, logprobs=1))
        chunks = [c async for c in backend.generate(request)]
        await backend.close()
        return chunks

    chunks = asyncio.run(run())
    assert sum(len(c.token_ids) for c in chunks) == 7
    assert chunks[-1].finish_reason == "length" and chunks[-1].prompt_tokens == len(ids)
    assert all(c.logprobs and len(c.logprobs) == len(c.token_ids) for c in chunks)


def test_each_chunk_is_passed_on_as_it_arrives(tokenizer):
    """The server sends a token every 0.3 s: each reaches the router's caller when it comes,
    not when the next one does (holding a chunk back added a decode step to every TTFT); only
    the finishing chunk waits, for the usage that follows it."""
    with openai_server(FakeWorker("slow", delay_s=0.3), tokenizer) as server:
        backend = HttpBackend("h", server.url)

        async def run():
            await backend.ready()
            request = GenerateRequest("r1", list(range(1, 40)), SamplingParams(max_tokens=4))
            loop, arrivals = asyncio.get_running_loop(), []
            sent = loop.time()
            async for chunk in backend.generate(request):
                arrivals.append((loop.time() - sent, chunk))
            await backend.close()
            return arrivals

        arrivals = asyncio.run(run())
    assert sum(len(c.token_ids) for _, c in arrivals) == 4
    times = [t for t, _ in arrivals]
    assert all(b - a >= 0.2 for a, b in zip(times, times[1:], strict=False))  # none held back
    assert arrivals[-1][1].finish_reason == "length" and arrivals[-1][1].prompt_tokens == 39


def test_unreachable_server_is_backend_dead():
    backend = HttpBackend("x", f"http://127.0.0.1:{free_port()}")

    async def run():
        try:
            with pytest.raises(BackendDead):
                await backend.ready()
            with pytest.raises(BackendDead):
                async for _ in backend.generate(GenerateRequest("r", [1, 2, 3])):
                    pass
        finally:
            await backend.close()

    asyncio.run(run())


def test_router_in_front_gives_the_same_tokens_as_the_server(front, upstream):
    assert front.router.registry["gone"].state == "dead"
    kwargs = dict(model="tiny", prompt="same answer through two routers " * 3, max_tokens=12)
    direct = openai.OpenAI(base_url=upstream.url + "/v1", api_key="x").completions.create(**kwargs)
    client = openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0)
    raw = client.completions.with_raw_response.create(**kwargs)
    assert raw.headers["x-radixray-worker"] == "h0"
    via = raw.parse()
    assert via.choices[0].text == direct.choices[0].text
    streamed = client.completions.create(stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == direct.choices[0].text
    # the upstream worker cached the prompt: its reuse reaches the front router's usage
    again = client.completions.create(**kwargs)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_engines_are_added_live_by_url(tokenizer, upstream):
    """`POST /v1/workers {"url"}` (the route command's control): the engine joins and is routed
    to; the same engine again is 409, one that does not answer is 400 and leaves nothing
    behind; a router without such a control answers 501."""
    import requests

    from cluster.route import ExternalWorkers

    app = create_app(RouterConfig(model="tiny"), [], control=ExternalWorkers(16),
                     tokenizer=tokenizer)
    with LiveServer(app) as server:
        post = lambda body: requests.post(server.url + "/v1/workers", json=body, timeout=30)  # noqa: E731
        added = post({"url": upstream.url})
        assert added.status_code == 200, added.text
        wid = added.json()["added"][0]
        assert [r["id"] for r in added.json()["data"]] == [wid]
        assert app.state.router.registry[wid].shape.block_size == 16
        reply = requests.post(server.url + "/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": "hello", "max_tokens": 3})
        assert reply.status_code == 200 and reply.headers["X-Radixray-Worker"] == wid
        again = post({"url": upstream.url})
        assert again.status_code == 409 and again.json()["error"]["code"] == "worker_exists"
        gone = post({"url": f"http://127.0.0.1:{free_port()}"})
        assert gone.status_code == 400 and gone.json()["error"]["code"] == "worker_unreachable"
        rows = requests.get(server.url + "/v1/workers", timeout=10).json()["data"]
        assert [r["id"] for r in rows] == [wid]
    plain = create_app(RouterConfig(model="tiny"), [], tokenizer=tokenizer)
    with LiveServer(plain) as server:
        assert requests.post(server.url + "/v1/workers", json={"url": upstream.url},
                             timeout=30).status_code == 501
