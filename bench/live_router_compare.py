"""Live side by side: our router vs `sglang-router` (cache_aware, defaults) in front of the same
cache-simulating workers (`testing.fake_worker`), on a slice of a Mooncake trace; then the
latency each router adds in front of zero-delay workers.

    python bench/live_router_compare.py --trace ../shared/traces/mooncake_conversation.jsonl.gz

Every process binds 127.0.0.1. Workers' caches are flushed before each router's run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from cluster.loadgen.client import Target
from cluster.loadgen.prompts import BenchRequest, bench_requests
from cluster.loadgen.report import format_summary, summarize
from cluster.loadgen.runner import RunConfig, run
from cluster.sim.workloads import trace_workload

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parents[1]  # `-m testing.fake_worker` imports from here


def wait_http(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(url)


def post(url: str) -> None:
    urllib.request.urlopen(urllib.request.Request(url, b"", method="POST"), timeout=10).read()


def start_workers(port: int, count: int, args: argparse.Namespace, scale: float):
    cmd = [
        sys.executable,
        "-m",
        "testing.fake_worker",
        "--host",
        HOST,
        "--port",
        str(port),
        "--count",
        str(count),
        "--tokenizer",
        args.tokenizer,
        "--time-scale",
        str(scale),
        "--kv-tokens",
        str(args.kv_tokens),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    urls = [f"http://{HOST}:{port + i}" for i in range(count)]
    for url in urls:
        wait_http(url + "/health")
    return proc, urls


def start_router(kind: str, port: int, urls: list[str], args: argparse.Namespace):
    if kind == "radixray":
        cmd = [
            sys.executable,
            "bench/http_router.py",
            "--host",
            HOST,
            "--port",
            str(port),
            "--tokenizer",
            args.tokenizer,
            "--policy",
            args.policy,
            "--workers",
            *urls,
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            HOST,
            "--port",
            str(port),
            "--policy",
            "cache_aware",
            "--worker-urls",
            *urls,
        ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_http(f"http://{HOST}:{port}/health")
    time.sleep(2)
    return proc


def load(url: str, requests: list[BenchRequest], cfg: RunConfig, stream: bool = True) -> dict:
    target = Target(url, "fake", stream=stream)
    outcomes, wall = asyncio.run(run(target, requests, cfg, progress=False))
    return summarize(outcomes, wall)


def tiny_requests(n: int) -> list[BenchRequest]:
    return [BenchRequest(f"q{i}", f"ping {i} hello", 16, 0.0) for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trace", required=True)
    parser.add_argument("--limit", type=int, default=1500)
    parser.add_argument("--speed", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--kv-tokens", type=int, default=200_000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--words-per-block", type=int, default=32)
    parser.add_argument("--tokenizer", default="tiny")
    parser.add_argument("--policy", default="cost")
    parser.add_argument("--latency-requests", type=int, default=300)
    parser.add_argument("--out", default="live_router_compare.json")
    args = parser.parse_args()
    workload = trace_workload(args.trace, args.speed, 0, args.limit)
    requests = bench_requests(workload, args.words_per_block, args.max_tokens)
    results: dict = {"settings": vars(args)}
    procs = []
    try:
        wproc, urls = start_workers(9400, args.workers, args, 1.0)
        procs.append(wproc)
        for i, kind in enumerate(("radixray", "sglang-router")):
            for url in urls:
                post(url + "/flush_cache")
            rproc = start_router(kind, 9500 + i, urls, args)
            summary = load(f"http://{HOST}:{9500 + i}", requests, RunConfig())
            rproc.terminate()
            rproc.wait(30)
            results[kind] = summary
            print(f"### {kind}\n{format_summary(summary)}\n", flush=True)
        wproc.terminate()
        wproc.wait(30)
        zproc, zurls = start_workers(9410, args.workers, args, 0.0)
        procs.append(zproc)
        latency: dict = {}
        routers = {"direct": zurls[0]}
        for i, kind in enumerate(("radixray", "sglang-router")):
            procs.append(start_router(kind, 9510 + i, zurls, args))
            routers[kind] = f"http://{HOST}:{9510 + i}"
        for kind, url in routers.items():
            for stream in (False, True):
                cfg = RunConfig(concurrency=1)
                s = load(url, tiny_requests(args.latency_requests), cfg, stream)
                latency[f"{kind} {'stream' if stream else 'json'}"] = s["e2e"]
        results["latency_e2e"] = latency
        for key, d in latency.items():
            print(f"{key:<24} e2e p50 {d['p50'] * 1e3:7.2f} ms  p99 {d['p99'] * 1e3:7.2f} ms")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
