"""The stall deadline against in-process workers: a worker that sends nothing and whose stats
stand still is taken for hung (the request moves, the worker is marked dead); one whose stats
move is only busy, and the request waits for it."""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_testkit import FakeWorker, LiveServer, tiny_dir  # noqa: E402

from router.api.app import create_app  # noqa: E402
from router.backends.base import BackendDead  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.dispatch import Choice  # noqa: E402
from router.metrics import RouterMetrics  # noqa: E402
from router.routing.registry import WorkerState  # noqa: E402
from router.tokenizer import Tokenizer  # noqa: E402
from worker.protocol import EngineShape, GenerateRequest, SamplingParams, TokenChunk  # noqa: E402

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


def test_slow_stream_whose_gaps_stay_under_the_deadline_is_not_a_stall(tokenizer):
    # 8 tokens 0.3 s apart: 2.1 s in all, 4 times the deadline, but no single wait reaches it
    workers = [FakeWorker("w0", delay_s=0.3)]
    config = RouterConfig(model="tiny", stats_poll_s=0.05, stall_timeout_s=0.5, revive_s=3600)
    app = create_app(config, workers, tokenizer=tokenizer)
    with LiveServer(app) as server:
        reply = httpx.post(server.url + "/v1/completions", json=BODY, timeout=20)
        metrics = httpx.get(server.url + "/metrics").text
    assert reply.status_code == 200
    assert reply.json()["usage"]["completion_tokens"] == BODY["max_tokens"]
    assert "radixray_stalls_total 0.0" in metrics and "radixray_failovers_total 0.0" in metrics


def waiting_dispatch(stall_timeout_s: float) -> Choice:
    """A Choice mid-attempt on a worker that never sends (no routing core involved)."""

    async def silent() -> AsyncIterator[TokenChunk]:
        await asyncio.Event().wait()
        yield TokenChunk("r", [1], None)

    owner = SimpleNamespace(metrics=RouterMetrics(), stall_timeout_s=stall_timeout_s, core=None,
                            registry=None)
    job = SimpleNamespace(sampling=SamplingParams(max_tokens=4))
    run = Choice(owner, 0, GenerateRequest("r", [1, 2, 3]), job)  # type: ignore[arg-type]
    run.worker_id, run._worker = "w0", WorkerState("w0", EngineShape())
    run._stream = silent().__aiter__()
    return run


def test_a_cancelled_wait_stays_a_cancel_and_is_no_stall():
    async def main():
        run = waiting_dispatch(0.2)
        waiting = asyncio.create_task(run._receive())
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.sleep(0.3)  # past the deadline: the watchdog has nothing to cancel
        await run.close()
        return run.dispatcher.metrics.stalls._value.get()

    assert asyncio.run(main()) == 0


def test_a_silent_wait_ends_at_the_deadline_and_the_task_is_not_left_cancelled():
    async def main():
        run = waiting_dispatch(0.2)
        t0 = time.monotonic()
        with pytest.raises(BackendDead):
            await run._receive()
        waited = time.monotonic() - t0
        cancelling = asyncio.current_task().cancelling()
        await asyncio.sleep(0)  # a task left cancelled would raise here
        await run.close()
        return waited, cancelling, run.dispatcher.metrics.stalls._value.get()

    waited, cancelling, stalls = asyncio.run(main())
    assert waited >= 0.2 and cancelling == 0 and stalls == 1
