"""Radix cache throughput and memory: match_prefix + insert of 4k-token prompts, evict, bytes.

A tree is filled to `--tree-tokens` (default 1M) with prompts of `--prompt-len` tokens that share
random prefixes: each prompt copies the first `L` tokens of a randomly chosen earlier prompt
(L uniform in [0, prompt_len]) and continues with fresh random tokens. Then it measures, per page
size:

- match+insert/s: time inside one `match_prefix` and one `insert` per prompt (per second of
  this process's CPU time, which other jobs on a shared machine inflate less, and wall clock);
  around them the allocator gives slots, the tree is evicted to make room and duplicates are
  freed, as an engine does per request (that whole cycle is reported too);
- evict 1%: the time of one `evict(tree_tokens // 100)`;
- bookkeeping bytes per cached token: Python heap allocated by the tree (tracemalloc), KV
  tensors excluded (the cache holds none).

Prints one line per page size. Run: `python bench/bench_radix_cache.py [--page-sizes 1,16]`.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
import tracemalloc

import numpy as np
import torch

from mem_cache.allocator import KVAllocator
from mem_cache.radix_cache import RadixCache


def make_prompts(num: int, length: int, workload: str, rng: np.random.Generator) -> list:
    """`groups`: each prompt takes a random-length prefix of one of 64 shared 4k documents
    (system prompts, few-shot sets) and fills up with fresh tokens. `chain`: each prompt takes a
    random-length prefix of a random earlier prompt (a deep tree: ~40 nodes per path)."""
    bases = [rng.integers(0, 128_000, size=length, dtype=np.int64) for _ in range(64)]
    prompts: list[np.ndarray] = []
    for _ in range(num):
        fresh = rng.integers(0, 128_000, size=length, dtype=np.int64)
        if workload == "groups":
            donor = bases[int(rng.integers(len(bases)))]
        else:
            donor = prompts[int(rng.integers(len(prompts)))] if prompts else fresh
        shared = int(rng.integers(0, length + 1))
        fresh[:shared] = donor[:shared]
        prompts.append(fresh)
    return prompts


class Clock:
    """Wall and CPU seconds spent inside the radix cache's match_prefix + insert calls."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0

    def __enter__(self) -> None:
        self._w, self._c = time.perf_counter(), time.process_time()

    def __exit__(self, *exc: object) -> None:
        self.wall += time.perf_counter() - self._w
        self.cpu += time.process_time() - self._c


def serve(cache: RadixCache, alloc: KVAllocator, tokens: object, n: int, clock: Clock) -> None:
    """What an engine does for one request: match, then insert the prompt and free duplicates."""
    with clock:
        cache.match_prefix(tokens)
    if alloc.available_size() < n:
        cache.evict(n - alloc.available_size())
    slots = alloc.alloc(n)
    assert slots is not None
    with clock:
        cached = cache.insert(tokens, slots)
    if cached:
        alloc.free(slots[:cached])


def fill(cache: RadixCache, alloc: KVAllocator, prompts: list, tree_tokens: int) -> int:
    used = 0
    for p in prompts:
        if cache.total_size() >= tree_tokens:
            break
        serve(cache, alloc, p, len(p), Clock())
        used += 1
    return used


def bench_page(page: int, args: argparse.Namespace, as_list: bool) -> dict[str, float]:
    rng = np.random.default_rng(args.seed)
    length = args.prompt_len // page * page
    alloc = KVAllocator((args.tree_tokens + length) // page * page, page)
    prompts = make_prompts(args.tree_tokens * 3 // length + args.ops, length, args.workload, rng)
    inputs = [p.tolist() for p in prompts] if as_list else [torch.from_numpy(p) for p in prompts]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    cache = RadixCache(alloc, page_size=page, block_size=16)
    used = fill(cache, alloc, inputs, args.tree_tokens)
    cache.take_events()
    gc.collect()
    bytes_per_token = (tracemalloc.get_traced_memory()[0] - before) / cache.total_size()
    tracemalloc.stop()
    clock, start, cpu = Clock(), time.perf_counter(), time.process_time()
    for p in inputs[used : used + args.ops]:
        serve(cache, alloc, p, length, clock)
    cycle_cpu_ops = args.ops / (time.process_time() - cpu)
    cycle_ops = args.ops / (time.perf_counter() - start)
    cache.take_events()
    size = cache.total_size()
    start = time.perf_counter()
    freed = cache.evict(size // 100)
    evict_ms = (time.perf_counter() - start) * 1e3
    return {
        "ops": args.ops / clock.wall,
        "cpu_ops": args.ops / clock.cpu,
        "cycle_ops": cycle_ops,
        "cycle_cpu_ops": cycle_cpu_ops,
        "evict_ms": evict_ms,
        "freed": freed,
        "tree": size,
        "bytes": bytes_per_token,
        "nodes": cache.num_nodes(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-sizes", default="1,16")
    parser.add_argument("--tree-tokens", type=int, default=1_000_000)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--ops", type=int, default=2000, help="timed match+insert per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--input", choices=["tensor", "list"], default="tensor")
    parser.add_argument("--workload", choices=["groups", "chain"], default="groups")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for page in [int(p) for p in args.page_sizes.split(",")]:
        runs = [bench_page(page, args, args.input == "list") for _ in range(args.runs)]
        each = ", ".join(f"{r['ops']:,.0f}" for r in runs)
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"page={page:<3} {args.workload} input={args.input} tree={int(med['tree'])} tokens "
            f"nodes={int(med['nodes'])}\n"
            f"  match+insert/s: {med['cpu_ops']:,.0f} per CPU-second, {med['ops']:,.0f} wall "
            f"(wall runs: {each})\n"
            f"  with alloc/evict/free (engine cycle): {med['cycle_cpu_ops']:,.0f} per CPU-second, "
            f"{med['cycle_ops']:,.0f} wall\n"
            f"  evict 1%: {med['evict_ms']:.2f} ms ({int(med['freed'])} tokens)\n"
            f"  bookkeeping: {med['bytes']:.1f} B/token  [median of {args.runs} runs; "
            f"load average {os.getloadavg()[0]:.1f}]"
        )

if __name__ == "__main__":
    main()
