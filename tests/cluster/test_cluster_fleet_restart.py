"""The fleet outlives its own process, on a real `radixray serve`: the workers are detached,
named actors, so killing `ray::FleetActor` leaves them (and their caches) running; Ray restarts
the fleet, which adopts them; the router serves throughout; admin calls answer 503 while the
fleet cannot be reached (never 500); and SIGTERM to serve still leaves no Ray process."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from testing.serve_process import ServeProcess

pytestmark = pytest.mark.ray

PROMPT = "a warm prompt that must stay cached across the fleet's restart " * 10


def chat(client: httpx.Client, prompt: str = PROMPT) -> tuple[str, int, str]:
    """(worker, cached prompt tokens, text) of one greedy chat turn; fails on anything but 200."""
    resp = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
        "temperature": 0})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    return resp.headers["x-radixray-worker"], cached, body["choices"][0]["message"]["content"]


def test_killing_the_fleet_actor_keeps_workers_caches_and_service(helpers):
    port = helpers.free_port()
    serve = ServeProcess(["--model", "tiny", "--workers", "2", "--port", str(port),
                          "--kv-tokens", "4096", "--num-cpus", "2"])
    ray_processes: list = []
    try:
        serve.wait_ready(300)
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        holder, _, text = chat(client)
        assert chat(client)[:2][0] == holder
        [fleet] = serve.pids("fleet")
        workers = serve.pids("worker")
        assert len(workers) == 2

        # The fleet hung: serving goes on; admin answers 503 in the OpenAI format, not 500 and
        # not never; the worker it was asked to remove comes back once the fleet answers.
        os.kill(fleet, signal.SIGSTOP)
        try:
            assert chat(client)[2] == text
            t0 = time.monotonic()
            resp = client.delete("/v1/workers/worker-1")
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"]["code"] == "fleet_unavailable"
            assert time.monotonic() - t0 < 30
            resp = client.post("/v1/workers", json={"count": 1})
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "fleet_unavailable"
        finally:
            os.kill(fleet, signal.SIGCONT)
        helpers.wait_for(lambda: {r["id"] for r in helpers.workers_json(serve_url(port))}
                         == {"worker-0", "worker-1"}, 60, "worker-1 to be attached again")

        # The fleet killed: its workers live on with their caches, Ray restarts it, it adopts
        # them, and every request meanwhile is answered.
        os.kill(fleet, signal.SIGKILL)
        killed = time.monotonic()
        answered, back_s = 0, None
        while time.monotonic() - killed < 5:
            assert chat(client)[2] == text
            answered += 1
            if back_s is None and [p for p in serve.pids("fleet") if p != fleet]:
                back_s = time.monotonic() - killed
        assert serve.pids("worker") == workers  # the same processes, 5 s after the kill
        new = helpers.wait_for(lambda: [p for p in serve.pids("fleet") if p != fleet], 120,
                               "Ray to restart the fleet actor")
        back_s = back_s or time.monotonic() - killed
        worker, cached, again = chat(client)
        assert (worker, again) == (holder, text) and cached > 0

        # The restarted fleet knows its workers: removing one works, and it stops.
        resp = client.delete("/v1/workers/worker-1")
        assert resp.status_code == 200, resp.text
        print(f"{answered} chats answered in the 5 s after the kill; a new fleet process "
              f"{new} by {back_s:.1f}s; it removed worker-1 {time.monotonic() - killed:.1f}s "
              "after the kill")
        helpers.wait_for(lambda: len(serve.pids("worker")) == 1, 60, "worker-1 to stop")
        helpers.assert_idle_accounting(serve_url(port))
        ray_processes = serve.descendants()
    finally:
        code = serve.stop()
    assert code == 0, serve.output()
    helpers.wait_for(lambda: not any(p.is_running() and p.status() != "zombie"
                                     for p in ray_processes), 30,
                     "every Ray process to exit")


def serve_url(port: int) -> str:
    return f"http://127.0.0.1:{port}"
