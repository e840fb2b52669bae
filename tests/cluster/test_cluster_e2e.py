"""End to end through the launcher: a real local Ray, 2 CPU workers of `tiny`, the router over
uvicorn, and the official `openai` client."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import random
import uuid

import httpx
import openai
import pytest
import ray

from cluster.cli import main as cli_main
from cluster.config import ClusterConfig
from cluster.fleet import create_fleet, stop_fleet
from cluster.launcher import Launcher
from cluster.router_link import member_backends, router_config
from router.api.app import create_app
from worker.loader.builtin import resolve_model

pytestmark = pytest.mark.ray

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()


def long_text(seed: int, words: int = 120) -> str:
    """A deterministic text of `words` words (a few hundred tokens), distinct per seed."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def cluster(helpers):
    ray.init(num_cpus=4, include_dashboard=False)
    launcher = Launcher(ClusterConfig(
        model="tiny", port=helpers.free_port(), kv_tokens=8192, workers=2))
    try:
        launcher.start()
        yield launcher
    finally:
        launcher.stop()
        ray.shutdown()


@pytest.fixture()
def client(cluster, helpers):
    yield openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    helpers.assert_idle_accounting(cluster.url)


def chat(client, content: str, max_tokens: int = 8, **kw):
    """(parsed response, serving worker) of one greedy chat request."""
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens, temperature=0, **kw,
    )
    return raw.parse(), raw.headers["x-radixray-worker"]


def test_each_prefix_sticks_to_one_worker_and_both_workers_are_used(client):
    # First in the module: both workers are fresh, so their speeds are equal priors and a burst
    # of new prefixes spreads as the policy books load (later, the speeds each worker measured
    # on this busy 2-core machine would decide, legitimately, and not always evenly).
    n = 6
    prefixes = [long_text(10 + i) for i in range(n)]
    served: dict[int, set[str]] = {i: set() for i in range(n)}
    with cf.ThreadPoolExecutor(n) as pool:  # first a burst: one request per prefix at once
        firsts = pool.map(lambda i: chat(client, f"{prefixes[i]}\nQuestion 0: why?"), range(n))
        for i, (_, worker) in enumerate(firsts):
            served[i].add(worker)
    for turn in (1, 2):  # then each prefix again, with other questions
        for i, prefix in enumerate(prefixes):
            served[i].add(chat(client, f"{prefix}\nQuestion {turn}: why?")[1])
    assert all(len(workers) == 1 for workers in served.values()), served
    assert len(set().union(*served.values())) == 2, served


def test_chat_and_completions_stream_and_not(client, cluster):
    workers = set(cluster.workers())
    resp, worker = chat(client, "Hello there!", max_tokens=6, extra_body={"ignore_eos": True})
    assert worker in workers
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 6

    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Stream please"}], max_tokens=6,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    comp = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5,
                                     extra_body={"ignore_eos": True})
    assert comp.usage.completion_tokens == 5 and comp.choices[0].finish_reason == "length"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )
        if c.choices
    )
    again = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert streamed == again.choices[0].text


def test_repeated_long_prompt_reports_cached_tokens(client):
    prompt = long_text(1)
    first, w1 = chat(client, prompt)
    second, w2 = chat(client, prompt)
    assert first.usage.prompt_tokens > 100
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert w1 == w2


def test_greedy_output_equal_with_and_without_cache_hit(client):
    prompt = uuid.uuid4().hex + " " + long_text(2)  # unique from its first word on
    miss, _ = chat(client, prompt, max_tokens=16, extra_body={"ignore_eos": True})
    hit, _ = chat(client, prompt, max_tokens=16, extra_body={"ignore_eos": True})
    # A miss reuses at most the chat template's opening tokens, a hit nearly the whole prompt.
    assert miss.usage.prompt_tokens_details.cached_tokens < 16
    assert hit.usage.prompt_tokens_details.cached_tokens > hit.usage.prompt_tokens - 16
    assert hit.choices[0].message.content == miss.choices[0].message.content


