"""GCS fault tolerance: what a `radixray serve` cluster keeps when Ray's GCS dies and comes back.

Ray keeps the GCS's tables (actors, placement groups, jobs, nodes) in an external Redis when the
head starts with `RAY_REDIS_ADDRESS`; a new GCS process then reloads them, and the raylets, the
actors and the drivers reconnect to it (within `RAY_gcs_rpc_server_reconnect_timeout_s`). On
KubeRay this is the RayService/RayCluster option `gcsFaultToleranceOptions` (the chart's
`gcsFaultTolerance`): a head container that restarts finds its GCS state in Redis.

Here, on one machine: a private `redis-server` (no persistence, a free port), `ray start --head`
against it, and `radixray serve --address` on that Ray (`--workers` CPU workers of `--model`).
Then a closed-loop load (`--clients` clients, chat completions sharing a few long prefixes);
after `--warm` s the GCS process is killed with SIGKILL, and `--down` s later started again with
the command line, environment and working directory it had (what a restarted head container
does); the load goes on for `--after` s. Printed, per run and as medians over `--runs`:

- requests lost: requests that failed (an HTTP error or a broken connection), from the kill on;
- seconds to recovery: from the kill to the first success after the last failure (0 when none
  failed), and the slowest request that was in flight or started while the GCS was down;
- workers kept: the fleet's worker ids and Ray actor ids after the restart, against before;
  cache kept: the cached share of prompt tokens in the `--window` s before the kill and after
  recovery (a worker that restarted empty shows as a dip);
- the fleet still takes orders: a worker added through `POST /v1/workers` after the restart
  (a new actor: needs the new GCS) becomes ready and serves.

    python bench/gcs_restart.py [--runs 3] [--down 5] [--after 30] [--json out.json]
    python bench/gcs_restart.py --no-redis     # the control: the same without GCS FT

Needs `redis-server` (Debian: apt install redis-server) and the `ray` command of this Python.
Every process it starts is its own (a temporary Ray directory): it stops them by pid.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate, timeout_s: float, what: str, every_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception:  # noqa: BLE001 - not up yet
            value = None
        if value:
            return value
        time.sleep(every_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")


@dataclass
class Cluster:
    """A private Redis, a Ray head using it for GCS fault tolerance, and `radixray serve`."""

    model: str
    workers: int
    kv_tokens: int
    redis: bool = True  # False: no GCS fault tolerance (the control)
    procs: list[subprocess.Popen] = field(default_factory=list)
    tmp: str = ""
    redis_port: int = 0
    gcs_port: int = 0
    http_port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self) -> None:
        # short: Ray's socket paths live under it and must stay under 108 bytes
        self.tmp = tempfile.mkdtemp(prefix="rrgcs", dir="/tmp")
        self.redis_port, self.gcs_port, self.http_port = free_port(), free_port(), free_port()
        redis = shutil.which("redis-server")
        if redis is None:
            raise FileNotFoundError("redis-server")
        self.procs.append(subprocess.Popen(
            [redis, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.tmp],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))
        wait_until(self._redis_ping, 20, "redis-server")
        env = self.ray_env()
        ray = str(Path(sys.executable).with_name("ray"))
        started = subprocess.run(
            [ray, "start", "--head", "--port", str(self.gcs_port), "--temp-dir", self.tmp,
             "--num-cpus", str(self.workers + 1), "--include-dashboard=false",
             "--disable-usage-stats"],
            env=env, capture_output=True, text=True,
        )
        if started.returncode != 0:
            raise RuntimeError(f"ray start failed:\n{started.stdout[-2000:]}"
                               f"{started.stderr[-2000:]}")
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", "serve", "--model", self.model,
             "--workers", str(self.workers), "--device", "cpu", "--kv-tokens",
             str(self.kv_tokens), "--address", f"127.0.0.1:{self.gcs_port}",
             "--host", "127.0.0.1", "--port", str(self.http_port),
             "--fleet-name", f"gcs-bench-{uuid.uuid4().hex[:6]}"],
            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(f"{self.tmp}/serve.log", "w"),
        ))
        wait_until(lambda: httpx.get(self.url + "/v1/models", timeout=5).status_code == 200,
                   600, "radixray serve", every_s=1.0)

    def ray_env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.redis:
            env["RAY_REDIS_ADDRESS"] = f"127.0.0.1:{self.redis_port}"
            env["RAY_external_storage_namespace"] = "radixray-gcs-bench"
        env.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", "60")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        return env

    def _redis_ping(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.redis_port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")

    def ours(self) -> list[psutil.Process]:
        """Every process of this cluster's Ray (its command line names our temp dir)."""
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if any(self.tmp in part for part in proc.info["cmdline"] or []):
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    def gcs(self) -> psutil.Process:
        (proc,) = [p for p in self.ours() if p.name() == "gcs_server"]
        return proc

    def restart_gcs(self, down_s: float) -> tuple[float, int]:
        """SIGKILL the GCS, wait `down_s`, start it again as it was; (kill time, new pid)."""
        old = self.gcs()
        argv, env, cwd = old.cmdline(), old.environ(), old.cwd()
        killed_at = time.monotonic()
        old.send_signal(signal.SIGKILL)
        old.wait(10)
        time.sleep(down_s)
        log = open(f"{self.tmp}/gcs_restarted.log", "a")
        new = subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
        self.procs.append(new)
        return killed_at, new.pid

    def stop(self) -> None:
        # the whole private Ray goes: no graceful stop of the fleet is needed
        for proc in self.procs[1:]:  # serve, restarted GCS; redis last
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
        procs = self.ours()
        for raylet in (p for p in procs if p.name() == "raylet"):
            try:
                procs += raylet.children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        for proc in procs:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        if self.procs:
            self.procs[0].kill()
            self.procs[0].wait(10)
        shutil.rmtree(self.tmp, ignore_errors=True)


