"""A worker added live under load is used at once, on a real `radixray serve`.

Its first measured prefill is whatever prompt reached it first: a short turn, mostly a step's
fixed cost, measures a speed tens of times below its peers'. Priced at that, it got no long
prompt again and never corrected the figure. Now the engine weights each step by its size
from the first on, and the router prices a figure far off its peers' as theirs until the
worker's own traffic backs it, so the new worker takes its share of uncached prompts."""

from __future__ import annotations

import concurrent.futures as cf
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


def ask(client: httpx.Client, prompt: str) -> tuple[str, int]:
    resp = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4,
        "temperature": 0})
    return resp.headers.get("x-radixray-worker", ""), resp.status_code


def load(url: str, stop: threading.Event, served: list[tuple[float, str, int]], seed: int):
    """Fresh ~400-token prompts (nothing cached anywhere) until `stop`; records (when, worker,
    status)."""
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=120) as client:
        while not stop.is_set():
            prompt = " ".join(rng.choice(WORDS) for _ in range(400))
            served.append((time.monotonic(), *ask(client, prompt)))


def run_load(url: str, seconds: float, served: list, seed: int) -> None:
    stop = threading.Event()
    clients = [threading.Thread(target=load, args=(url, stop, served, seed + i), daemon=True)
               for i in range(CLIENTS)]
    for c in clients:
        c.start()
    time.sleep(seconds)
    stop.set()
    for c in clients:
        c.join(120)


def test_a_worker_added_under_load_takes_its_share(helpers):
    port = helpers.free_port()
    url = f"http://127.0.0.1:{port}"
    serve = ServeProcess(["--model", "tiny", "--workers", "1", "--port", str(port),
                          "--kv-tokens", "16384", "--num-cpus", "2"])
    served: list[tuple[float, str, int]] = []
    try:
        serve.wait_ready(300)
        run_load(url, 3, served, 0)  # worker-0 measures itself on long prompts
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
        run_load(url, 8, served, 100)
        rows = {r["id"]: round(r["prefill_tokens_per_s"]) for r in helpers.workers_json(url)}
    finally:
        code = serve.stop()
    assert code == 0, serve.output()
    after = Counter(w for t, w, status in served if t > resumed and status == 200)
    print(f"prefill tokens/s after the short turns: {cold}; long prompts after them by "
          f"worker: {dict(after)}; prefill tokens/s at the end: {rows}")
    assert all(status == 200 for _, _, status in served)
    assert sum(after.values()) >= 20
    assert after["worker-1"] >= 0.25 * sum(after.values())  # two workers: half, less noise
