"""Node loss: a 3-node Ray cluster on one machine (head + 2 worker nodes, 1 CPU each, so the
SPREAD placement puts one CPU worker on each node); a worker node is killed during streaming
load and every request still completes."""

from __future__ import annotations

import asyncio

import openai
import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util import placement_group_table

from cluster.config import ClusterConfig
from cluster.launcher import Launcher

pytestmark = pytest.mark.ray

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def three_nodes(helpers):
    ray_cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    nodes = [ray_cluster.add_node(num_cpus=1) for _ in range(2)]
    ray_cluster.wait_for_nodes()
    ray.init(address=ray_cluster.address)
    launcher = Launcher(ClusterConfig(
        model="tiny", port=helpers.free_port(), kv_tokens=4096, workers=3))
    try:
        launcher.start()
        yield ray_cluster, nodes, launcher
    finally:
        launcher.stop()
        ray.shutdown()
        ray_cluster.shutdown()


def node_of(worker) -> str:
    """The Ray node id hosting a worker's placement-group bundle."""
    table = placement_group_table(worker.slot.group)
    return table["bundles_to_node_id"][worker.slot.bundle_index]


async def stream_one(client: openai.AsyncOpenAI, i: int, started: asyncio.Event, log: dict):
    raw = await client.completions.with_raw_response.create(
        model="tiny", prompt=f"node loss request {i} " * 15, max_tokens=MAX_TOKENS,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    log[i] = raw.headers["x-radixray-worker"]
    finish, usage = None, None
    async for chunk in raw.parse():
        usage = chunk.usage or usage
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
        started.set()
    return finish, usage


async def load_and_kill_node(url: str, ray_cluster, nodes, launcher, n: int):
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    events = [asyncio.Event() for _ in range(n)]
    log: dict[int, str] = {}
    tasks = [asyncio.create_task(stream_one(client, i, events[i], log)) for i in range(n)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 180)
    by_node = {node_of(w): wid for wid, w in launcher.workers().items()}
    busy = [node for node in nodes if by_node.get(node.node_id) in log.values()]
    victim = (busy or nodes)[0]
    ray_cluster.remove_node(victim, allow_graceful=False)
    results = await asyncio.wait_for(asyncio.gather(*tasks), 300)
    await client.close()
    return results, by_node.get(victim.node_id)


def test_spread_puts_one_worker_per_node(three_nodes):
    _, _, launcher = three_nodes
    assert len({node_of(w) for w in launcher.workers().values()}) == 3


def test_node_killed_during_load_every_request_completes(three_nodes, helpers):
    ray_cluster, nodes, launcher = three_nodes
    results, lost = asyncio.run(load_and_kill_node(launcher.url, ray_cluster, nodes, launcher, 6))
    assert lost is not None
    for finish, usage in results:
        assert finish == "length"
        assert usage is not None and usage.completion_tokens == MAX_TOKENS
    # The lost worker is out of routing; the others still serve and balance at idle.
    helpers.wait_for(
        lambda: {r["id"]: r["state"] for r in helpers.workers_json(launcher.url)}.get(lost)
        != "ready", 60, f"{lost} to leave routing")
    client = openai.OpenAI(base_url=launcher.url + "/v1", api_key="unused", max_retries=0)
    raw = client.completions.with_raw_response.create(model="tiny", prompt="after", max_tokens=2)
    assert raw.headers["x-radixray-worker"] != lost
    helpers.assert_idle_accounting(launcher.url)
