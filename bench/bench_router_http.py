"""Router throughput and the latency it adds per request, in front of a null backend.

Three processes: the router (`create_app` under uvicorn, one `NullBackend` that answers every
request at once, in-process), a null OpenAI server (aiohttp, canned answers: the baseline any
HTTP hop costs with this client), and the load generator (this process). Per mode
(non-streaming, streaming) and run:

- open loop at `--rate` req/s for `--duration` s against the null server, then the router:
  latency percentiles of each; added = router - null server, per percentile;
- closed loop with `--concurrency` clients against the router: the throughput it sustains.

Latency is to the last byte of the response (streaming: the whole SSE stream, 16 chunks).
Goal (issue 4): added p50 < 1 ms at 500 req/s.

    python bench/bench_router_http.py                       # 3 runs, 500 req/s, 10 s each
    python bench/bench_router_http.py --runs 5 --rate 500 --duration 20 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from null_servers import serve_null, serve_router  # noqa: E402

OUTPUT_TOKENS = 16
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def one(session: Any, url: str, stream: bool) -> float:
    payload = {"model": "tiny", "prompt": PROMPT, "max_tokens": OUTPUT_TOKENS, "stream": stream}
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=payload) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}")
    return time.perf_counter() - t0


async def open_loop(
    url: str, stream: bool, rate: float, duration: float, connections: int = 64
) -> dict:
    import aiohttp

    conn = aiohttp.TCPConnector(limit=connections)  # keep-alive pool; more requests queue
    async with aiohttp.ClientSession(connector=conn) as session:
        for _ in range(50):  # warm up connections and code paths
            await one(session, url, stream)
        n = int(rate * duration)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        tasks = []
        for i in range(n):
            delay = t0 + i / rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session, url, stream)))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        elapsed = loop.time() - t0
    lat = sorted(r for r in results if isinstance(r, float))
    errors = sorted({type(r).__name__ for r in results if isinstance(r, BaseException)})
    return {
        "sent": n,
        "ok": len(lat),
        "errors": errors,
        "rate": len(lat) / elapsed,
        **{f"p{q}": _pct(lat, q) * 1000 for q in (50, 90, 99)},
    }


async def closed_loop(url: str, stream: bool, concurrency: int, duration: float) -> float:
    import aiohttp

    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        end = time.perf_counter() + duration

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < end:
                await one(session, url, stream)
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return done / (time.perf_counter() - t0)


def _pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(len(values) * q / 100))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc): the router's own cost per request,
    which other load on a shared machine inflates far less than wall-clock latency."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_up(url: str) -> None:
    import urllib.request

    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=1).read()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--connections", type=int, default=64, help="open-loop client's keep-alive pool"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so the servers are stopped too
    ctx = mp.get_context("spawn")
    ports = {"null": free_port()}
    ports["router_nonstream"] = free_port()
    ports["router_stream"] = free_port()
    procs = [
        ctx.Process(target=serve_null, args=(ports["null"],), daemon=True),
        ctx.Process(target=serve_router, args=(ports["router_nonstream"], 1), daemon=True),
        ctx.Process(target=serve_router, args=(ports["router_stream"], OUTPUT_TOKENS), daemon=True),
    ]
    for p in procs:
        p.start()
    rows = []
    try:
        urls = {k: f"http://127.0.0.1:{v}" for k, v in ports.items()}
        for url in urls.values():
            wait_up(url)
        for run in range(args.runs):
            for stream in (False, True):
                router = urls["router_stream" if stream else "router_nonstream"]
                base = asyncio.run(
                    open_loop(urls["null"], stream, args.rate, args.duration, args.connections)
                )
                pid = procs[2 if stream else 1].pid
                cpu0 = cpu_seconds(pid)
                via = asyncio.run(
                    open_loop(router, stream, args.rate, args.duration, args.connections)
                )
                cpu_ms = (cpu_seconds(pid) - cpu0) * 1000 / max(via["ok"] + 50, 1)
                tput = asyncio.run(closed_loop(router, stream, args.concurrency, args.duration))
                row = {
                    "run": run,
                    "stream": stream,
                    "null": base,
                    "router": via,
                    "added_ms": {q: via[q] - base[q] for q in ("p50", "p90", "p99")},
                    "max_rps": tput,
                    "router_cpu_ms_per_request": cpu_ms,
                }
                rows.append(row)
                if not args.json:
                    print(_line(row), flush=True)
    finally:
        for p in procs:
            p.terminate()
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for stream in (False, True):
            added = [r["added_ms"]["p50"] for r in rows if r["stream"] == stream]
            tput = [r["max_rps"] for r in rows if r["stream"] == stream]
            cpu = [r["router_cpu_ms_per_request"] for r in rows if r["stream"] == stream]
            print(
                f"{'stream' if stream else 'plain '}: added p50 median "
                f"{statistics.median(added):.2f} ms over {len(added)} runs; closed-loop "
                f"throughput median {statistics.median(tput):.0f} req/s; router CPU median "
                f"{statistics.median(cpu):.2f} ms/req"
            )


def _line(row: dict) -> str:
    r, n, a = row["router"], row["null"], row["added_ms"]
    return (
        f"run {row['run']} {'stream' if row['stream'] else 'plain '}: "
        f"router p50 {r['p50']:.2f} p90 {r['p90']:.2f} p99 {r['p99']:.2f} ms at "
        f"{r['rate']:.0f} req/s ({r['ok']}/{r['sent']} ok) | null p50 {n['p50']:.2f} "
        f"p99 {n['p99']:.2f} | added p50 {a['p50']:.2f} p90 {a['p90']:.2f} p99 "
        f"{a['p99']:.2f} ms | closed-loop {row['max_rps']:.0f} req/s"
    )


if __name__ == "__main__":
    main()
