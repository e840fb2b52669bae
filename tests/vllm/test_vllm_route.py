"""`radixray route` in front of two real vLLM servers publishing KV events.

Two vLLM engines start once for the module (each start costs a minute or two on a small
machine); the router runs in-process (built exactly as `radixray route` builds it) so the tests
can read its prefix index. Order matters: the last tests kill one engine and restart it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import openai
import pytest
import requests
import zmq

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "router"))
from app_testkit import LiveServer  # noqa: E402
from vllm_env import require_vllm  # noqa: E402
from vllm_server import BLOCK, VllmServer, free_port, vllm_model_dir  # noqa: E402

from cluster.cli import build_parser  # noqa: E402
from cluster.route import build_app  # noqa: E402
from mem_cache.events import DEVICE, block_hashes  # noqa: E402
from router.backends.external.events import EngineEventsConfig, EngineEventStream  # noqa: E402

pytestmark = pytest.mark.timeout(1200)

WORDS = list(range(70, 94))  # token ids of plain letters in the tiny tokenizer


def prompt(seed: int, length: int) -> list[int]:
    return [WORDS[(seed * 7 + i * (seed % 5 + 1)) % len(WORDS)] for i in range(length)]


class RawEvents:
    """An independent reader of one engine's raw events: the oracle of what it caches.

    It follows each stored block back through its parents to the sequence's start, so the
    router hashes it expects are `block_hashes` of whole sequences, computed apart from the
    router's incremental mapping.
    """

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.tokens: dict[object, list[int]] = {}  # engine hash -> tokens from the start
        self.held: dict[object, int] = {}
        self.removed = 0
        self.seq = -1
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.RCVTIMEO, 200)
        sock.connect(self.endpoint)
        while not self.stop.is_set():
            try:
                _, seq, body = sock.recv_multipart()
            except zmq.Again:
                continue
            with self.lock:
                seq = int.from_bytes(seq, "big")
                if seq <= self.seq:  # a restarted engine
                    self.tokens.clear()
                    self.held.clear()
                self.seq = seq
                for event in msgpack.unpackb(body)[1]:
                    self._apply(event)
        sock.close(0)

    def _apply(self, e: dict) -> None:
        if e["type"] == "BlockStored":
            prefix = [] if e["parent_block_hash"] is None else self.tokens[e["parent_block_hash"]]
            size = e["block_size"]
            for i, h in enumerate(e["block_hashes"]):
                prefix = prefix + e["token_ids"][i * size:(i + 1) * size]
                self.tokens[h] = prefix
                self.held[h] = self.held.get(h, 0) + 1
        elif e["type"] == "BlockRemoved":
            for h in e["block_hashes"]:
                self.removed += 1
                self.held[h] -= 1
                if not self.held[h]:
                    del self.held[h]
        else:
            self.held.clear()

    def expected(self) -> set[int]:
        """Router hashes (at the engine's block size) of every block the engine holds."""
        with self.lock:
            return {block_hashes(self.tokens[h], None, BLOCK)[-1] for h in self.held}

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    python = require_vllm()
    root = tmp_path_factory.mktemp("vllm")
    model = vllm_model_dir(root)
    servers = [VllmServer(python, model, root / f"vllm{i}.log") for i in range(2)]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait()
        yield servers
    finally:
        for server in servers:
            server.kill()


@pytest.fixture(scope="module")
def oracle(engines):
    readers = [RawEvents(e.events) for e in engines]
    time.sleep(0.5)  # subscriptions take a moment to reach the publishers
    yield readers
    for reader in readers:
        reader.close()


@pytest.fixture(scope="module")
def router(engines, oracle):
    args = build_parser().parse_args(
        ["route", "--model", str(engines[0].model), "--wait-s", "30",
         "--worker", engines[0].spec(), "--worker", engines[1].spec()])
    with LiveServer(build_app(args)) as server:
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="none",
                                      max_retries=0)
        server.oracle = oracle
        yield server


def complete(server, ids: list[int], max_tokens: int = 4, **extra):
    raw = server.client.completions.with_raw_response.create(
        model=str(server.app.state.router.config.model), prompt=ids, max_tokens=max_tokens,
        temperature=0, extra_body=extra or None)
    return raw.headers["x-radixray-worker"], raw.parse()


def index_of(server, worker_id: str) -> set[int]:
    async def read() -> set[int]:
        index = server.app.state.router.core.index
        return {h for h in index._workers[worker_id].tiers["device"]} if (
            worker_id in index.workers()) else set()

    return server.call(read())


