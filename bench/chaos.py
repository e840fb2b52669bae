"""Chaos soak: mixed traffic against a real `radixray serve --routers 2` while its processes are
killed on a seeded schedule, then the promises checked.

Starts `radixray serve --model tiny --workers 2 --routers 2` (its own local Ray), then:

1. reference: every prompt of the set once, greedy (temperature 0, `ignore_eos`), as chat and
   as completion, before any fault: the texts a run without faults gives;
2. soak: `--clients` closed-loop clients draw (seeded) from chat, completion, chat stream,
   session turn (`X-Session-ID`), abort (a stream dropped after two chunks), bad input
   (broken JSON, negative `max_tokens`, a prompt longer than the context, no messages) and
   slow reader (a stream read with a pause between chunks), for `--seconds`; meanwhile, from
   `--first-fault` s on, every `--gap` s (uniform in the range) a SIGKILL to a worker, a router
   replica or the fleet actor (each kind once first, in seeded order, then drawn);
3. settle: the traffic stops, the sessions are closed, both workers must be ready again, and
   a last pass of every prompt must give the reference texts;
4. checks: every request either completed with its reference text (aborts: ended when the
   client left) or got a clean 4xx / 429 / 503 in the OpenAI format (bad inputs: a 4xx),
   never a 5xx, never a client timeout (`--timeout`); a connection lost is allowed only while
   a router replica was being killed (its own connections go with it); at idle every worker's
   KV balances (`kv_free + kv_evictable + kv_session == kv_total`, nothing protected, nothing
   running or waiting, as `GET /v1/workers` reports it); the routers' and workers' resident
   memory back within `--rss-ratio` x + `--rss-slack-mb` of where it was after the reference
   pass (per kind, the largest process).

Prints the counts as a table and as JSON (`--json PATH` writes it too); exits 1 when a promise
is broken, so CI runs a short soak as a test (tests/cluster/test_cluster_chaos.py).

    python bench/chaos.py [--seconds 180] [--seed 1] [--clients 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from testing.serve_process import ServeProcess  # noqa: E402

MAX_TOKENS = 24
KINDS = ("chat", "completion", "stream", "session", "abort", "bad", "slow")
WEIGHTS = (4, 3, 3, 2, 1, 1, 1)
PREFIXES = ("You are a careful assistant. ", "Answer in one line. ", "Summarise the following. ")
OK_REFUSALS = (429, 503)  # what a request may get instead of its answer


def prompts(count: int) -> list[str]:
    """Prompts sharing a few prefixes (so caches and affinity matter), each its own tail."""
    return [PREFIXES[i % len(PREFIXES)] * 6 + f"item {i}: tell me about number {i * 7}."
            for i in range(count)]


@dataclass
class Outcome:
    kind: str
    result: str  # ok, refused, rejected, aborted, mismatch, server_error, timeout, dropped...
    status: int
    start: float
    end: float
    detail: str = ""


@dataclass
class Fault:
    at: float  # seconds since the soak started
    kind: str
    pid: int


@dataclass
class Report:
    seed: int
    seconds: float
    outcomes: Counter = field(default_factory=Counter)  # (kind, result) -> count
    faults: list[Fault] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    rss_mb: dict = field(default_factory=dict)
    final_pass: str = ""
    idle: list = field(default_factory=list)


def body_for(kind: str, prompt: str, stream: bool) -> tuple[str, dict]:
    common = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if kind == "completion":
        return "/v1/completions", {**common, "prompt": prompt, "stream": stream}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}],
                                    "stream": stream}


def text_of(path: str, data: dict) -> str:
    choice = data["choices"][0]
    if path == "/v1/completions":
        return choice.get("text") or ""
    return (choice.get("message") or choice.get("delta") or {}).get("content") or ""


class Traffic:
    """The closed-loop clients and what they saw."""

    def __init__(self, url: str, refs: dict, texts: list[str], timeout_s: float,
                 rng: random.Random) -> None:
        self.url, self.refs, self.texts, self.timeout_s, self.rng = url, refs, texts, timeout_s, rng
        self.outcomes: list[Outcome] = []
        self.sessions: set[str] = set()
        self.t0 = time.monotonic()

    async def client(self, index: int, until: float) -> None:
        rng = random.Random(self.rng.random())
        limits = httpx.Limits(max_keepalive_connections=0)  # a new connection per request
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout_s,
                                     limits=limits) as http:
            while time.monotonic() < until:
                kind = rng.choices(KINDS, WEIGHTS)[0]
                start = time.monotonic()
                try:
                    result, status, detail = await asyncio.wait_for(
                        self.one(http, kind, rng, index), self.timeout_s + 5)
                except (TimeoutError, httpx.TimeoutException) as exc:
                    result, status, detail = "timeout", 0, type(exc).__name__
                except (httpx.TransportError, httpx.RemoteProtocolError) as exc:
                    result, status, detail = "dropped", 0, type(exc).__name__
                self.outcomes.append(Outcome(kind, result, status, start - self.t0,
                                             time.monotonic() - self.t0, detail))

    async def one(self, http: httpx.AsyncClient, kind: str, rng: random.Random,
                  index: int) -> tuple[str, int, str]:
        i = rng.randrange(len(self.texts))
        prompt = self.texts[i]
        if kind == "bad":
            return await self.bad(http, rng)
        stream = kind in ("stream", "abort", "slow")
        path, body = body_for("chat" if kind != "completion" else kind, prompt, stream)
        headers = {}
        if kind == "session":
            sid = f"chaos-{index}-{rng.randrange(4)}"
            self.sessions.add(sid)
            headers["X-Session-ID"] = sid
        want = self.refs[(path, i)]
        if not stream:
            resp = await http.post(path, json=body, headers=headers)
            if resp.status_code != 200:
                return refusal(resp)
            got = text_of(path, resp.json())
            return ("ok", 200, "") if got == want else ("mismatch", 200, f"{got!r} != {want!r}")
        async with http.stream("POST", path, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return refusal(resp)
            text, chunks, done = "", 0, False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                data = json.loads(line[6:])
                if "error" in data:
                    return "stream_error", 200, json.dumps(data["error"])[:200]
                if data.get("choices"):
                    text += text_of(path, data)
                chunks += 1
                if kind == "abort" and chunks >= 2:
                    return "aborted", 200, ""
                if kind == "slow":
                    await asyncio.sleep(0.25)
            if not done:
                return "truncated", 200, f"{len(text)} chars"
            return ("ok", 200, "") if text == want else ("mismatch", 200, f"{text!r} != {want!r}")

    async def bad(self, http: httpx.AsyncClient, rng: random.Random) -> tuple[str, int, str]:
        case = rng.randrange(4)
        headers = {"Content-Type": "application/json"}
        if case == 0:
            resp = await http.post("/v1/chat/completions", content=b'{"model": "tiny", "mess',
                                   headers=headers)
        elif case == 1:
            resp = await http.post("/v1/completions", json={"model": "tiny", "prompt": "x",
                                                             "max_tokens": -1})
        elif case == 2:
            resp = await http.post("/v1/completions", json={
                "model": "tiny", "prompt": "word " * 50_000, "max_tokens": 4})
        else:
            resp = await http.post("/v1/chat/completions", json={"model": "tiny",
                                                                 "max_tokens": 4})
        if 400 <= resp.status_code < 500 and resp.status_code != 429:
            return ("rejected", resp.status_code, "") if openai_error(resp) else (
                "rejected_unformatted", resp.status_code, resp.text[:120])
        if resp.status_code in OK_REFUSALS:
            return refusal(resp)
        if resp.status_code == 200:
            return "accepted_bad", 200, f"case {case}"
        return "server_error", resp.status_code, resp.text[:200]


def openai_error(resp: httpx.Response) -> bool:
    try:
        error = resp.json()["error"]
        return isinstance(error, dict) and "message" in error
    except (ValueError, KeyError, TypeError):
        return False


def refusal(resp: httpx.Response) -> tuple[str, int, str]:
    """What a non-200 answer to a good request counts as."""
    code = resp.status_code
    if code in OK_REFUSALS and openai_error(resp):
        return "refused", code, ""
    if code >= 500:
        return "server_error", code, resp.text[:200]
    return "client_error", code, resp.text[:200]  # a good request must not get another 4xx


async def references(url: str, texts: list[str], timeout_s: float) -> dict:
    """(path, prompt index) -> the greedy text, before any fault."""
    refs = {}
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as http:
        for i, prompt in enumerate(texts):
            for kind in ("chat", "completion"):
                path, body = body_for(kind, prompt, False)
                resp = await http.post(path, json=body)
                resp.raise_for_status()
                refs[(path, i)] = text_of(path, resp.json())
    return refs


async def final_pass(url: str, texts: list[str], refs: dict, timeout_s: float) -> list[str]:
    """Every prompt once more after the faults: the differences from the reference."""
    wrong = []
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as http:
        for (path, i), want in sorted(refs.items()):
            body = body_for("completion" if path == "/v1/completions" else "chat", texts[i],
                            False)[1]
            resp = await http.post(path, json=body)
            ok = resp.status_code == 200
            got = text_of(path, resp.json()) if ok else f"HTTP {resp.status_code}"
            if got != want:
                wrong.append(f"{path} prompt {i}: {got!r} != {want!r}")
    return wrong


async def faults(serve: ServeProcess, rng: random.Random, t0: float, first_s: float,
                 gap: tuple[float, float], until: float, log: list[Fault]) -> None:
    """SIGKILL a worker, a router replica or the fleet actor on the seeded schedule."""
    order = ["worker", "router", "fleet"]
    rng.shuffle(order)
    at = first_s
    while True:
        wait = t0 + at - time.monotonic()
        if time.monotonic() + max(0.0, wait) >= until:
            return
        await asyncio.sleep(max(0.0, wait))
        kind = order.pop(0) if order else rng.choice(("worker", "router", "fleet"))
        pids = serve.pids(kind)
        if pids:
            pid = rng.choice(pids)
            try:
                os.kill(pid, signal.SIGKILL)
                log.append(Fault(round(time.monotonic() - t0, 1), kind, pid))
                print(f"  t={time.monotonic() - t0:6.1f}s  SIGKILL {kind} pid {pid}",
                      flush=True)
            except ProcessLookupError:
                pass
        at += rng.uniform(*gap)


def workers_rows(url: str) -> list[dict]:
    return httpx.get(url + "/v1/workers", timeout=30).json()["data"]


def balanced(row: dict) -> bool:
    return (row["kv_free"] + row["kv_evictable"] + row["kv_session"] == row["kv_total"] > 0
            and row["kv_protected"] == 0 and row["running"] == 0 and row["waiting"] == 0)


def wait_idle(url: str, workers: int, timeout_s: float) -> tuple[bool, list]:
    """Both routers (several reads of the shared port) see every worker ready and balanced."""
    deadline = time.monotonic() + timeout_s
    rows: list = []
    while time.monotonic() < deadline:
        try:
            reads = [workers_rows(url) for _ in range(6)]
        except (httpx.HTTPError, ValueError, KeyError):
            time.sleep(1)
            continue
        rows = reads[-1]
        if all(len(r) == workers and all(w["state"] == "ready" and balanced(w) for w in r)
               for r in reads):
            return True, rows
        time.sleep(1)
    return False, rows


def rss(serve: ServeProcess) -> dict[str, float]:
    """The largest resident memory (MB) of each kind of process."""
    return {kind: round(max(serve.rss_mb(kind) or [0.0]), 1) for kind in ("router", "worker")}


def dropped_ok(outcome: Outcome, faults_log: list[Fault]) -> bool:
    """A lost connection is the killed router's own: its request was in flight at the kill."""
    return any(f.kind == "router" and outcome.start - 1 <= f.at <= outcome.end + 1
               for f in faults_log)


