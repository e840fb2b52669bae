"""Component radix cache (`HybridRadixCache`) costs: match, insert and eviction per component.

Two model shapes: `window` (full attention + one sliding-window group of `--window` tokens, as
Gemma 3) and `recurrent` (full attention + a recurrent group, as LFM2; states saved at every
`--chunk`-token chunk end and at the request end). Prompts of `--prompt-len` tokens share a
random-length prefix with one of 64 shared documents. The tree is filled to `--tree-tokens`,
then `--ops` requests are served as an engine does (match, lock, allocate the new tokens' KV of
every group, keep only window + chunk of window KV (`--keep all`: all of it), insert, free what
the tree did not take, unlock; evict a component when its allocator runs short), timing
match_prefix and insert (CPU seconds of this process). Then one eviction of 1% of each
component is timed.

Prints one line per shape and page size (medians over `--runs`).
Run: `python bench/bench_hybrid_cache.py [--page-sizes 1,16] [--shapes window,recurrent]`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from mem_cache.allocator import KVAllocator
from mem_cache.checkpoint_policy import CheckpointPolicy
from mem_cache.events import RECURRENT, SLIDING_WINDOW, KVGroup
from mem_cache.hybrid_cache import HybridRadixCache


def alloc_or_evict(cache: HybridRadixCache, c: int, n: int) -> np.ndarray:
    alloc = cache.allocators[c]
    ids = alloc.alloc(n)
    if ids is None:
        short = n - alloc.available_size()
        if c == cache.full:
            cache.evict(short)
        elif c == cache.recurrent:
            cache.evict_states(short)
        else:
            cache.evict_window(cache.groups[c].index, short)
        ids = alloc.alloc(n)
    assert ids is not None, "the pools are too small for one request"
    return ids.numpy()


def serve(cache: HybridRadixCache, tokens: np.ndarray, policy: CheckpointPolicy, chunk: int,
          clock: list[float], keep_window: bool = True) -> None:
    t = time.process_time()
    m = cache.match_prefix(tokens)
    clock[0] += time.process_time() - t
    cache.lock(m.node)
    n = len(tokens)
    full = np.concatenate([m.full.numpy(), alloc_or_evict(cache, cache.full, n - m.length)])
    windows = {}
    for i, c in enumerate(cache.window_pos):
        keep = cache.window_sizes[i] + chunk if keep_window else n
        start = max(m.length, (n - keep) // policy.page_size * policy.page_size)
        windows[cache.groups[c].index] = (start, alloc_or_evict(cache, c, n - start))
    states = {}
    if cache.recurrent is not None:
        pos = m.length
        while pos < n:
            end = policy.chunk_end(pos, chunk, n)
            for p in policy.points(pos, end, seq_end=end == n):
                states[p] = int(alloc_or_evict(cache, cache.recurrent, 1)[0])
            pos = end
    t = time.process_time()
    res = cache.insert(tokens, full, windows, states)
    clock[1] += time.process_time() - t
    cache.allocators[cache.full].free(res.unused_full)
    for c in cache.window_pos:
        cache.allocators[c].free(res.unused_windows[cache.groups[c].index])
    if res.unused_states:
        cache.allocators[cache.recurrent].free(res.unused_states)
    cache.unlock(m.node)


def run(shape: str, page: int, args: argparse.Namespace, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    length = args.prompt_len // page * page
    bases = [rng.integers(0, 128_000, size=length, dtype=np.int64) for _ in range(64)]
    size = (args.tree_tokens + 2 * length) // page * page
    groups = [KVGroup(0)]
    allocs = [KVAllocator(size, page)]
    if shape == "window":
        groups.append(KVGroup(1, SLIDING_WINDOW, args.window))
        allocs.append(KVAllocator(int(size * args.window_pool) // page * page, page))
    else:
        groups.append(KVGroup(1, RECURRENT))
        allocs.append(KVAllocator(size // args.chunk * 2, 1))
    cache = HybridRadixCache(groups, allocs, page, 16)
    policy = CheckpointPolicy(page)
    clock = [0.0, 0.0]

    def prompt() -> np.ndarray:
        fresh = rng.integers(0, 128_000, size=length, dtype=np.int64)
        shared = int(rng.integers(0, length + 1)) // page * page
        fresh[:shared] = bases[int(rng.integers(64))][:shared]
        return fresh

    for _ in range(3 * args.tree_tokens // length):  # the window pool may cap the tree
        if cache.total_size() >= args.tree_tokens:
            break
        serve(cache, prompt(), policy, args.chunk, clock, args.keep == "window")
    clock[:] = [0.0, 0.0]
    hits = 0
    for _ in range(args.ops):
        tokens = prompt()
        hits += cache.match_prefix(tokens).length
        serve(cache, tokens, policy, args.chunk, clock, args.keep == "window")
    out = {"match_us": clock[0] / args.ops * 1e6, "insert_us": clock[1] / args.ops * 1e6,
           "hit": hits / (args.ops * length), "nodes": cache.num_nodes(),
           "tree": cache.total_size()}
    t = time.perf_counter()
    cache.evict(cache.total_size() // 100)
    out["evict_full_ms"] = (time.perf_counter() - t) * 1e3
    second = groups[1].index
    t = time.perf_counter()
    if shape == "window":
        cache.evict_window(second, cache.total_size(second) // 100)
    else:
        cache.evict_states(max(1, cache.total_size(second) // 100))
    out["evict_second_ms"] = (time.perf_counter() - t) * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-sizes", default="1,16")
    parser.add_argument("--shapes", default="window,recurrent")
    parser.add_argument("--tree-tokens", type=int, default=200_000)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--window-pool", type=float, default=1.0,
                        help="window KV pool size, as a fraction of the full-attention pool")
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--keep", choices=["window", "all"], default="window",
                        help="window KV a request hands to insert: its last window + chunk "
                        "tokens (bounded memory), or all of the prompt's")
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        for page in (int(p) for p in args.page_sizes.split(",")):
            runs = [run(shape, page, args, seed) for seed in range(args.runs)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(f"{shape:9s} keep {args.keep:6s} page {page:2d}: "
                  f"match {med['match_us']:7.0f} us  insert {med['insert_us']:7.0f} us  "
                  f"evict 1% full {med['evict_full_ms']:6.1f}"
                  f" ms  evict 1% {'window' if shape == 'window' else 'states'} "
                  f"{med['evict_second_ms']:6.1f} ms  hit {med['hit']:.2f}  "
                  f"nodes {med['nodes']:.0f}  tree {med['tree']:.0f}  (medians of {args.runs})")


if __name__ == "__main__":
    main()
