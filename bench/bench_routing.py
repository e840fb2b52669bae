"""Routing decision time: prefix match + policy, with a large index.

For each worker count and prompt length, the index is filled with `--blocks` entries (random
chained-hash stand-ins, spread over the workers in 512-block chains), and some workers hold a
prefix of the measured prompt: one holds 3/4 of it, one 1/2, a quarter of them a shared
64-block system prompt. Then, per iteration:

- route+finish: `RoutingCore.route` (expiry check, match for every worker, views with their
  estimates, policy, booking, optimistic index entries) followed by `finish`: the whole
  per-request cost in the router;
- hash: `block_hashes` of the prompt's tokens, for reference (done once per request too).

Each figure is a percentile of per-call wall time; `cpu` is the same call's thread CPU time,
which other processes on a shared machine do not inflate. A row reports the median over runs.

    python bench/bench_routing.py                  # 16 and 64 workers, 1k/8k/32k, 3 runs
    python bench/bench_routing.py --json --runs 5 --policy cache_aware
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from collections.abc import Callable

from mem_cache.events import AllCleared, BlockStored, block_hashes, encode_batch
from router.routing.core import CoreConfig, RoutingCore
from router.routing.prefix_index import IndexConfig

BLOCK = 16
CHAIN = 512


def build_core(workers: int, blocks: int, policy: str, rng: random.Random) -> RoutingCore:
    config = CoreConfig(policy=policy, index=IndexConfig(max_blocks=blocks + 1_000_000))
    core = RoutingCore(config=config)
    per_worker = blocks // workers
    for w in range(workers):
        wid = f"w{w}"
        core.add_worker(wid)
        events = [AllCleared()]
        for start in range(0, per_worker, CHAIN):
            size = min(CHAIN, per_worker - start)
            events.append(BlockStored([rng.getrandbits(64) for _ in range(size)], None))
        core.apply_events(encode_batch(wid, 0, 0, events))
    return core


def share_prompt(core: RoutingCore, hashes: list[int], workers: int) -> None:
    """Make some workers hold prefixes of the prompt, as a busy cluster would."""
    shares = {0: len(hashes) * 3 // 4, 1: len(hashes) // 2}
    for w in range(2, workers, 4):
        shares[w] = min(64, len(hashes))
    for w, n in shares.items():
        cursor = core.event_cursor(f"w{w}")
        core.apply_events(encode_batch(f"w{w}", 0, cursor[1] + 1, [BlockStored(hashes[:n], None)]))


def timed_us(fn: Callable[[int], object], iters: int) -> tuple[list[float], list[float]]:
    """Per-call wall time and CPU time (thread time: immune to other processes), in us."""
    wall, cpu = [], []
    for i in range(iters):
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        fn(i)
        wall.append((time.perf_counter_ns() - t0) / 1000)
        cpu.append((time.thread_time_ns() - c0) / 1000)
    return wall, cpu


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_one(workers: int, tokens: int, args: argparse.Namespace, seed: int) -> dict:
    rng = random.Random(seed)
    core = build_core(workers, args.blocks, args.policy, rng)
    prompt = [rng.randrange(32000) for _ in range(tokens)]
    hashes = block_hashes(prompt, None, BLOCK)
    share_prompt(core, hashes, workers)
    expected = core.route("probe", hashes, tokens, 128)
    core.finish("probe")

    def route_finish(i: int) -> None:
        core.route(f"r{i}", hashes, tokens, 128)
        core.finish(f"r{i}")

    gc.collect()
    gc.disable()  # a collection of the 1M-entry index is not part of a decision
    try:
        route = timed_us(route_finish, args.iters)
        hashing = timed_us(lambda i: block_hashes(prompt, None, BLOCK), args.iters)
    finally:
        gc.enable()
    row = {
        "workers": workers,
        "tokens": tokens,
        "index_entries": core.index_blocks(),
        "chosen": [expected.worker_id, expected.reason],
    }
    for name, (wall, cpu) in (("route_finish", route), ("hash", hashing)):
        row[f"{name}_p50_us"] = round(pct(wall, 0.5), 1)
        row[f"{name}_p99_us"] = round(pct(wall, 0.99), 1)
        row[f"{name}_cpu_p50_us"] = round(pct(cpu, 0.5), 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="16,64")
    parser.add_argument("--tokens", default="1024,8192,32768")
    parser.add_argument("--blocks", type=int, default=1_000_000, help="index entries")
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--policy", default="cost")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = []
    for workers in map(int, args.workers.split(",")):
        for tokens in map(int, args.tokens.split(",")):
            runs = [bench_one(workers, tokens, args, seed) for seed in range(args.runs)]
            row = dict(runs[0])
            for key in [k for k in row if k.endswith("_us")]:
                row[key] = round(statistics.median(r[key] for r in runs), 1)
                row[key + "_runs"] = [r[key] for r in runs]
            results.append(row)
            if not args.json:
                print(
                    f"{workers:3d} workers {tokens:6d} tokens"
                    f"  route+finish p50 {row['route_finish_p50_us']:6.1f}"
                    f" p99 {row['route_finish_p99_us']:7.1f}"
                    f" cpu p50 {row['route_finish_cpu_p50_us']:6.1f} us |"
                    f" hash p50 {row['hash_p50_us']:6.1f} us  (runs {args.runs},"
                    f" {row['index_entries']} entries, {args.policy} -> {row['chosen']})",
                    flush=True,
                )
    if args.json:
        print(json.dumps({"policy": args.policy, "runs": args.runs, "results": results}))


if __name__ == "__main__":
    main()