def judge(report: Report, outcomes: list[Outcome]) -> None:
    allowed = {"ok", "refused", "rejected", "aborted"}
    for o in outcomes:
        report.outcomes[(o.kind, o.result)] += 1
        if o.result in allowed and not (o.kind == "bad" and o.result == "ok"):
            continue
        if o.result == "dropped" and dropped_ok(o, report.faults):
            continue
        report.failures.append(f"{o.kind} {o.result} {o.status} at {o.start:.1f}-{o.end:.1f}s "
                               f"{o.detail}")


def table(report: Report) -> str:
    results = sorted({r for _, r in report.outcomes})
    lines = [f"{'kind':<11}" + "".join(f"{r:>14}" for r in results) + f"{'total':>8}"]
    for kind in KINDS:
        row = [report.outcomes.get((kind, r), 0) for r in results]
        lines.append(f"{kind:<11}" + "".join(f"{n:>14}" for n in row) + f"{sum(row):>8}")
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(args: argparse.Namespace) -> Report:
    rng = random.Random(args.seed)
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    serve = ServeProcess(["--model", "tiny", "--workers", "2", "--routers", "2", "--port",
                          str(port), "--kv-tokens", str(args.kv_tokens), "--num-cpus", "2"])
    report = Report(args.seed, args.seconds)
    try:
        serve.wait_ready(300)
        texts = prompts(args.prompts)
        t_ref = time.monotonic()
        refs = asyncio.run(references(url, texts, args.timeout))
        print(f"radixray chaos: {len(refs)} reference texts in {time.monotonic() - t_ref:.1f}s",
              flush=True)
        before = rss(serve)
        traffic = Traffic(url, refs, texts, args.timeout, rng)

        async def soak() -> None:
            until = time.monotonic() + args.seconds
            tasks = [asyncio.create_task(traffic.client(i, until)) for i in range(args.clients)]
            tasks.append(asyncio.create_task(faults(serve, random.Random(args.seed + 1),
                                                    traffic.t0, args.first_fault,
                                                    (args.gap_min, args.gap_max), until,
                                                    report.faults)))
            await asyncio.gather(*tasks)
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                for sid in sorted(traffic.sessions):
                    try:
                        await http.delete(f"/v1/sessions/{sid}")
                    except httpx.HTTPError:
                        pass

        asyncio.run(soak())
        judge(report, traffic.outcomes)
        idle, rows = wait_idle(url, 2, args.settle)
        report.idle = [{k: r[k] for k in ("id", "state", "kv_total", "kv_free", "kv_evictable",
                                          "kv_session", "kv_protected", "running", "waiting")}
                       for r in rows]
        if not idle:
            report.failures.append(f"not idle and balanced after {args.settle:.0f}s: {rows}")
        wrong = asyncio.run(final_pass(url, texts, refs, args.timeout))
        report.final_pass = "ok" if not wrong else f"{len(wrong)} differ"
        report.failures.extend(wrong[:5])
        after = rss(serve)
        report.rss_mb = {"before": before, "after": after,
                         "bound": {k: round(v * args.rss_ratio + args.rss_slack_mb, 1)
                                   for k, v in before.items()}}
        for kind, mb in after.items():
            if mb > report.rss_mb["bound"][kind]:
                report.failures.append(f"{kind} RSS {mb} MB over its bound "
                                       f"{report.rss_mb['bound'][kind]} MB")
    finally:
        code = serve.stop()
        if code != 0:
            report.failures.append(f"serve exited {code}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180.0, help="soak length")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--first-fault", type=float, default=8.0)
    parser.add_argument("--gap-min", type=float, default=10.0)
    parser.add_argument("--gap-max", type=float, default=20.0)
    parser.add_argument("--timeout", type=float, default=90.0, help="client timeout per request")
    parser.add_argument("--settle", type=float, default=120.0, help="time to get back to idle")
    parser.add_argument("--kv-tokens", type=int, default=8192)
    parser.add_argument("--rss-ratio", type=float, default=1.25)
    parser.add_argument("--rss-slack-mb", type=float, default=150.0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the report here too")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    report = run(args)
    out = {
        "bench": "chaos", "commit": commit(), "machine": f"{platform.node()} "
        f"{platform.machine()} {os.cpu_count()} cpus", "args": vars(args),
        "wall_s": round(time.monotonic() - t0, 1),
        "outcomes": {f"{k}/{r}": n for (k, r), n in sorted(report.outcomes.items())},
        "requests": sum(report.outcomes.values()),
        "faults": [asdict(f) for f in report.faults], "rss_mb": report.rss_mb,
        "final_pass": report.final_pass, "idle": report.idle, "failures": report.failures,
    }
    print(table(report))
    print(f"faults: {', '.join(f'{f.kind}@{f.at}s' for f in report.faults) or 'none'}")
    print(f"rss MB before {report.rss_mb.get('before')} after {report.rss_mb.get('after')} "
          f"bound {report.rss_mb.get('bound')}")
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    if report.failures:
        print("FAILED:\n  " + "\n  ".join(report.failures[:30]), file=sys.stderr)
        return 1
    print("radixray chaos: every promise held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
