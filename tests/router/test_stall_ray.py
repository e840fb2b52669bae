"""A worker that hangs without dying (its process SIGSTOPped) on a real local Ray: the request
streaming from it moves to the other worker once `stall_timeout_s` passes with nothing sent,
the client sees one complete answer, and the hung worker is routed to no more."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")
sys.path.insert(0, str(Path(__file__).parent))
from app_testkit import LiveServer, tiny_dir  # noqa: E402

from router.api.app import create_app  # noqa: E402
from router.backends.ray import RayBackend  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.routing.registry import DEAD  # noqa: E402
from router.tokenizer import Tokenizer  # noqa: E402

pytestmark = pytest.mark.ray

STALL_S = 2.0
BODY = {
    "model": "tiny",
    "prompt": "a stalled worker must not hold this request forever",
    "max_tokens": 600,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def actors():
    from worker.actor import WorkerActor
    from worker.engine import EngineConfig

    ray.init(num_cpus=2, include_dashboard=False, address="local")
    config = EngineConfig(model=tiny_dir(), kv_tokens=4096, max_running=8)
    handles = [WorkerActor.options(num_cpus=0).remote(config, f"st{i}") for i in range(2)]
    ray.get([h.ready.remote() for h in handles], timeout=180)
    pids = ray.get([h.__ray_call__.remote(lambda self: os.getpid()) for h in handles])
    yield dict(zip(("st0", "st1"), zip(handles, pids, strict=True), strict=True))
    ray.shutdown()


def _stream(client: httpx.Client, on_first) -> tuple[str, str, str | None]:
    """Streams BODY; calls on_first(worker) after the first token. (text, worker, finish)."""
    text, finish = "", None
    with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as resp:
        assert resp.status_code == 200
        worker = resp.headers["x-radixray-worker"]
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            assert "error" not in data, data
            choice = data["choices"][0]
            if not text and choice["text"]:
                on_first(worker)
            text += choice["text"]
            finish = choice["finish_reason"] or finish
    return text, worker, finish


def test_sigstopped_worker_request_completes_elsewhere(actors):
    tokenizer = Tokenizer(tiny_dir())
    backends = [RayBackend(wid, handle) for wid, (handle, _) in actors.items()]
    config = RouterConfig(
        model="tiny", event_poll_s=0.02, stall_timeout_s=STALL_S, revive_s=3600.0
    )
    app = create_app(config, backends, tokenizer=tokenizer)
    router = app.state.router
    stopped: list[int] = []
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(300):
            if client.get("/health").json().get("workers") == 2:
                break
            time.sleep(0.1)
        reference = client.post("/v1/completions", json=BODY).json()["choices"][0]["text"]

        def stop(worker: str) -> None:
            pid = actors[worker][1]
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)

        try:
            started = time.monotonic()
            text, worker, finish = _stream(client, stop)
            elapsed = time.monotonic() - started
            metrics = client.get("/metrics").text
            states = {w.worker_id: w.state for w in router.registry}
            other = next(w for w in actors if w != worker)
            # while it is stopped, new requests go to the other worker
            again = client.post("/v1/completions", json={**BODY, "max_tokens": 4})
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
    assert stopped, "the stream never produced a token"
    assert text == reference and finish == "length"  # one complete answer, no gap, no repeat
    assert elapsed < STALL_S + 30
    assert "radixray_stalls_total 1.0" in metrics
    assert states[worker] == DEAD and states[other] == "ready"
    assert again.status_code == 200 and again.headers["x-radixray-worker"] == other
    assert all(w.in_flight == 0 for w in router.registry)