def settle(check, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return check()
        except (AssertionError, requests.ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_engine_shape_is_read_not_assumed(router, engines):
    rows = requests.get(router.url + "/v1/workers", timeout=10).json()["data"]
    assert {r["id"] for r in rows} == {e.url.removeprefix("http://") for e in engines}
    assert {r["max_context"] for r in rows} == {1024}  # vLLM's max_model_len
    assert router.app.state.router.config.block_size == BLOCK  # from vLLM's /metrics
    settle(lambda: _assert({r["kv_total"] for r in requests.get(
        router.url + "/v1/workers", timeout=10).json()["data"]} == {12 * BLOCK}))


def test_engines_are_probed_at_join(router, engines):
    """Before any request was routed, each engine's prefill speed and decode step are its own,
    probed at join, and what the estimate prices with, not the prior."""
    rows = requests.get(router.url + "/v1/workers", timeout=10).json()["data"]
    assert len(rows) == 2
    for row in rows:
        assert row["prefill_tokens_per_s"] > 0 and row["decode_step_s"] > 0, rows
    for engine in engines:
        backend = router.app.state.router.registry[engine.url.removeprefix("http://")].backend
        assert backend.speed.probed[0] > 0 and backend.speed.probed[1] > 0, backend.speed.probed
    core = router.app.state.router.core
    fleet = core.estimator.fleet
    assert fleet.prefill_tokens_per_s != fleet.prior_prefill_tokens_per_s
    assert min(r["prefill_tokens_per_s"] for r in rows) <= fleet.prefill_tokens_per_s <= max(
        r["prefill_tokens_per_s"] for r in rows)


def test_a_vllm_worker_probes_its_own_engine(router, engines):
    """`radixray serve --engine vllm` probes each engine once, from its worker
    (`cluster.vllm_worker.probe_speeds`), where each router replica would probe it at join."""
    from cluster.vllm_worker import probe_speeds

    prefill, step = asyncio.run(probe_speeds("w", engines[1].url, None, 1024))
    assert prefill > 0 and step > 0, (prefill, step)
    assert asyncio.run(probe_speeds("w", engines[1].url, None, 0)) == (0.0, 0.0)


def _assert(ok: bool) -> None:
    assert ok


def test_index_equals_what_vllm_stores_and_follows_evictions(router, engines, oracle):
    """Many distinct 3-block prompts overflow the 12-block pools: vLLM evicts, and the router's
    index ends equal to what each engine's own events say it holds."""
    for seed in range(10):
        complete(router, prompt(seed, 3 * BLOCK + 10))
    settle(lambda: _assert(sum(o.removed for o in oracle) > 0))  # vLLM evicted
    for engine, reader in zip(engines, oracle, strict=True):
        wid = engine.url.removeprefix("http://")
        settle(lambda wid=wid, reader=reader: _assert(index_of(router, wid) == reader.expected()))
    counts = requests.get(router.url + "/metrics", timeout=10).text
    assert 'radixray_engine_events_total{outcome="applied"' in counts
    # each vLLM timed its own prefills, and the router reads them for the prefill speed
    for engine in engines:
        backend = router.app.state.router.registry[engine.url.removeprefix("http://")].backend
        settle(lambda b=backend: _assert(b.speed.engine_timed and b.engine.prefills is not None))
        requests_, tokens, seconds = backend.engine.prefills
        assert 0 < tokens <= requests_ * 1024 and seconds > 0  # 1024: the engines' context


def test_prefix_affinity_with_vllms_cached_tokens(router):
    shared = prompt(99, 2 * BLOCK)
    first, body = complete(router, shared + prompt(1, 40))
    assert body.usage.prompt_tokens_details.cached_tokens == 0
    time.sleep(0.5)  # the events of the first request reach the index
    for seed in range(2, 5):
        worker, body = complete(router, shared + prompt(seed, 40))
        assert worker == first
        assert body.usage.prompt_tokens_details.cached_tokens == 2 * BLOCK  # vLLM's own figure


def test_gap_is_filled_from_vllms_replay(router, engines):
    """A stream that joins after the engine published (its first seq > 0) fills the gap from
    the replay socket and ends with the same view as the router's stream, there from the start."""
    engine = engines[0]
    backend = router.app.state.router.registry[engine.url.removeprefix("http://")].backend

    async def late_join() -> dict:
        stream = EngineEventStream("late", EngineEventsConfig(engine.events, engine.replay), BLOCK)
        stream.start()
        await stream.subscribed.wait()
        await asyncio.sleep(0.5)
        seen = backend.events.engine_seq
        for seed in range(600, 610):  # straight to engine 0, until it publishes
            await asyncio.to_thread(
                requests.post, engine.url + "/v1/completions", timeout=120,
                json={"model": str(engine.model), "prompt": prompt(seed, BLOCK + 5),
                      "max_tokens": 4, "temperature": 0})
            await asyncio.sleep(0.3)
            if backend.events.engine_seq != seen:
                break
        for _ in range(100):
            if stream.engine_seq == backend.events.engine_seq:
                break
            await asyncio.sleep(0.1)
        out = {"outcomes": dict(stream.outcomes), "late": _held(stream),
               "router": _held(backend.events)}
        await stream.close()
        return out

    result = router.call(late_join(), timeout=120)
    assert result["outcomes"].get("gap_filled") == 1
    assert "resync" not in result["outcomes"]
    assert result["late"] == result["router"] and result["late"]


def _held(stream: EngineEventStream) -> set[int]:
    mirror = stream.mirror
    # every device tier: vLLM 0.32 names its one full-attention group (`group_idx` 0)
    return {h for (medium, _), held in mirror.held.items() if medium == DEVICE
            for e in held for h in mirror.chains[e].ours}


def test_stream_fails_over_from_a_killed_vllm(router, engines):
    stream = router.client.completions.create(
        model=str(router.app.state.router.config.model), prompt=prompt(7, BLOCK),
        max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True})
    texts, killed = [], None
    for chunk in stream:
        texts.append(chunk.choices[0].text if chunk.choices else "")
        if killed is None and len(texts) == 3:  # the engine serving it, as the router says
            serving = stream.response.headers["x-radixray-worker"]
            killed = next(e for e in engines if e.url.removeprefix("http://") == serving)
            killed.kill()
    assert killed is not None
    assert len(router.app.state.router.tokenizer.encode_plain("".join(texts))) > 300
    router.killed = killed


def test_killed_vllm_is_purged_then_rejoins_empty_after_restart(router, engines):
    killed = router.killed
    wid = killed.url.removeprefix("http://")
    rows = {r["id"]: r for r in requests.get(router.url + "/v1/workers", timeout=10).json()["data"]}
    assert rows[wid]["state"] == "dead"
    assert index_of(router, wid) == set()
    killed.start()
    killed.wait()
    settle(lambda: _assert({r["id"]: r["state"] for r in requests.get(
        router.url + "/v1/workers", timeout=10).json()["data"]}[wid] == "ready"), 60)
    assert index_of(router, wid) == set()  # a new engine: nothing of the old one is left
    backend = router.app.state.router.registry[wid].backend
    assert backend.events.outcomes["restart"] >= 1
    # and it is followed again: what it stores from now on reaches the index. Its twin drains
    # meanwhile, so that the prompt goes to it whatever the two engines' speeds measure (on
    # the tiny model they are noise, and the cheaper-looking engine would take every prompt)
    index = engines.index(killed)
    twin = next(e.url.removeprefix("http://") for e in engines if e is not killed)
    registry = router.app.state.router.registry

    async def draining(on: bool) -> None:
        registry.set_draining(twin, on)

    router.call(draining(True))
    try:
        worker, _ = complete(router, prompt(900, BLOCK + 3))
    finally:
        router.call(draining(False))
    assert worker == wid
    settle(lambda: _assert(index_of(router, wid) == router.oracle[index].expected() != set()))


def test_radixray_route_command_answers_through_openai(engines, tmp_path):
    """The real command line: `radixray route`, then chat through the `openai` client, a live
    `POST /v1/workers`, and the events metric."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1]))
    log = tmp_path / "route.log"
    cmd = [sys.executable, "-m", "cluster.cli", "route", "--model", str(engines[0].model),
           "--port", str(port), "--worker", engines[0].spec()]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        settle(lambda: _assert(requests.get(url + "/health", timeout=2).status_code == 200), 120)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(
            model=str(engines[0].model), max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "Hello there, who are you?"}])
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage.completion_tokens > 0
        client.completions.create(model=str(engines[0].model), prompt=prompt(3, BLOCK + 10),
                                  max_tokens=2)  # a whole block: the engine publishes it
        added = requests.post(url + "/v1/workers", timeout=30, json={
            "url": engines[1].url, "events": engines[1].events, "replay": engines[1].replay})
        assert added.status_code == 200, added.text
        assert len(added.json()["data"]) == 2
        bad = requests.post(url + "/v1/workers", timeout=30, json={"url": "ftp://x"})
        assert bad.status_code == 400
        wid = engines[0].url.removeprefix("http://")
        applied = f'radixray_engine_events_total{{outcome="applied",worker="{wid}"}}'
        settle(lambda: _assert(applied in requests.get(url + "/metrics", timeout=10).text))
    finally:
        proc.terminate()
        proc.wait(30)
