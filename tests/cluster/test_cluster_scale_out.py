"""A worker added live under load is used at once, on a real `radixray serve`: it is priced
from its peers' prefill speed until its own traffic says otherwise (a first measurement taken
while its peers hold every core is a crowded moment, not the worker), so it takes its share
of uncached prompts."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import httpx
import pytest

from testing.serve_process import ServeProcess

pytestmark = pytest.mark.ray

CLIENTS = 4
WORDS = "time year people way day man thing woman life child world school state family".split()


def load(url: str, stop: threading.Event, served: list[tuple[float, str, int]], seed: int):
    """Chat turns of fresh ~400-token prompts (nothing cached anywhere) until `stop`;
    records (when, worker, status)."""
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=120) as client:
        while not stop.is_set():
            prompt = " ".join(rng.choice(WORDS) for _ in range(400))
            resp = client.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 4, "temperature": 0})
            served.append((time.monotonic(), resp.headers.get("x-radixray-worker", ""),
                           resp.status_code))


def test_a_worker_added_under_load_takes_its_share(helpers):
    port = helpers.free_port()
    url = f"http://127.0.0.1:{port}"
    serve = ServeProcess(["--model", "tiny", "--workers", "1", "--port", str(port),
                          "--kv-tokens", "16384", "--num-cpus", "2"])
    stop = threading.Event()
    served: list[tuple[float, str, int]] = []
    try:
        serve.wait_ready(300)
        clients = [threading.Thread(target=load, args=(url, stop, served, i), daemon=True)
                   for i in range(CLIENTS)]
        for c in clients:
            c.start()
        time.sleep(5)
        resp = httpx.post(url + "/v1/workers", json={"count": 1}, timeout=300)
        assert resp.status_code == 200, resp.text
        added = time.monotonic()
        time.sleep(20)
        rows = {r["id"]: r for r in helpers.workers_json(url)}
        stop.set()
        for c in clients:
            c.join(120)
    finally:
        code = serve.stop()
    assert code == 0, serve.output()
    after = Counter(w for t, w, status in served if t > added + 2 and status == 200)
    speeds = {w: round(r["prefill_tokens_per_s"]) for w, r in rows.items()}
    print(f"requests after the add by worker: {dict(after)}; prefill tokens/s: {speeds}")
    assert all(status == 200 for _, _, status in served)
    assert sum(after.values()) >= 20
    assert after["worker-1"] >= 0.25 * sum(after.values())  # two workers: half, less noise
