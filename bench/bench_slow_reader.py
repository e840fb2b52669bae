"""A client that stops reading a long stream: what it costs the router's memory, and whether its
request is ended (KV freed) on the worker.

Starts `radixray serve --model tiny --workers 2` (its own local Ray), sends one streamed
completion of `--choices` x `--tokens` tokens (ignore_eos) on a raw socket with a 4 KiB receive
buffer that reads nothing, and samples the answering router replica's RSS (its pid is the
`X-Radixray-Router` header) every 5 s for `--watch` seconds; then closes the socket and prints
the RSS again, the workers' running requests and their free KV against their total.

    python bench/bench_slow_reader.py [--watch 60] [--tokens 8000] [--choices 2]
        [--send-timeout 30] [--runs 3] [--json bench/results/slow_reader.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def start(port: int, send_timeout: float | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--model", "tiny", "--workers", "2",
           "--port", str(port), "--num-cpus", "2", "--kv-tokens", "65536"]
    if send_timeout is not None:
        cmd += ["--send-timeout", str(send_timeout)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    os.killpg(proc.pid, signal.SIGTERM)
    code = proc.wait(120)
    raise RuntimeError(f"serve did not start (exit code {code}): {Path(log.name).read_text()}")


def run_once(port: int, args: argparse.Namespace) -> dict:
    url = f"http://127.0.0.1:{port}"
    warm = httpx.post(url + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "warm", "max_tokens": 4})
    pid = int(warm.headers["x-radixray-router"])
    before = rss_mb(pid)
    body = json.dumps({"model": "tiny", "prompt": "a story", "max_tokens": args.tokens,
                       "n": args.choices, "ignore_eos": True, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    samples = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < args.watch:
        time.sleep(5)
        samples.append(round(rss_mb(pid) - before, 1))
    sock.close()
    time.sleep(5)
    rows = httpx.get(url + "/v1/workers", timeout=10).json()["data"]
    return {
        "rss_before_mb": round(before, 1),
        "rss_growth_mb_every_5s": samples,
        "rss_growth_peak_mb": max(samples),
        "rss_growth_after_close_mb": round(rss_mb(pid) - before, 1),
        "workers_running_after": sum(r["running"] for r in rows),
        "kv_free_equals_total": all(r["kv_free"] + r["kv_evictable"] == r["kv_total"]
                                    for r in rows),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--watch", type=float, default=60.0)
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--choices", type=int, default=2)
    parser.add_argument("--send-timeout", type=float, default=None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    port = free_port()
    proc = start(port, args.send_timeout)
    try:
        runs = []
        for i in range(args.runs):
            runs.append(run_once(port, args))
            print(f"run {i}: {runs[-1]}", flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(120)
    peak = statistics.median(r["rss_growth_peak_mb"] for r in runs)
    print(f"median peak router RSS growth while the client read nothing: {peak} MB")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        out = {"commit": commit, "machine": platform.processor() or platform.machine(),
               "cpus": os.cpu_count(), "args": vars(args), "runs": runs,
               "median_peak_growth_mb": peak}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
