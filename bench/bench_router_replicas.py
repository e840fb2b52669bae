"""Requests/s of 1 vs N router replicas on one address, in front of null backends, and what the
tokenize threads change.

Each replica is its own process: `create_app` under uvicorn (uvloop, httptools) over two
`NullBackend`s that answer at once, listening with `SO_REUSEPORT` on one shared port, as
`radixray serve --routers N` does (the kernel spreads connections over the replicas). A
heartbeat task on each replica's loop records how late it wakes (the loop's stalls). The load
generator (`--clients` processes, aiohttp, closed loop, `--concurrency` requests in flight in
all) sends chat requests (template + tokenization on every request) for `--duration` s per
setting; settings are interleaved run by run, so machine noise hits each alike.

Prints per setting and run: requests/s, replica CPU ms per request (user + system, all
replicas: less sensitive to other load than wall time), the loop's p99 and max stall, and how
the requests spread over the replicas (`X-Radixray-Router`); then medians.

    python bench/bench_router_replicas.py --routers 1,2 --tokenize-threads 2 --runs 3
    python bench/bench_router_replicas.py --routers 1 --tokenize-threads 0,2 --prompt-chars 4000
    python bench/bench_router_replicas.py ... --router-cpus 1 --client-cpus 0   # pinned
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
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_router_http import cpu_seconds, free_port  # noqa: E402
from null_servers import NullBackend  # noqa: E402

BEAT_S = 0.002  # heartbeat period: a gap beyond it is time the loop could not run


def serve_replica(port: int, threads: int, out: str, cpus: list[int] | None) -> None:
    """One router replica on the shared `port`; on SIGUSR1 stops and writes its loop's gaps
    to `out` (uvicorn re-raises SIGTERM once it has stopped, which would end us first)."""
    import uvicorn
    import uvloop

    from router.api.app import create_app
    from router.config import RouterConfig
    from worker.loader.builtin import builtin_model_path

    if cpus:
        os.sched_setaffinity(0, cpus)
    tiny = str(builtin_model_path("tiny"))
    config = RouterConfig(model="tiny", tokenizer=tiny, tokenize_threads=threads, max_concurrent=0)
    app = create_app(config, [NullBackend(f"null{i}", 1) for i in range(2)])
    pid = str(os.getpid()).encode()

    async def tagged(scope: dict, receive, send) -> None:  # which replica answered
        async def tag(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-radixray-router", pid)]
            await send(message)

        await app(scope, receive, tag if scope["type"] == "http" else send)

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(2048)
    server = uvicorn.Server(uvicorn.Config(
        tagged, log_level="error", access_log=False, http="httptools", lifespan="on"
    ))
    gaps: list[tuple[float, float]] = []  # (wall time, how late the heartbeat woke)

    async def heartbeat() -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(BEAT_S)
            gaps.append((time.time(), time.perf_counter() - t0 - BEAT_S))

    async def main() -> None:
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        beat = asyncio.create_task(heartbeat())
        asyncio.get_running_loop().add_signal_handler(
            signal.SIGUSR1, lambda: setattr(server, "should_exit", True)
        )
        await serving
        beat.cancel()

    uvloop.run(main())
    Path(out).write_text(json.dumps(gaps))


def load(url: str, concurrency: int, duration: float, chars: int, queue: mp.Queue,
         cpus: list[int] | None) -> None:
    """One client process: `concurrency` closed-loop clients; puts (done, elapsed, replicas)."""
    import aiohttp

    if cpus:
        os.sched_setaffinity(0, cpus)
    words = "the quick brown fox jumps over the lazy dog and runs far away ".split()
    content = " ".join(words[i % len(words)] for i in range(chars // 5))[:chars]
    payload = {"model": "tiny", "messages": [{"role": "user", "content": content}],
               "max_tokens": 16}
    replicas: Counter = Counter()

    async def main() -> tuple[int, float]:
        done = 0
        conn = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(connector=conn) as session:
            end = time.perf_counter() + duration

            async def client() -> None:
                nonlocal done
                while time.perf_counter() < end:
                    async with session.post(url + "/v1/chat/completions", json=payload) as r:
                        await r.read()
                        if r.status != 200:
                            raise RuntimeError(f"HTTP {r.status}")
                        replicas[r.headers.get("x-radixray-router", "?")] += 1
                    done += 1

            t0 = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(concurrency)))
            return done, time.perf_counter() - t0

    done, elapsed = asyncio.run(main())
    queue.put((done, elapsed, dict(replicas)))


def one_setting(routers: int, threads: int, args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tmp = tempfile.mkdtemp(prefix="radixray-replicas-")
    outs = [os.path.join(tmp, f"replica{i}.json") for i in range(routers)]
    procs = [
        ctx.Process(target=serve_replica, args=(port, threads, out, args.router_cpus), daemon=True)
        for out in outs
    ]
    for p in procs:
        p.start()
    try:
        wait_all_up(url, routers)
        run_clients(ctx, url, 1.0, args, ctx.Queue())  # warm-up: code paths, connections
        cpu0 = sum(cpu_seconds(p.pid) for p in procs)
        window = (time.time(), None)
        queue = ctx.Queue()
        results = run_clients(ctx, url, args.duration, args, queue)
        window = (window[0], time.time())
        cpu = sum(cpu_seconds(p.pid) for p in procs) - cpu0
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGUSR1)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.terminate()
    done = sum(r[0] for r in results)
    elapsed = max(r[1] for r in results)
    stalls = []
    for out in outs:
        gaps = json.loads(Path(out).read_text()) if os.path.exists(out) else []
        stalls += [g for t, g in gaps if window[0] <= t <= window[1]]
    stalls.sort()
    return {
        "routers": routers,
        "threads": threads,
        "rps": done / elapsed,
        "cpu_ms_per_request": cpu * 1000 / max(done, 1),
        "stall_p99_ms": stalls[int(len(stalls) * 0.99)] * 1000 if stalls else float("nan"),
        "stall_max_ms": stalls[-1] * 1000 if stalls else float("nan"),
        "per_replica": sorted(sum((Counter(r[2]) for r in results), Counter()).values()),
    }


def run_clients(ctx, url: str, duration: float, args, queue) -> list[tuple]:
    per = max(args.concurrency // args.clients, 1)
    clients = [
        ctx.Process(target=load, args=(url, per, duration, args.prompt_chars, queue,
                                       args.client_cpus), daemon=True)
        for _ in range(args.clients)
    ]
    for c in clients:
        c.start()
    results = [queue.get(timeout=duration + 120) for _ in clients]
    for c in clients:
        c.join(10)
    return results


def wait_all_up(url: str, routers: int) -> None:
    """Until `routers` distinct replicas have answered (new connections spread over them)."""
    import urllib.request

    seen: set[str] = set()
    for _ in range(1200):
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=1) as resp:
                seen.add(resp.headers.get("x-radixray-router", "?"))
            if len(seen) >= routers:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{routers} replicas did not come up at {url}")


def cpu_list(text: str | None) -> list[int] | None:
    return [int(c) for c in text.split(",")] if text else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routers", default="1,2", help="replica counts to compare")
    parser.add_argument("--tokenize-threads", default="2", help="tokenize_threads to compare")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--clients", type=int, default=2, help="load generator processes")
    parser.add_argument("--prompt-chars", type=int, default=200)
    parser.add_argument("--router-cpus", type=cpu_list, default=None, help="e.g. 1 or 0,1")
    parser.add_argument("--client-cpus", type=cpu_list, default=None, help="e.g. 0")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    settings = [
        (int(r), int(t)) for r in args.routers.split(",") for t in args.tokenize_threads.split(",")
    ]
    print(f"{os.cpu_count()} CPUs; replicas on {args.router_cpus or 'any'}, "
          f"{args.clients} client processes on {args.client_cpus or 'any'}; chat requests of "
          f"{args.prompt_chars} chars, 16 tokens out, {args.concurrency} in flight", flush=True)
    rows = []
    for run in range(args.runs):
        for routers, threads in settings:
            row = one_setting(routers, threads, args)
            rows.append(row)
            print(f"run {run} routers={routers} threads={threads}: {row['rps']:.0f} req/s, "
                  f"{row['cpu_ms_per_request']:.2f} CPU ms/req, loop stall p99 "
                  f"{row['stall_p99_ms']:.2f} max {row['stall_max_ms']:.1f} ms, per replica "
                  f"{row['per_replica']}", flush=True)
    for routers, threads in settings:
        mine = [r for r in rows if r["routers"] == routers and r["threads"] == threads]
        med = {k: statistics.median(r[k] for r in mine)
               for k in ("rps", "cpu_ms_per_request", "stall_p99_ms", "stall_max_ms")}
        print(f"median routers={routers} threads={threads}: {med['rps']:.0f} req/s, "
              f"{med['cpu_ms_per_request']:.2f} CPU ms/req, loop stall p99 "
              f"{med['stall_p99_ms']:.2f} max {med['stall_max_ms']:.1f} ms ({len(mine)} runs)")


if __name__ == "__main__":
    main()
