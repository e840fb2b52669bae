"""Workers outlive routers, on a real local Ray: the fleet actor owns the workers; a router (one
of the Ray Serve app's two replicas) killed with SIGKILL is restarted by Serve, joins the
running fleet and rebuilds its index from the workers' snapshots, so a warm prompt is still a
cache hit."""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest
import ray
from ray import serve
from ray._private.state import actors

from cluster.config import ClusterConfig
from cluster.fleet import find_fleet, stop_fleet
from cluster.serve_app import build_app

pytestmark = pytest.mark.ray

FLEET = "radixray-fleet-test"
PROMPT = "a warm prompt that every router must find again " * 12


def alive_pids(class_part: str) -> dict[str, int]:
    """Actor id -> pid of the live actors whose class name contains `class_part`."""
    return {aid: info["Pid"] for aid, info in actors().items()
            if class_part in info.get("ActorClassName", "") and info["State"] == "ALIVE"}


def worker_pids(fleet) -> dict[str, int]:
    _, members = ray.get(fleet.members.remote())
    return {m.worker_id: actors(m.actor._actor_id.hex())["Pid"] for m in members}


@pytest.fixture(scope="module")
def served(helpers):
    ray.init(num_cpus=4, include_dashboard=False)
    port = helpers.free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = ClusterConfig(fleet_name=FLEET)
    try:
        serve.run(build_app({"model": "tiny", "workers": 2, "kv_tokens": 4096, "port": 1,
                             "fleet_name": FLEET,
                             "router_replicas": 2}),
                  name="radixray", route_prefix="/")
        yield f"http://127.0.0.1:{port}", find_fleet(config)
    finally:
        serve.shutdown()
        fleet = find_fleet(config)
        if fleet is not None:
            stop_fleet(fleet, config)
        ray.shutdown()


def ask(url: str, prompt: str = PROMPT) -> tuple[str, int]:
    """(worker, cached prompt tokens) of one greedy chat turn."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=4,
        temperature=0,
    )
    usage = raw.parse().usage
    return raw.headers["x-radixray-worker"], usage.prompt_tokens_details.cached_tokens


def test_a_killed_serve_replica_rejoins_the_fleet_and_its_cache(served, helpers):
    url, fleet = served
    assert fleet is not None  # the replica created it by name; the replica does not own it
    holder, _ = ask(url)
    again, cached = ask(url)
    assert again == holder and cached > 0
    workers_before = worker_pids(fleet)
    replica_pids = sorted(alive_pids("RadixrayRouter").values())
    assert len(replica_pids) == 2
    replica_pid = replica_pids[0]

    os.kill(replica_pid, signal.SIGKILL)
    killed = time.monotonic()

    def new_replica() -> bool:
        pids = list(alive_pids("RadixrayRouter").values())
        return len(pids) == 2 and replica_pid not in pids

    helpers.wait_for(new_replica, 120, "Serve to restart the router replica")

    def answers() -> tuple[str, int] | None:
        try:
            return ask(url)
        except openai.APIError:
            return None

    worker, cached = helpers.wait_for(answers, 180, "the new replica to serve", every_s=1.0)
    print(f"a new router replica served {time.monotonic() - killed:.1f}s after the kill")
    assert worker_pids(fleet) == workers_before  # every worker process survived the router
    assert worker == holder and cached > 0  # the new router found the warm prefix's holder
    helpers.assert_idle_accounting(url)