class Load:
    """Closed-loop clients; records (start, end, ok, prompt tokens, cached tokens, worker)."""

    def __init__(self, url: str, clients: int, prefixes: int) -> None:
        self.url, self.clients = url, clients
        self.model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        self.errors: dict[str, int] = {}
        self.prefixes = [f"Document {i}: " + " ".join(f"w{i}x{j}" for j in range(120))
                         for i in range(prefixes)]
        self.rows: list[tuple[float, float, bool, int, int, str]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                        for i in range(clients)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def _client(self, index: int) -> None:
        n = 0
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                prefix = self.prefixes[(index + n) % len(self.prefixes)]
                n += 1
                body = {"model": self.model, "max_tokens": 4, "temperature": 0,
                        "messages": [{"role": "user", "content": f"{prefix} q{index}-{n}"}]}
                t0 = time.monotonic()
                try:
                    r = client.post(self.url + "/v1/chat/completions", json=body)
                    ok = r.status_code == 200
                    usage = r.json().get("usage", {}) if ok else {}
                    worker = r.headers.get("x-radixray-worker", "")
                    error = "" if ok else f"HTTP {r.status_code}"
                except (httpx.HTTPError, ValueError) as exc:
                    ok, usage, worker, error = False, {}, "", type(exc).__name__
                if not ok:
                    self.errors[error] = self.errors.get(error, 0) + 1
                    time.sleep(0.05)
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                self.rows.append((t0, time.monotonic(), ok, usage.get("prompt_tokens", 0),
                                  cached, worker))


def hit_rate(rows: list, lo: float, hi: float) -> float:
    done = [r for r in rows if r[2] and lo <= r[1] < hi]
    prompt = sum(r[3] for r in done)
    return sum(r[4] for r in done) / prompt if prompt else 0.0


def actor_pids(cluster: Cluster) -> dict[str, list[int]]:
    """The processes of the worker, fleet and router actors (children of this cluster's raylet,
    titled `ray::<Class>...`): the same pids after the restart are the same actors, with their
    models and KV caches."""
    found: dict[str, list[int]] = {"WorkerActor": [], "FleetActor": [], "RouterActor": []}
    for raylet in (p for p in cluster.ours() if p.name() == "raylet"):
        for child in raylet.children(recursive=True):
            try:
                title = " ".join(child.cmdline())
            except psutil.NoSuchProcess:
                continue
            for cls, pids in found.items():
                if title.startswith(f"ray::{cls}"):
                    pids.append(child.pid)
    return {cls: sorted(pids) for cls, pids in found.items()}


def one_run(args: argparse.Namespace) -> dict:
    cluster = Cluster(args.model, args.workers, args.kv_tokens, redis=not args.no_redis)
    t_start = time.monotonic()
    try:
        cluster.start()
        start_s = time.monotonic() - t_start
        before = {r["id"]: r for r in httpx.get(cluster.url + "/v1/workers", timeout=30)
                  .json()["data"]}
        actors_before = actor_pids(cluster)
        load = Load(cluster.url, args.clients, args.prefixes)
        load.start()
        time.sleep(args.warm)
        killed_at, _ = cluster.restart_gcs(args.down)
        time.sleep(args.after)
        load.finish()
        rows = load.rows
        try:
            after = {r["id"]: r for r in httpx.get(cluster.url + "/v1/workers", timeout=30)
                     .json()["data"]}
        except httpx.HTTPError:
            after = {}  # the router is gone
        actors_after = actor_pids(cluster)
        failed = [r for r in rows if not r[2] and r[1] >= killed_at]
        last_fail = max((r[1] for r in failed), default=None)
        if last_fail is None:
            recovery = 0.0
        else:
            recovered = [r[1] for r in rows if r[2] and r[0] >= last_fail]
            recovery = (min(recovered) - killed_at) if recovered else None  # never
        up_at = killed_at + args.down
        during = [r for r in rows if r[0] <= up_at and r[1] >= killed_at and r[2]]
        slowest = max((r[1] - max(r[0], killed_at) for r in during), default=0.0)
        served_while_down = sum(1 for r in rows if r[2] and killed_at <= r[1] < up_at)
        # the fleet takes orders through the new GCS: one worker more, ready and serving
        t0 = time.monotonic()
        add_error = ""
        try:
            added = httpx.post(cluster.url + "/v1/workers", json={"count": 1}, timeout=300)
            added_ids = added.json().get("added", []) if added.status_code == 200 else []
            if added.status_code != 200:
                add_error = f"HTTP {added.status_code}: {added.text[:300]}"
        except (httpx.HTTPError, ValueError) as exc:
            added_ids, add_error = [], repr(exc)
        add_s = time.monotonic() - t0
        result = {
            "requests_total": len(rows),
            "requests_after_kill": sum(1 for r in rows if r[1] >= killed_at),
            "requests_lost": len(failed),
            "failed_before_kill": sum(1 for r in rows if not r[2] and r[1] < killed_at),
            "errors": load.errors,
            "served_while_gcs_down": served_while_down,
            "recovery_s": None if recovery is None else round(recovery, 2),
            "slowest_request_across_outage_s": round(slowest, 2),
            "workers_before": sorted(before),
            "workers_kept": sorted(set(before) & set(after)),
            "actor_pids_before": actors_before,
            "actor_pids_after": actors_after,
            "worker_actors_kept": len(set(actors_before["WorkerActor"])
                                      & set(actors_after["WorkerActor"])),
            "hit_rate_before": round(hit_rate(rows, killed_at - args.window, killed_at), 3),
            "hit_rate_after": round(hit_rate(rows, rows[-1][1] - args.window, rows[-1][1]), 3),
            "worker_added_after_restart": added_ids,
            "add_worker_s": round(add_s, 1),
            "add_worker_error": add_error,
            "cluster_start_s": round(start_s, 1),
        }
        return result
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kv-tokens", type=int, default=8192)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--warm", type=float, default=10.0, help="seconds of load before")
    parser.add_argument("--down", type=float, default=5.0, help="seconds without a GCS")
    parser.add_argument("--after", type=float, default=30.0, help="seconds of load after")
    parser.add_argument("--window", type=float, default=5.0, help="hit-rate window (s)")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--no-redis", action="store_true",
                        help="the control: a head without an external Redis (no GCS FT)")
    parser.add_argument("--json", help="write the runs and medians here")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

    runs = []
    for i in range(args.runs):
        result = one_run(args)
        runs.append(result)
        print(f"run {i + 1}: " + json.dumps(result), flush=True)
    keys = ("requests_lost", "recovery_s", "slowest_request_across_outage_s",
            "served_while_gcs_down", "worker_actors_kept", "hit_rate_before", "hit_rate_after",
            "add_worker_s")
    medians = {}
    for k in keys:
        values = [r[k] for r in runs if r[k] is not None]
        medians[k] = statistics.median(values) if len(values) == len(runs) else None
    print("median: " + json.dumps(medians))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs,
                                               "medians": medians}, indent=2))


if __name__ == "__main__":
    main()