def test_session_turns_stay_on_one_worker(client, cluster):
    session = "s-" + uuid.uuid4().hex
    messages = [{"role": "user", "content": long_text(20, 60)}]
    workers = set()
    for turn in range(3):
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0,
            extra_headers={"X-Session-ID": session},
        )
        workers.add(raw.headers["x-radixray-worker"])
        answer = raw.parse().choices[0].message.content
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": f"and turn {turn}?"}]
    assert len(workers) == 1
    closed = httpx.delete(f"{cluster.url}/v1/sessions/{session}", timeout=30).json()
    assert closed["deleted"] is True


def test_a_new_router_rebuilds_its_index_from_worker_snapshots(client, cluster):
    prompt = long_text(77)
    _, holder = chat(client, prompt)
    # A second router over the same workers, as after a router restart: it knows nothing until
    # it joins them and applies their snapshots; then it routes the prompt to its holder.
    config = router_config(cluster.config, str(resolve_model("tiny")))
    app = create_app(config, member_backends(list(cluster.workers().values())))
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 4, "temperature": 0}

    async def ask() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
            try:
                return await http.post("/v1/chat/completions", json=body, timeout=60)
            finally:
                await app.state.router.stop()

    response = asyncio.run(ask())
    assert response.headers["x-radixray-worker"] == holder
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_live_add_drain_and_remove(client, cluster, helpers, capsys):
    url = cluster.url
    assert cli_main(["workers", "add", "--url", url]) == 0
    added = [w for w in cluster.workers() if w not in ("worker-0", "worker-1")]
    assert len(added) == 1
    helpers.wait_for(lambda: any(r["id"] == added[0] and r["state"] == "ready"
                                 for r in helpers.workers_json(url)), 60, "the new worker")
    # The new worker takes load: a burst of distinct prompts spreads over all three.
    with cf.ThreadPoolExecutor(6) as pool:
        used = {w for _, w in pool.map(lambda i: chat(client, long_text(40 + i)), range(6))}
    assert used <= set(cluster.workers())

    assert cli_main(["workers", "drain", added[0], "--url", url]) == 0
    assert added[0] not in cluster.workers()
    assert added[0] not in {r["id"] for r in helpers.workers_json(url)}

    assert cli_main(["workers", "add", "--url", url, "--count", "1"]) == 0
    [again] = [w for w in cluster.workers() if w not in ("worker-0", "worker-1")]
    assert cli_main(["workers", "remove", again, "--url", url]) == 0
    assert sorted(cluster.workers()) == ["worker-0", "worker-1"]
    assert cli_main(["workers", "remove", "worker-9", "--url", url]) == 1
    assert "404" in capsys.readouterr().err
    # The same requests still work on the remaining two.
    _, worker = chat(client, "still serving?")
    assert worker in ("worker-0", "worker-1")

    # Removing a worker of the initial placement group frees its bundle for the next one added.
    groups = ray.get(cluster.fleet.groups.remote())
    assert cli_main(["workers", "remove", "worker-1", "--url", url]) == 0
    assert cli_main(["workers", "add", "--url", url]) == 0
    [newest] = [w for w in cluster.workers().values() if w.worker_id != "worker-0"]
    assert not newest.slot.owned and ray.get(cluster.fleet.groups.remote()) == groups
    _, worker = chat(client, "served by the replacement too?")
    assert worker in cluster.workers()


def test_a_worker_that_cannot_load_is_refused_and_leaves_nothing(cluster):
    config = ClusterConfig(model="/nonexistent/model", fleet_name="radixray-fleet-bad",
                           ready_timeout_s=120)
    fleet = create_fleet(config, "cpu", {"CPU": 0.01}, fixed=False)
    try:
        ray.get(fleet.start.remote(0))
        with pytest.raises(RuntimeError, match="worker-0 failed to load its model"):
            ray.get(fleet.add.remote(1))
        assert ray.get(fleet.members.remote())[1] == [] and ray.get(fleet.groups.remote()) == 0
    finally:
        stop_fleet(fleet, config)
