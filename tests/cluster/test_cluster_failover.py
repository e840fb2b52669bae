"""Failure handling on a real local Ray: a worker process killed under streaming load (the
router's own death is in test_cluster_fleet.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf

import openai
import pytest
import ray

from cluster.config import ClusterConfig
from cluster.launcher import Launcher

pytestmark = pytest.mark.ray

MAX_TOKENS = 48


@pytest.fixture(scope="module")
def cluster(helpers):
    ray.init(num_cpus=4, include_dashboard=False)
    config = ClusterConfig(model="tiny", port=helpers.free_port(), kv_tokens=8192, workers=2)
    launcher = Launcher(config)
    try:
        launcher.start()
        yield launcher
    finally:
        launcher.stop()
        ray.shutdown()


async def stream_one(client: openai.AsyncOpenAI, i: int, started: asyncio.Event, log: dict):
    """One streaming chat; records its first worker; returns (text, finish_reason, usage)."""
    raw = await client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": f"story number {i} " * 20}],
        max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    log[i] = raw.headers["x-radixray-worker"]
    text, finish, usage = "", None, None
    async for chunk in raw.parse():
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
        started.set()
    return text, finish, usage


async def run_and_kill(url: str, workers: dict, n: int) -> tuple[list, dict, str]:
    """Start `n` streams, kill the worker serving most of them mid-stream, finish them all."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    events = [asyncio.Event() for _ in range(n)]
    log: dict[int, str] = {}
    tasks = [asyncio.create_task(stream_one(client, i, events[i], log)) for i in range(n)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
    victim = max(set(log.values()), key=list(log.values()).count)
    ray.kill(workers[victim].actor, no_restart=False)  # Ray restarts it
    results = await asyncio.wait_for(asyncio.gather(*tasks), 300)
    await client.close()
    return results, log, victim


def test_worker_killed_under_streaming_load(cluster, helpers):
    results, log, victim = asyncio.run(run_and_kill(cluster.url, cluster.workers(), 6))
    assert victim in log.values()
    for _text, finish, usage in results:  # every stream completed in full, none failed
        assert finish == "length"
        assert usage is not None and usage.completion_tokens == MAX_TOKENS

    # Ray restarts the actor; the router re-adds it (empty) and routes to it again.
    def back() -> bool:
        rows = {r["id"]: r for r in helpers.workers_json(cluster.url)}
        return rows.get(victim, {}).get("state") == "ready"

    helpers.wait_for(back, 120, f"{victim} to come back")
    helpers.wait_for(lambda: cluster.workers()[victim].restarts >= 1, 30, "the watcher")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)

    def one(i: int) -> str:
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt=f"fresh prompt {i} " * 100, max_tokens=4)
        return raw.headers["x-radixray-worker"]

    # The restarted worker has no measured speed yet and an empty cache, so the cost policy
    # sends it work once the other worker's queue is long enough: bursts of distinct prompts.
    served: set[str] = set()
    with cf.ThreadPoolExecutor(8) as threads:
        for burst in range(5):
            served.update(threads.map(one, range(burst * 8, burst * 8 + 8)))
            if victim in served:
                break
    assert victim in served
    helpers.assert_idle_accounting(cluster.url)
