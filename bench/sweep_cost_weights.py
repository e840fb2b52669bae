"""Sweep the `cost` policy's weights over the 8 Mooncake settings of docs/benchmarks.md.

Runs `cost` only (the other policies do not depend on its weights) and compares each setting
with the best other policy's mean and p99 TTFT: from a saved matrix run (`--baseline`, the
`--out` of bench/sim_mooncake_matrix.py) or else `BEST_OTHER`, a seed-0 run of the other
policies from before the decode-step fit (pass `--baseline` for current figures).

    python bench/sweep_cost_weights.py --baseline matrix.json '{"compute": {"weight": 16}}'
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

TRACE = Path(__file__).resolve().parents[1] / "../shared/traces/mooncake_conversation.jsonl.gz"
ONE_PCT, FIVE_PCT = 935_936, 4_679_680  # KV tokens per worker: 1% / 5% of the distinct blocks
# (workers, kv tokens, load) -> best other policy's (mean, p99) TTFT, seed 0, before the step fit
BEST_OTHER = {
    (8, ONE_PCT, 0.5): (0.616, 6.27), (8, ONE_PCT, 0.8): (1.724, 9.82),
    (8, FIVE_PCT, 0.5): (0.534, 5.47), (8, FIVE_PCT, 0.8): (0.838, 6.30),
    (16, ONE_PCT, 0.5): (0.579, 5.844), (16, ONE_PCT, 0.8): (0.868, 6.47),
    (16, FIVE_PCT, 0.5): (0.562, 5.54), (16, FIVE_PCT, 0.8): (0.765, 5.93),
}


def run_setting(setting: tuple[int, int, float], weights: dict, trace: str, seed: int) -> dict:
    from cluster.sim.cli import add_simulate_args, run_simulate

    parser = argparse.ArgumentParser()
    add_simulate_args(parser)
    workers, kv_tokens, load = setting
    args = parser.parse_args([
        "--trace", trace, "--workers", str(workers), "--kv-tokens", str(kv_tokens),
        "--load", str(load), "--policy", "cost", "--json", "--no-progress", "--seed", str(seed),
        "--cost-config", json.dumps(weights),
    ])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run_simulate(args)
    report = json.loads(out.getvalue())
    return {"pooled": report["pooled_hit_rate"], **report["cost"]}


def best_other(settings: list[dict]) -> dict[tuple[int, int, float], tuple[float, float]]:
    """(workers, kv tokens, load) -> the best other policy's (mean, p99) TTFT in a saved run
    of bench/sim_mooncake_matrix.py (`--out`)."""
    best = {}
    for s in settings:
        others = [r for name, r in s["report"].items() if name not in ("cost", "pooled_hit_rate")]
        key = (s["workers"], s["kv_tokens"], s["load"])
        best[key] = (min(r["ttft_mean"] for r in others), min(r["ttft_p99"] for r in others))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("weights", nargs="?", default="{}", help="--cost-config overrides, JSON")
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--seed", type=int, default=0, help="the baseline run's seed")
    parser.add_argument("--baseline", metavar="JSON", help="the other policies' figures: a "
                        "saved matrix run (default: BEST_OTHER, seed 0)")
    parser.add_argument("--out", metavar="JSON", help="write the --baseline run with `cost` "
                        "replaced by this one (the matrix's format, for its --summary)")
    args = parser.parse_args()
    weights = json.loads(args.weights)
    if args.seed and not args.baseline:
        parser.error("--seed needs a --baseline run of the same seed (the default is seed 0's)")
    if args.out and not args.baseline:
        parser.error("--out needs a --baseline run to put this `cost` into")
    saved = None
    if args.baseline:
        with open(args.baseline) as f:
            saved = json.load(f)
    baseline = best_other(saved) if saved else BEST_OTHER
    settings = list(baseline)
    with ProcessPoolExecutor(2) as pool:
        n = len(settings)
        results = list(pool.map(
            run_setting, settings, [weights] * n, [args.trace] * n, [args.seed] * n
        ))
    met = {"hit": 0, "mean": 0, "p99": 0, "all": 0}
    for setting, r in zip(settings, results, strict=True):
        best_mean, best_p99 = baseline[setting]
        checks = {
            "hit": r["hit_rate"] / r["pooled"] >= 0.95,
            "mean": r["ttft_mean"] < best_mean,
            "p99": r["ttft_p99"] < best_p99,
        }
        checks["all"] = all(checks.values())
        for key, ok in checks.items():
            met[key] += ok
        print(f"{setting}: hit/pooled {r['hit_rate'] / r['pooled']:.3f}  mean "
              f"{r['ttft_mean']:.3f} s (best other {best_mean})  p99 {r['ttft_p99']:.2f} s "
              f"(best other {best_p99}){'  all goals met' if checks['all'] else ''}")
    print(f"{weights}: settings meeting hit {met['hit']}/8, mean {met['mean']}/8, "
          f"p99 {met['p99']}/8, all three {met['all']}/8")
    if args.out:
        write_with_cost(saved, args.out, dict(zip(settings, results, strict=True)))


def write_with_cost(settings: list[dict], out: str, results: dict) -> None:
    """The saved matrix run (`settings`, changed in place) with its `cost` figures replaced by
    `results`; the other policies do not read `cost`'s knobs, so their figures stand."""
    for s in settings:
        r = dict(results[(s["workers"], s["kv_tokens"], s["load"])])
        if r.pop("pooled") != s["report"]["pooled_hit_rate"]:
            raise SystemExit(f"{out}: the baseline was run on another trace or seed")
        s["report"]["cost"] = r
    with open(out, "w") as f:
        json.dump(settings, f, indent=1)


if __name__ == "__main__":
    main()
