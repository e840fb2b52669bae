"""Every routing policy on the Mooncake conversation trace: 8/16 workers, ~1%/~5% capacity,
load 0.5/0.8 (see `cluster.sim.cli` for the definition of load). Prints a markdown table per
setting and writes all reports as one JSON file.

    python bench/sim_mooncake_matrix.py --trace ../shared/traces/mooncake_conversation.jsonl.gz \
        --out /tmp/matrix.json

With `--summary m_s0.json m_s1.json ...` (runs of several seeds) it prints, per setting, how
many seeds meet `cost`'s goals and the goals on the medians over the seeds (`cluster.sim.goals`).
"""

from __future__ import annotations

import argparse
import json
import time

from cluster.sim.goals import check_goals, median_report
from cluster.sim.pooled import pooled_hit_rate
from cluster.sim.report import build_report, format_table
from cluster.sim.simulator import SimConfig, simulate
from cluster.sim.time_model import h100_llama3_8b
from cluster.sim.trace import TRACE_BLOCK_TOKENS, read_trace
from cluster.sim.workloads import Workload, trace_workload
from router.routing.policies import POLICY_NAMES


def distinct_blocks(path: str) -> int:
    return len({h for row in read_trace(path) for h in row["hash_ids"]})


def speed_for(path: str, workers: int, load: float, seed: int) -> float:
    """As `radixray simulate --load` finds it (the seed spreads the arrivals it measures)."""
    from cluster.sim.cli import speed_for_load

    return speed_for_load(trace_workload(path, 1.0, seed), workers, h100_llama3_8b(), load)


def run_setting(
    path: str, workers: int, kv_tokens: int, load: float, policies: list[str], seed: int
) -> dict:
    profile = h100_llama3_8b()
    speed = speed_for(path, workers, load, seed)
    workload: Workload = trace_workload(path, speed, seed)
    results = []
    for name in policies:
        started = time.perf_counter()
        results.append(simulate(workload, SimConfig(workers, kv_tokens, name, seed=seed), profile))
        print(f"  {name}: {time.perf_counter() - started:.1f} s", flush=True)
    report = build_report(results, pooled_hit_rate(workload, kv_tokens * workers))
    return {
        "workers": workers,
        "kv_tokens": kv_tokens,
        "load": load,
        "speed": speed,
        "report": report,
    }


def render(settings: list[dict]) -> str:
    """Markdown: one table per setting, policies by mean TTFT, hit rate as a share of pooled."""
    out = []
    for s in settings:
        report = s["report"]
        pooled = report["pooled_hit_rate"]
        out.append(f"**{s['workers']} workers, {s['kv_tokens']:,} KV tokens per worker, load "
                   f"{s['load']}** (speed {s['speed']:.2f}; pooled hit rate {pooled:.1%})\n")
        out.append("| policy | hit rate | / pooled | TTFT mean | TTFT p99 | load max/mean |")
        out.append("|---|---|---|---|---|---|")
        rows = [(k, v) for k, v in report.items() if k != "pooled_hit_rate"]
        for name, r in sorted(rows, key=lambda kv: kv[1]["ttft_mean"]):
            out.append(f"| {name} | {r['hit_rate']:.1%} | {r['hit_rate'] / pooled:.2f} | "
                       f"{r['ttft_mean']:.2f} s | {r['ttft_p99']:.2f} s | "
                       f"{r['load_max_over_mean']:.2f} |")
        out.append("")
    return "\n".join(out)


def summary(runs: list[list[dict]], policy: str = "cost") -> str:
    """Markdown: per setting, seeds meeting all three goals and the goals on the medians."""
    out = [
        f"| workers | KV/worker | load | seeds meeting all three | {policy} hit / pooled "
        f"(median) | mean TTFT: {policy} vs best other (medians) | p99 TTFT: {policy} vs best "
        "other (medians) | goals on the medians |",
        "|---|---|---|---|---|---|---|---|",
    ]
    per_seed = [0] * len(runs)
    for setting in runs[0]:
        key = (setting["workers"], setting["kv_tokens"], setting["load"])
        reports = []
        for j, run in enumerate(runs):
            match = [s for s in run if (s["workers"], s["kv_tokens"], s["load"]) == key]
            if not match:
                raise SystemExit(f"run {j} has no setting {key}")
            reports.append(match[0]["report"])
        checks = [check_goals(r, policy).ok for r in reports]
        per_seed = [n + ok for n, ok in zip(per_seed, checks, strict=True)]
        met = sum(checks)
        m = check_goals(median_report(reports), policy)
        out.append(
            f"| {key[0]} | {key[1]:,} | {key[2]} | {met} of {len(runs)} | {m.hit_share:.3f} | "
            f"{m.mean_s:.3f} vs {m.best_mean[1]:.3f} s ({m.best_mean[0]}) | {m.p99_s:.2f} vs "
            f"{m.best_p99[1]:.2f} s ({m.best_p99[0]}) | {m.flags()} |"
        )
    out.append("")
    out.append("Settings meeting all three goals, run by run: " + ", ".join(map(str, per_seed))
               + f" ({sum(per_seed)} of {len(runs) * len(runs[0])}).")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--render", metavar="JSON", help="only print a saved run as markdown")
    parser.add_argument("--summary", metavar="JSON", nargs="+",
                        help="only print the goals over saved runs of several seeds")
    parser.add_argument("--trace")
    parser.add_argument("--out", default="sim_matrix.json")
    parser.add_argument("--workers", default="8,16")
    parser.add_argument("--fractions", default="0.01,0.05")
    parser.add_argument("--loads", default="0.5,0.8")
    parser.add_argument("--policies", default=",".join(POLICY_NAMES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.render:
        with open(args.render) as f:
            print(render(json.load(f)))
        return
    if args.summary:
        runs = []
        for path in args.summary:
            with open(path) as f:
                runs.append(json.load(f))
        print(summary(runs))
        return
    if not args.trace:
        parser.error("--trace is required")
    blocks = distinct_blocks(args.trace)
    policies = args.policies.split(",")
    settings = []
    for workers in map(int, args.workers.split(",")):
        for fraction in map(float, args.fractions.split(",")):
            kv_tokens = round(blocks * fraction) * TRACE_BLOCK_TOKENS
            for load in map(float, args.loads.split(",")):
                print(
                    f"## {workers} workers, {kv_tokens} KV tokens ({fraction:.0%} of {blocks}"
                    f" blocks), load {load}",
                    flush=True,
                )
                setting = run_setting(args.trace, workers, kv_tokens, load, policies, args.seed)
                print(
                    f"speed {setting['speed']:.3f}\n{format_table(setting['report'])}\n", flush=True
                )
                settings.append(setting)
                with open(args.out, "w") as f:
                    json.dump(settings, f, indent=1)


if __name__ == "__main__":
    main()
