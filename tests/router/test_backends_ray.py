"""RayBackend over a real `WorkerActor` (tiny model, CPU) on a local Ray, and the whole app on
top of it: tokens stream, KV events reach the index, a killed actor becomes BackendDead."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

ray = pytest.importorskip("ray")
sys.path.insert(0, str(Path(__file__).parent))
from app_testkit import LiveServer, tiny_dir  # noqa: E402

from mem_cache.events import decode_batch  # noqa: E402
from router.api.app import create_app  # noqa: E402
from router.backends.base import BackendDead, BackendRequestError  # noqa: E402
from router.backends.ray import RayBackend  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.tokenizer import Tokenizer  # noqa: E402
from worker.protocol import GenerateRequest, SamplingParams  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def actors():
    from worker.actor import WorkerActor
    from worker.engine import EngineConfig

    ray.init(num_cpus=2, include_dashboard=False, address="local")
    config = EngineConfig(model=tiny_dir(), kv_tokens=2048, max_running=8)
    handles = [WorkerActor.options(num_cpus=0).remote(config, f"ray{i}") for i in range(2)]
    ray.get([h.ready.remote() for h in handles], timeout=180)
    yield handles
    ray.shutdown()


def test_generate_events_stats(actors):
    backend = RayBackend("ray0", actors[0])
    prompt = list(range(10, 60))

    async def run():
        info = await backend.ready()
        request = GenerateRequest("rb1", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
        chunks = [c async for c in backend.generate(request)]
        again = GenerateRequest("rb2", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        chunks2 = [c async for c in backend.generate(again)]
        batches = await backend.kv_events(-1, -1)
        return info, chunks, chunks2, batches, await backend.stats()

    info, chunks, chunks2, batches, stats = asyncio.run(run())
    assert info["block_size"] == 16 and info["max_context"] > 0
    assert sum(len(c.token_ids) for c in chunks) == 6 and chunks[-1].finish_reason == "length"
    assert chunks2[-1].cached_tokens >= 48  # the second request reused the first's prefix
    snapshot = decode_batch(batches[0])
    assert snapshot.worker_id == "ray0" and type(snapshot.events[0]).__name__ == "AllCleared"
    assert stats.worker_id == "ray0" and stats.kv_total >= 2048


def test_rejected_request_is_a_request_error(actors):
    backend = RayBackend("ray0", actors[0])

    async def run():
        with pytest.raises(BackendRequestError):
            async for _ in backend.generate(GenerateRequest("bad", [10**9])):
                pass

    asyncio.run(run())


def test_app_over_ray_workers_reports_real_cache_hits(actors):
    tokenizer = Tokenizer(tiny_dir())
    backends = [RayBackend(f"ray{i}", h) for i, h in enumerate(actors)]
    config = RouterConfig(model="tiny", event_poll_s=0.02)
    app = create_app(config, backends, tokenizer=tokenizer)
    with LiveServer(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "tell me about prefix caches " * 4}]
        registry = app.state.router.registry

        def seq(worker_id: str) -> int:
            return (registry[worker_id].cursor or (-1, -1))[1]

        before = {w: seq(w) for w in ("ray0", "ray1")}
        raw_first = client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=4
        )
        first, served = raw_first.parse(), raw_first.headers["x-radixray-worker"]
        deadline = time.monotonic() + 20
        while seq(served) <= before[served]:  # the router pulls events
            assert time.monotonic() < deadline, "no KV events from the worker"
            time.sleep(0.02)
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=4
        )
        second = raw.parse()
        assert raw.headers["x-radixray-worker"] == served
        assert first.usage.completion_tokens == 4
        assert second.usage.prompt_tokens_details.cached_tokens >= 32
        assert app.state.router.core.index_blocks() > 0
        stream = client.completions.create(
            model="tiny", prompt="stream me", max_tokens=5, stream=True
        )
        assert sum(1 for c in stream if c.choices and c.choices[0].text is not None) >= 1


def test_killed_actor_is_backend_dead(actors):
    from worker.actor import WorkerActor
    from worker.engine import EngineConfig

    victim = WorkerActor.options(num_cpus=0).remote(
        EngineConfig(model=tiny_dir(), kv_tokens=512), "victim"
    )
    ray.get(victim.ready.remote(), timeout=180)
    ray.kill(victim)
    backend = RayBackend("victim", victim)

    async def run():
        for _ in range(300):  # the kill takes effect asynchronously
            try:
                await backend.stats()
            except BackendDead:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("stats of a killed actor kept answering")
        with pytest.raises(BackendDead):
            async for _ in backend.generate(GenerateRequest("v", [1, 2, 3])):
                pass

    asyncio.run(run())


def test_actor_killed_mid_stream_the_stream_goes_on(actors):
    """Runs last: it kills one of the module's actors. Greedy decoding on identical weights
    makes the resumed continuation equal to an unbroken run."""
    tokenizer = Tokenizer(tiny_dir())
    backends = [RayBackend(f"ray{i}", h) for i, h in enumerate(actors)]
    app = create_app(RouterConfig(model="tiny"), backends, tokenizer=tokenizer)
    kwargs = dict(
        model="tiny",
        prompt="a prompt to continue after a crash",
        max_tokens=120,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    with LiveServer(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        reference = client.completions.create(**kwargs)
        ids: list[int] = []
        with client.completions.with_streaming_response.create(stream=True, **kwargs) as resp:
            victim = resp.headers["x-radixray-worker"]
            for i, chunk in enumerate(resp.parse()):
                if chunk.choices:
                    ids += chunk.choices[0].model_extra.get("token_ids") or []
                if i == 2:
                    ray.kill(actors[int(victim[-1])])
        assert ids == reference.choices[0].model_extra["token_ids"]
        assert app.state.router.registry[victim].state == "dead"
        metrics = httpx.get(server.url + "/metrics").text
        assert "radixray_failovers_total 1.0" in metrics  # it died while streaming to us
