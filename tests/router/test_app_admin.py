"""Admin endpoints over a WorkerControl, drain, and a client that goes away mid-stream.

FakeWorkers (app_testkit) stand in for workers; `FakeControl` stands in for the launcher.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_testkit import FakeWorker, LiveServer, tiny_dir  # noqa: E402

from router.api.app import create_app  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.tokenizer import Tokenizer  # noqa: E402


class FakeControl:
    """Starts FakeWorkers (returns each one's Backend) and records removals."""

    def __init__(self) -> None:
        self.started = 0
        self.removed: list[str] = []

    async def add_worker(self):
        self.started += 1
        return FakeWorker(f"added{self.started}", delay_s=0.01)

    def remove_worker(self, worker_id: str) -> None:
        self.removed.append(worker_id)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(tiny_dir())


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_add_drain_remove_through_the_admin_api(tokenizer):
    control = FakeControl()
    config = RouterConfig(model="tiny", api_key="k", admin_key="a")
    app = create_app(config, [FakeWorker("w0")], control=control, tokenizer=tokenizer)
    with LiveServer(app) as server:
        http = httpx.Client(base_url=server.url, headers={"Authorization": "Bearer k"}, timeout=30)
        admin = httpx.Client(base_url=server.url, headers={"Authorization": "Bearer a"},
                             timeout=30)
        assert httpx.post(server.url + "/v1/admin/workers").status_code == 401
        assert http.post("/v1/workers", json={"count": 1}).status_code == 403  # inference key
        added = admin.post("/v1/admin/workers", json={"count": 2}).json()["added"]
        assert added == ["added1", "added2"]
        assert admin.post("/v1/workers", json={}).json()["added"] == ["added3"]
        ids = {r["id"] for r in admin.get("/v1/workers").json()["data"]}
        assert ids == {"w0", "added1", "added2", "added3"}

        # a drain waits for the worker's in-flight request, which completes normally
        slow = {"model": "tiny", "prompt": "drain me", "max_tokens": 40, "stream": True}
        with http.stream("POST", "/v1/completions", json=slow) as resp:
            victim = resp.headers["x-radixray-worker"]
            drain = server.call_soon(app.state.admin.drain(victim))
            workers = app.state.router.registry
            wait_for(lambda: victim not in workers or workers[victim].state == "draining")
            body = b"".join(resp.iter_bytes())
        assert body.endswith(b"data: [DONE]\n\n")
        assert drain.result(10) == {"id": victim, "state": "removed"}
        assert victim in control.removed
        assert victim not in {v.worker_id for v in app.state.router.core.workers()}

        left = [i for i in ids if i != victim]
        assert admin.delete(f"/v1/admin/workers/{left[0]}").json()["state"] == "removed"
        assert {r["id"] for r in admin.get("/v1/workers").json()["data"]} == set(left[1:])
        assert admin.post(f"/v1/workers/{left[1]}/drain").json()["state"] == "removed"
        assert control.removed[-2:] == [left[0], left[1]]


def test_client_disconnect_mid_stream_aborts_and_releases(tokenizer):
    worker = FakeWorker("w0", delay_s=0.02)
    app = create_app(RouterConfig(model="tiny"), [worker], tokenizer=tokenizer)
    with LiveServer(app) as server:
        body = {"model": "tiny", "prompt": "long one", "max_tokens": 500, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body) as resp:
            for i, _ in enumerate(resp.iter_lines()):
                if i >= 4:
                    break
        router = app.state.router
        wait_for(lambda: worker.aborted and not worker.active)
        wait_for(lambda: router.registry["w0"].in_flight == 0)
        assert router.core.ledger.load("w0", time.monotonic()).requests == 0
        assert worker.requests[-1].request_id in worker.aborted


def test_streaming_n_choices_all_finish(tokenizer):
    app = create_app(RouterConfig(model="tiny"), [FakeWorker("w0")], tokenizer=tokenizer)
    with LiveServer(app) as server:
        import openai

        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        chunks = list(
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "two answers"}],
                max_tokens=6,
                n=2,
                stream=True,
            )
        )
        texts = {0: "", 1: ""}
        finished = set()
        for c in chunks:
            for choice in c.choices:
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    finished.add(choice.index)
        assert finished == {0, 1} and all(len(t) == 6 for t in texts.values())
