"""A live radixray cluster under a shared-prefix workload, one policy after another.

    python bench/bench_cluster.py   # small, 2 CPU workers: cost, round_robin, cache_aware

For each policy it starts a fresh cluster (fresh, empty caches) in one local Ray, sends SGLang's
generated-shared-prefix workload (default 16 groups x 8 prompts, 1024-token shared prefix,
64-token question, 32 output tokens; all sent at t=0, streamed) through `radixray bench`'s load
generator, and prints throughput, TTFT p50/p99 and the cluster hit rate (cached / prompt tokens
as the workers reported them). It also times `radixray serve` (no arguments but a port) from
launch to its first chat answer. Figures print as a table and, with --json, as one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import httpx  # noqa: E402
import ray  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from cluster.config import ClusterConfig  # noqa: E402
from cluster.launcher import Launcher  # noqa: E402
from cluster.loadgen.client import Target  # noqa: E402
from cluster.loadgen.prompts import bench_requests, block_text  # noqa: E402
from cluster.loadgen.report import summarize  # noqa: E402
from cluster.loadgen.runner import RunConfig, run  # noqa: E402
from cluster.sim.workloads import SharedPrefixConfig, generated_shared_prefix  # noqa: E402
from worker.loader.builtin import resolve_model  # noqa: E402

BLOCK_TOKENS = 64  # the workload's block: the 64-token question is exactly one


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def words_per_block(model: str) -> int:
    """Pseudo-words per block so that one block is ~BLOCK_TOKENS tokens of this tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(model)))
    sample = [len(tokenizer.encode(block_text(b, 100), add_special_tokens=False))
              for b in range(20)]
    return max(1, round(100 * BLOCK_TOKENS / (sum(sample) / len(sample))))


def serve_to_first_answer(timeout_s: float = 600.0) -> float:
    """Seconds from launching `radixray serve --port P` to its first chat answer."""
    port = free_port()
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "--model", "tiny",
                             "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    body = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    try:
        while time.monotonic() - t0 < timeout_s:
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                               timeout=60)
                if r.status_code == 200:
                    return time.monotonic() - t0
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                raise RuntimeError("radixray serve exited before answering")
            time.sleep(0.2)
        raise TimeoutError("radixray serve did not answer")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(120)


def one_policy(args: argparse.Namespace, policy: str, requests: list) -> dict:
    config = ClusterConfig(model=args.model, workers=args.workers, policy=policy,
                           port=free_port(), kv_tokens=args.kv_tokens)
    launcher = Launcher(config, echo=lambda line: None)
    launcher.start()
    try:
        target = Target(launcher.url, args.model, stream=True, chat=False)
        outcomes, wall = asyncio.run(run(target, requests, RunConfig(
            concurrency=args.concurrency, timeout_s=1800.0), progress=not args.json))
        return summarize(outcomes, wall)
    finally:
        launcher.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--policies", default="cost,round_robin,cache_aware")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--kv-tokens", type=int, default=65536, help="per worker")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight (default: all sent at t=0)")
    p.add_argument("--no-startup", action="store_true", help="skip timing `radixray serve`")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    workload = generated_shared_prefix(SharedPrefixConfig(
        groups=args.groups, prompts_per_group=args.prompts_per_group,
        system_prompt_len=args.prefix_len, question_len=args.question_len,
        output_len=args.output_len, block_tokens=BLOCK_TOKENS), seed=0)
    requests = bench_requests(workload, words_per_block(args.model))
    report: dict = {"model": args.model, "workers": args.workers, "requests": len(requests),
                    "policies": {}}
    if not args.no_startup:
        report["serve_to_first_answer_s"] = round(serve_to_first_answer(), 1)
    ray.init(num_cpus=args.workers + 1, include_dashboard=False)
    try:
        for policy in args.policies.split(","):
            s = one_policy(args, policy, requests)
            report["policies"][policy] = {
                "completed": s["completed"], "failed": s["failed"], "wall_s": s["wall_s"],
                "throughput_rps": s["throughput_rps"],
                "output_tokens_per_s": s["output_tokens_per_s"], "hit_rate": s["hit_rate"],
                "ttft_p50_s": s["ttft"]["p50"], "ttft_p99_s": s["ttft"]["p99"],
                "prompt_tokens": s["prompt_tokens"],
                "requests_per_worker": s["requests_per_worker"],
            }
    finally:
        ray.shutdown()
    print(json.dumps(report, indent=2) if args.json else table(report))
    return 0


def table(report: dict) -> str:
    lines = [f"{report['model']}, {report['workers']} CPU workers, {report['requests']} "
             "shared-prefix requests"]
    if "serve_to_first_answer_s" in report:
        lines.append(f"radixray serve -> first answer: {report['serve_to_first_answer_s']} s")
    lines.append(f"{'policy':<13}{'req/s':>8}{'tok/s':>8}{'hit':>8}{'TTFT p50':>10}"
                 f"{'TTFT p99':>10}  per worker")
    for name, s in report["policies"].items():
        lines.append(
            f"{name:<13}{s['throughput_rps']:>8.2f}{s['output_tokens_per_s']:>8.1f}"
            f"{s['hit_rate']:>8.1%}{s['ttft_p50_s']:>9.2f}s{s['ttft_p99_s']:>9.2f}s  "
            f"{s['requests_per_worker']}" + (f" FAILED {s['failed']}" if s["failed"] else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
