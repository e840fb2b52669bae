"""Host KV tier on the engine (issue 8): a multi-turn workload whose working set is ~5x the
device KV, with a host tier 10x the device KV vs without one.

`--convs` conversations take turns round-robin; each turn sends the whole history plus
`--user-tokens` new tokens and generates `--output-tokens`. Between two turns of the same
conversation every other conversation runs a turn, so the device cache alone cannot keep the
histories; the host tier can. Reported per configuration: hit rate (cached / prompt tokens),
mean and median TTFT, wall time.

    python bench/bench_engine_host.py                 # small model, CPU
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from worker.engine import Engine, EngineConfig
from worker.protocol import GenerateRequest, SamplingParams


def run_workload(engine: Engine, args: argparse.Namespace, vocab: int) -> dict:
    rng = random.Random(args.seed)
    histories = [[] for _ in range(args.convs)]
    sp = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    ttfts, prompt_tokens, cached_tokens = [], 0, 0
    start = time.perf_counter()
    for turn in range(args.turns):
        for conv, history in enumerate(histories):
            history.extend(rng.randrange(4, vocab) for _ in range(args.user_tokens))
            rid = f"c{conv}-t{turn}"
            sent = time.perf_counter()
            engine.add_request(GenerateRequest(rid, list(history), sp))
            first, output, cached = None, [], 0
            while engine.has_work():
                for chunk in engine.step():
                    if first is None and chunk.token_ids:
                        first = time.perf_counter() - sent
                    output.extend(chunk.token_ids)
                    cached = chunk.cached_tokens
            ttfts.append(first)
            prompt_tokens += len(history)
            cached_tokens += cached
            history.extend(output)
    s = engine.stats()
    return {
        "hit_rate": cached_tokens / prompt_tokens,
        "ttft_mean_s": statistics.mean(ttfts),
        "ttft_p50_s": statistics.median(ttfts),
        "wall_s": time.perf_counter() - start,
        "working_set_tokens": sum(len(h) for h in histories),
        "kv_tokens": s.kv_total,
        "kv_host_tokens": s.kv_host_total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--kv-tokens", type=int, default=2048)
    parser.add_argument("--host-factor", type=int, default=10, help="host KV = this x device KV")
    parser.add_argument("--host-policy", default="write_through")
    parser.add_argument("--convs", type=int, default=8)
    parser.add_argument("--turns", type=int, default=7)
    parser.add_argument("--user-tokens", type=int, default=160)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: default)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {}
    for name, host in (("device_only", 0), ("host_tier", args.host_factor * args.kv_tokens)):
        config = EngineConfig(
            model=args.model,
            kv_tokens=args.kv_tokens,
            host_kv_tokens=host,
            host_policy=args.host_policy,
            seed=0,
        )
        engine = Engine(config)
        r = run_workload(engine, args, engine.model.config.vocab_size)
        results[name] = r
        print(
            f"{name:>11}: hit rate {r['hit_rate']:.3f}  TTFT mean {r['ttft_mean_s'] * 1000:7.1f} ms"
            f"  p50 {r['ttft_p50_s'] * 1000:7.1f} ms  wall {r['wall_s']:6.1f} s  (working set "
            f"{r['working_set_tokens']} tokens, device KV {r['kv_tokens']}, host KV "
            f"{r['kv_host_tokens']})",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **results}, f, indent=2)


if __name__ == "__main__":
    main()
