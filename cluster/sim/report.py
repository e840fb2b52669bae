"""Summaries of simulation results: the JSON of `radixray simulate --json`, a table, a plot.

Per policy: `hit_rate` (cached prompt tokens / prompt tokens), `ttft_mean`, `ttft_p50`,
`ttft_p99`, `e2e_mean` (seconds), `load_max_over_mean` (the busiest worker's busy time over the
mean busy time: 1.0 is perfect balance of the work actually done, not of request counts), plus
`requests_per_worker`, `throughput_rps` and `output_tokens_per_s` (over the makespan), and
`host_hit_rate` (the part of `hit_rate` loaded back from a host tier).
`pooled_hit_rate` is the bound of `cluster.sim.pooled`.
"""

from __future__ import annotations

import numpy as np

from cluster.sim.simulator import SimResult

POLICY_KEYS = ("hit_rate", "ttft_mean", "ttft_p50", "ttft_p99", "e2e_mean", "load_max_over_mean")


def summarize(result: SimResult) -> dict:
    """The per-policy figures of one run."""
    ttft = np.asarray(result.ttft_s)
    busy = np.asarray(result.busy_s)
    prompt = sum(result.prompt_tokens)
    span = result.makespan_s or float("nan")
    return {
        "hit_rate": sum(result.cached_tokens) / prompt if prompt else 0.0,
        "host_hit_rate": sum(result.host_tokens) / prompt if prompt else 0.0,
        "ttft_mean": float(ttft.mean()) if len(ttft) else 0.0,
        "ttft_p50": float(np.percentile(ttft, 50)) if len(ttft) else 0.0,
        "ttft_p99": float(np.percentile(ttft, 99)) if len(ttft) else 0.0,
        "e2e_mean": float(np.mean(result.e2e_s)) if len(ttft) else 0.0,
        "load_max_over_mean": float(busy.max() / busy.mean()) if busy.mean() > 0 else 1.0,
        "requests_per_worker": list(result.requests_per_worker),
        "throughput_rps": len(ttft) / span,
        "output_tokens_per_s": sum(result.output_tokens) / span,
    }


def build_report(results: list[SimResult], pooled: float) -> dict:
    """One JSON-ready object: {policy name: summary, ..., "pooled_hit_rate": float}."""
    report: dict = {r.policy: summarize(r) for r in results}
    report["pooled_hit_rate"] = pooled
    return report


def policy_items(report: dict) -> list[tuple[str, dict]]:
    """The (policy, summary) pairs of a report."""
    return [(k, v) for k, v in report.items() if k != "pooled_hit_rate"]


def format_table(report: dict) -> str:
    """A fixed-width table, one row per policy, best TTFT first."""
    head = f"{'policy':<14}{'hit':>8}{'/pooled':>9}{'ttft mean':>11}{'p50':>9}{'p99':>9}"
    head += f"{'e2e mean':>10}{'load max/mean':>15}{'req/s':>8}"
    lines = [head, "-" * len(head)]
    pooled = report["pooled_hit_rate"]
    rows = sorted(policy_items(report), key=lambda kv: kv[1]["ttft_mean"])
    for name, s in rows:
        ratio = s["hit_rate"] / pooled if pooled else float("nan")
        lines.append(
            f"{name:<14}{s['hit_rate']:>8.1%}{ratio:>9.2f}{s['ttft_mean']:>10.3f}s"
            f"{s['ttft_p50']:>8.3f}s{s['ttft_p99']:>8.3f}s{s['e2e_mean']:>9.2f}s"
            f"{s['load_max_over_mean']:>15.2f}{s['throughput_rps']:>8.2f}"
        )
    lines.append(f"pooled hit rate (one cache of the whole cluster): {pooled:.1%}")
    return "\n".join(lines)


def plot(results: list[SimResult], report: dict, path: str) -> None:
    """TTFT CDF, hit rate vs pooled, and per-worker requests, one colour per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_cdf, ax_hit, ax_load) = plt.subplots(1, 3, figsize=(16, 4.5))
    names = [r.policy for r in results]
    for r in results:
        ttft = np.sort(np.asarray(r.ttft_s))
        ax_cdf.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=r.policy)
    ax_cdf.set_xscale("log")
    ax_cdf.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF")
    ax_cdf.legend()
    hits = [report[n]["hit_rate"] for n in names]
    ax_hit.bar(names, hits)
    ax_hit.axhline(report["pooled_hit_rate"], color="k", linestyle="--", label="pooled")
    ax_hit.set(ylabel="token hit rate", title="cache hit rate")
    ax_hit.legend()
    ax_hit.tick_params(axis="x", rotation=30)
    width = 0.8 / max(1, len(results))
    for i, r in enumerate(results):
        xs = np.arange(len(r.requests_per_worker)) + i * width
        ax_load.bar(xs, r.busy_s, width, label=r.policy)
    ax_load.set(xlabel="worker", ylabel="busy seconds", title="per-worker load")
    ax_load.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
