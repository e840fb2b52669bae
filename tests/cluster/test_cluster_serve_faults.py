"""Faults of the fleet, on one real `radixray serve --workers 1` (a module's tests in order):

1. A worker added live under load is used at once. Its first measured prefill is whatever
   prompt reached it first: a short turn, mostly a step's fixed cost, measures a speed tens of
   times below its peers'; priced at that, it got no long prompt again and never corrected the
   figure. Now the engine weights each step by its size from the first on, and the router
   prices a figure far off its peers' as theirs until the worker's own traffic backs it.
2. The fleet outlives its own process: the workers are detached, named actors, so killing
   `ray::FleetActor` leaves them (and their caches) running; Ray restarts the fleet, which
   adopts them; the router serves throughout; admin calls answer 503 while the fleet cannot
   be reached (never 500).
3. SIGTERM to serve after all that still leaves no Ray process.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import signal
import threading
import time
from collections import Counter

import httpx
import pytest

from testing.serve_process import ServeProcess

pytestmark = pytest.mark.ray

CLIENTS = 4
WORDS = "time year people way day man thing woman life child world school state family".split()
PROMPT = "a warm prompt that must stay cached across the fleet's restart " * 10


@pytest.fixture(scope="module")
def served(helpers):
    port = helpers.free_port()
    serve = ServeProcess(["--model", "tiny", "--workers", "1", "--port", str(port),
                          "--kv-tokens", "16384", "--num-cpus", "2"])
    try:
        serve.wait_ready(300)
        yield serve, f"http://127.0.0.1:{port}"
    finally:
        serve.stop()


def ask(client: httpx.Client, prompt: str) -> tuple[str, int]:
    resp = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4,
        "temperature": 0})
    return resp.headers.get("x-radixray-worker", ""), resp.status_code


def load(url: str, stop: threading.Event, answers: list[tuple[float, str, int]], seed: int):
    """Fresh ~400-token prompts (nothing cached anywhere) until `stop`; records (when, worker,
    status)."""
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=120) as client:
        while not stop.is_set():
            prompt = " ".join(rng.choice(WORDS) for _ in range(400))
            answers.append((time.monotonic(), *ask(client, prompt)))


def run_load(url: str, seconds: float, answers: list, seed: int) -> None:
    stop = threading.Event()
    clients = [threading.Thread(target=load, args=(url, stop, answers, seed + i), daemon=True)
               for i in range(CLIENTS)]
    for c in clients:
        c.start()
    time.sleep(seconds)
    stop.set()
    for c in clients:
        c.join(120)


def test_a_worker_added_under_load_takes_its_share(served, helpers):
    _, url = served
    answers: list[tuple[float, str, int]] = []
    run_load(url, 3, answers, 0)  # worker-0 measures itself on long prompts
    resp = httpx.post(url + "/v1/workers", json={"count": 1}, timeout=300)
    assert resp.status_code == 200, resp.text
    # short turns until one reaches the new worker: its first measured prefill
    first_short = {}
    with httpx.Client(base_url=url, timeout=60) as client, cf.ThreadPoolExecutor(4) as pool:
        for _ in range(10):
            for worker, status in pool.map(lambda i: ask(client, f"hi {i}"), range(4)):
                assert status == 200
                first_short[worker] = True
            if "worker-1" in first_short:
                break
    assert "worker-1" in first_short
    cold = {r["id"]: round(r["prefill_tokens_per_s"]) for r in helpers.workers_json(url)}
    resumed = time.monotonic()
    run_load(url, 8, answers, 100)
    rows = {r["id"]: round(r["prefill_tokens_per_s"]) for r in helpers.workers_json(url)}
    after = Counter(w for t, w, status in answers if t > resumed and status == 200)
    by_second = Counter((int(t - resumed), w) for t, w, status in answers if t > resumed)
    print(f"prefill tokens/s after the short turns: {cold}; long prompts after them by "
          f"worker: {dict(after)}; prefill tokens/s at the end: {rows}; by second: "
          f"{sorted(by_second.items())}")
    assert all(status == 200 for _, _, status in answers)
    assert sum(after.values()) >= 20
    # two equal workers: about half each (before the change: 0 of 293); a new worker starved
    # of CPU by a loaded machine was seen at 6%, so the bound is loose
    assert after["worker-1"] >= 0.15 * sum(after.values())


def chat(client: httpx.Client, prompt: str = PROMPT) -> tuple[str, int, str]:
    """(worker, cached prompt tokens, text) of one greedy chat turn; fails on anything but 200."""
    resp = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
        "temperature": 0})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    return resp.headers["x-radixray-worker"], cached, body["choices"][0]["message"]["content"]


def test_killing_the_fleet_actor_keeps_workers_caches_and_service(served, helpers):
    serve, url = served
    if len(helpers.workers_json(url)) < 2:  # the scale-out test above was not run
        assert httpx.post(url + "/v1/workers", json={"count": 1}, timeout=300).status_code == 200
    with httpx.Client(base_url=url, timeout=60) as client:
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
        helpers.wait_for(lambda: {r["id"] for r in helpers.workers_json(url)}
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
        helpers.assert_idle_accounting(url)


def test_sigterm_after_the_faults_leaves_no_ray_process(served, helpers):
    serve, _ = served
    ray_processes = serve.descendants()
    assert len(ray_processes) >= 3
    assert serve.stop() == 0, serve.output()
    helpers.wait_for(lambda: not any(p.is_running() and p.status() != "zombie"
                                     for p in ray_processes), 30, "every Ray process to exit")
