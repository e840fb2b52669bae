"""Router replicas on a real local Ray (`tiny` model, CPU workers): how long two replicas'
indexes take to agree after a burst, and what killing a replica with SIGKILL costs.

One `Launcher` (as `radixray serve --routers 2 --workers 2`), then:

- agree: `--bursts` times, 32 completions sharing a new prefix, alternately to each replica's
  own port, all at once; from the last response, both replicas' `GET /v1/workers` are polled
  every 10 ms until their `index_blocks` / `index_digest` are equal for every worker and have
  moved for every worker that served the burst. Prints each time, then the median.
- kill: a steady closed-loop load (`--clients` clients, a new connection per request, on the
  shared port) of prompts drawn from `--prefixes` long shared prefixes, each with a unique
  tail. Per run: `--window` s of load, SIGKILL one replica (alternately), then time until Ray
  has restarted it and it serves (its `ready()` answers with a new pid; its own port answers
  `/health`), then `--window` s more. Prints the hit rate (cached / prompt tokens of the
  requests that completed) in the window before the kill and in the window after it, the
  requests that failed (the killed replica's own), and the medians over `--runs`.

    python bench/bench_router_failover.py [--runs 3] [--window 20] [--bursts 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_router_http import free_port  # noqa: E402

BURST = 32


def views(port: int) -> dict[str, tuple[int, str]]:
    rows = httpx.get(f"http://127.0.0.1:{port}/v1/workers", timeout=30).json()["data"]
    return {r["id"]: (r["index_blocks"], r["index_digest"]) for r in rows}


async def burst(ports: list[int], prefix: str) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=300) as client:
        return await asyncio.gather(*(
            client.post(f"http://127.0.0.1:{ports[i % 2]}/v1/completions", json={
                "model": "tiny", "prompt": f"{prefix} request {i}.", "max_tokens": 4,
                "temperature": 0,
            })
            for i in range(BURST)
        ))


def time_to_agree(ports: list[int]) -> float:
    before = views(ports[0])
    prefix = f"Burst {uuid.uuid4().hex}: " + "the tide rolls over the long grey shore. " * 15
    responses = asyncio.run(burst(ports, prefix))
    done = time.monotonic()
    served = {r.headers["x-radixray-worker"] for r in responses if r.status_code == 200}
    while time.monotonic() - done < 60:
        a, b = views(ports[0]), views(ports[1])
        if a == b and all(a[w] != before.get(w) for w in served):
            return time.monotonic() - done
        time.sleep(0.01)
    return float("nan")


class Load:
    """Closed-loop clients on the shared port; records (end time, ok, prompt, cached)."""

    def __init__(self, url: str, clients: int, prefixes: int) -> None:
        self.url, self.clients = url, clients
        self.prefixes = [
            f"Conversation {i} {uuid.uuid4().hex[:6]}: " + f"topic {i} goes on and on. " * 12
            for i in range(prefixes)
        ]
        self.rows: list[tuple[float, bool, int, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _client(self, c: int) -> None:
        n = 0
        while not self.stop.is_set():
            prompt = f"{self.prefixes[(c + n) % len(self.prefixes)]} tail {c}-{n}."
            n += 1
            try:
                async with httpx.AsyncClient(timeout=120) as client:  # a new connection each
                    r = await client.post(self.url + "/v1/completions", json={
                        "model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                    })
                ok = r.status_code == 200
                usage = r.json()["usage"] if ok else {}
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                self.rows.append((time.monotonic(), ok, usage.get("prompt_tokens", 0), cached))
            except (httpx.HTTPError, ValueError):
                self.rows.append((time.monotonic(), False, 0, 0))
                await asyncio.sleep(0.05)

    async def _run(self) -> None:
        await asyncio.gather(*(self._client(c) for c in range(self.clients)))

    def window(self, start: float, end: float) -> tuple[float, int, int]:
        """(hit rate, completed, failed) of the requests that ended in [start, end)."""
        rows = [r for r in self.rows if start <= r[0] < end]
        ok = [r for r in rows if r[1]]
        prompt = sum(r[2] for r in ok)
        return (sum(r[3] for r in ok) / prompt if prompt else float("nan"), len(ok),
                len(rows) - len(ok))


def kill_and_wait(launcher, index: int) -> tuple[float, float]:
    """SIGKILL replica `index`; seconds until Ray restarted it and it serves (new pid, its own
    port answers /health)."""
    import ray

    old = ray.get(launcher.routers[index].ready.remote())
    os.kill(old["pid"], signal.SIGKILL)
    killed = time.monotonic()
    while True:
        try:
            new = ray.get(launcher.routers[index].ready.remote(), timeout=5)
            if new["pid"] != old["pid"]:
                break
        except Exception:  # noqa: BLE001 - dead or restarting: ask again
            pass
        time.sleep(0.1)
    httpx.get(f"http://127.0.0.1:{new['port']}/health", timeout=30).raise_for_status()
    return killed, time.monotonic() - killed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="replica kills")
    parser.add_argument("--window", type=float, default=20.0, help="seconds before / after")
    parser.add_argument("--bursts", type=int, default=5)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--num-cpus", type=int, default=4, help="the local Ray's CPUs")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from cluster.config import ClusterConfig
    from cluster.launcher import Launcher

    ray.init(num_cpus=args.num_cpus, include_dashboard=False)
    config = ClusterConfig(model="tiny", port=free_port(), kv_tokens=16384, workers=2,
                           router_replicas=2, fleet_name="radixray-fleet-bench-failover")
    launcher = Launcher(config)
    try:
        launcher.start()
        ports = [r["port"] for r in ray.get([r.ready.remote() for r in launcher.routers])]
        print(f"{os.cpu_count()} CPUs on this machine, a local Ray of {args.num_cpus}; 2 tiny "
              "CPU workers, 2 router replicas", flush=True)
        agree = []
        for i in range(args.bursts):
            agree.append(time_to_agree(ports))
            print(f"burst {i}: indexes agree {agree[-1] * 1000:.0f} ms after the last response",
                  flush=True)
        print(f"agree: median {statistics.median(agree) * 1000:.0f} ms over {len(agree)} "
              "bursts", flush=True)

        load = Load(launcher.url, args.clients, args.prefixes)
        load.thread.start()
        time.sleep(5)  # warm: every prefix cached somewhere
        rows = []
        for run in range(args.runs):
            time.sleep(args.window)
            killed, took = kill_and_wait(launcher, run % 2)
            time.sleep(max(args.window - took, 0))
            before = load.window(killed - args.window, killed)
            after = load.window(killed, killed + args.window)
            rows.append((took, before[0], after[0]))
            print(f"run {run}: replica {run % 2} serving again {took:.1f} s after SIGKILL; hit "
                  f"rate {before[0]:.3f} in the {args.window:g} s before ({before[1]} ok, "
                  f"{before[2]} failed), {after[0]:.3f} in the {args.window:g} s after "
                  f"({after[1]} ok, {after[2]} failed)", flush=True)
        load.stop.set()
        load.thread.join(180)
        print(f"kill: median {statistics.median(r[0] for r in rows):.1f} s to serve again; "
              f"hit rate median {statistics.median(r[1] for r in rows):.3f} before, "
              f"{statistics.median(r[2] for r in rows):.3f} after ({len(rows)} runs)")
    finally:
        launcher.stop()
        ray.shutdown()


if __name__ == "__main__":
    main()
