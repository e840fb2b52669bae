"""`radixray bench --url URL`: load any OpenAI-compatible endpoint with a workload and time it.

Entry points for `cluster/cli.py`: `add_bench_args(parser)` and `run_bench(args) -> int`
(0: every request succeeded; 1: some failed; 2: bad arguments or unreachable endpoint).

The workload flags are the simulator's (`--trace`, `--workload`, `--speed`, ...): a trace's block
ids become deterministic text blocks (`cluster.loadgen.prompts`), so shared ids are shared
prompt prefixes. Without `--rate` or `--concurrency` requests go out at the workload's own
arrival times (a trace's timestamps divided by `--speed`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

import aiohttp

from cluster.loadgen.client import Target
from cluster.loadgen.prompts import bench_requests
from cluster.loadgen.report import format_summary, summarize
from cluster.loadgen.runner import RunConfig, run
from cluster.sim.cli import add_workload_args, build_workload


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `radixray bench`."""
    parser.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name (default: the first listed)")
    parser.add_argument("--api-key", default=os.environ.get("RADIXRAY_API_KEY"))
    add_workload_args(parser)
    parser.add_argument("--rate", type=float, default=None, help="Poisson requests/s")
    parser.add_argument("--concurrency", type=int, default=None, help="requests in flight")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--duration", type=float, default=None, help="stop sending after (s)")
    parser.add_argument("--max-tokens", type=int, default=None, help="cap on output tokens")
    parser.add_argument("--words-per-block", type=int, default=32,
                        help="pseudo-words per workload block")
    parser.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    parser.add_argument("--no-stream", action="store_true")
    parser.add_argument("--timeout", type=float, default=600.0, help="per request (s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-progress", action="store_true")


async def first_model(url: str, api_key: str | None) -> str:
    """The id of the first model the endpoint lists."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as http:
        async with http.get(url.rstrip("/") + "/v1/models") as resp:
            body = await resp.json(content_type=None)
            return body["data"][0]["id"]


async def _bench(args: argparse.Namespace) -> dict:
    model = args.model or await first_model(args.url, args.api_key)
    target = Target(args.url, model, args.api_key, not args.no_stream, args.chat)
    workload = build_workload(args, args.speed or 1.0)
    requests = bench_requests(workload, args.words_per_block, args.max_tokens)
    cfg = RunConfig(args.rate, args.concurrency, args.num_requests, args.duration,
                    args.timeout, args.seed)
    outcomes, wall = await run(target, requests, cfg, not args.no_progress)
    return summarize(outcomes, wall)


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark described by `args`; print JSON or a summary; exit status."""
    if (args.rate is not None and args.rate <= 0) or (args.concurrency is not None
                                                       and args.concurrency <= 0):
        print("radixray bench: --rate and --concurrency must be positive", file=sys.stderr)
        return 2
    try:
        summary = asyncio.run(_bench(args))
    except (ValueError, OSError, KeyError, IndexError, aiohttp.ClientError) as exc:
        print(f"radixray bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary) if args.json else format_summary(summary))
    return 0 if summary["failed"] == 0 else 1
