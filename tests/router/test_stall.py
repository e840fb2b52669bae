"""The stall deadline against in-process workers: a worker that sends nothing and whose stats
stand still is taken for hung (the request moves, the worker is marked dead); one whose stats
move is only busy, and the request waits for it."""

from __future__ import annotations

import asyncio
import itertools
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_testkit import FakeWorker, LiveServer, tiny_dir  # noqa: E402

from router.app import create_app  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.tokenizer import Tokenizer  # noqa: E402

BODY = {"model": "tiny", "prompt": "wait for me", "max_tokens": 8, "ignore_eos": True}


class PausingWorker(FakeWorker):
    """Its next request (of the pair: `pause` is shared) sends nothing for `pause["s"]`; while
    `pause["busy"]`, its stats change on every poll meanwhile (other requests progressing)."""

    def __init__(self, worker_id: str, pause: dict) -> None:
        super().__init__(worker_id)
        self.pause = pause
        self.ticks = itertools.count()

    async def generate(self, request):
        seconds = self.pause.pop("s", 0.0)
        if seconds:
            self.pause["paused"] = self.worker_id
            await asyncio.sleep(seconds)
        async for chunk in super().generate(request):
            yield chunk

    async def stats(self):
        stats = await super().stats()
        if self.pause.get("busy"):
            stats.running_decode_tokens = next(self.ticks)
        return stats


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(tiny_dir())


def serve(tokenizer, pause: dict) -> LiveServer:
    workers = [PausingWorker("w0", pause), PausingWorker("w1", pause)]
    config = RouterConfig(
        model="tiny", event_poll_s=0.01, stats_poll_s=0.05, stall_timeout_s=0.5, revive_s=3600
    )
    app = create_app(config, workers, tokenizer=tokenizer)
    server = LiveServer(app)
    server.router = app.state.router
    return server


@pytest.mark.parametrize("stream", [False, True])
def test_hung_worker_request_moves_and_worker_is_marked_dead(tokenizer, stream, caplog):
    pause = {"s": 30.0}
    with serve(tokenizer, pause) as server:
        reply = httpx.post(server.url + "/v1/completions", json={**BODY, "stream": stream},
                           timeout=20)
        metrics = httpx.get(server.url + "/metrics").text
        in_flight = server.router.registry  # every attempt's count is back to 0
        assert all(w.in_flight == 0 for w in in_flight)
    hung = pause["paused"]
    assert reply.status_code == 200 and reply.headers["x-radixray-worker"] != hung
    # marked dead (the fake answers its probe at once, so it may be back already)
    assert f"worker {hung} marked dead" in caplog.text
    assert "radixray_stalls_total 1.0" in metrics


def test_busy_worker_whose_stats_move_is_waited_for(tokenizer):
    pause = {"s": 1.5, "busy": True}
    with serve(tokenizer, pause) as server:
        reply = httpx.post(server.url + "/v1/completions", json=BODY, timeout=20)
        states = {w.worker_id: w.state for w in server.router.registry}
        metrics = httpx.get(server.url + "/metrics").text
    assert reply.status_code == 200 and reply.headers["x-radixray-worker"] == pause["paused"]
    assert reply.json()["usage"]["completion_tokens"] == BODY["max_tokens"]
    assert set(states.values()) == {"ready"}
    assert "radixray_stalls_total 0.0" in metrics
