"""Does a policy meet the routing goals on a simulator report, on one run or over several seeds.

The goals (issue 6, for `cost`): a hit rate of at least `HIT_SHARE` of the pooled hit rate (one
cache of the whole cluster's size, `cluster.sim.pooled`), and a mean and a p99 TTFT lower than
every other policy's in the report.

One seed is one sample: the seed spreads a trace's requests within its timestamp buckets, and
a p99 is set by the ~1% slowest requests, a few of which move with it. `median_report` gives
each policy's median over runs (hit rate as a share of that run's pooled rate), so the goals
can be read on the medians as well as run by run.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

from cluster.sim.report import policy_items

HIT_SHARE = 0.95


@dataclass(frozen=True, slots=True)
class GoalCheck:
    """One policy against the others on one report; `best_*` name the best other policy."""

    hit_share: float
    mean_s: float
    best_mean: tuple[str, float]
    p99_s: float
    best_p99: tuple[str, float]

    @property
    def hit_ok(self) -> bool:
        return self.hit_share >= HIT_SHARE

    @property
    def mean_ok(self) -> bool:
        return self.mean_s < self.best_mean[1]

    @property
    def p99_ok(self) -> bool:
        return self.p99_s < self.best_p99[1]

    @property
    def ok(self) -> bool:
        return self.hit_ok and self.mean_ok and self.p99_ok

    def flags(self) -> str:
        """'y' or 'n' for hit rate, mean and p99, in that order."""
        return "".join("y" if ok else "n" for ok in (self.hit_ok, self.mean_ok, self.p99_ok))


def check_goals(report: dict, policy: str = "cost") -> GoalCheck:
    """`policy` against every other policy of `report` (a `build_report` object)."""
    summaries = dict(policy_items(report))
    if policy not in summaries:
        raise ValueError(f"policy {policy!r} is not in the report")
    others = {name: s for name, s in summaries.items() if name != policy}
    if not others:
        raise ValueError("the report has no other policy to compare with")
    mine = summaries[policy]
    best_mean = min(others.items(), key=lambda kv: kv[1]["ttft_mean"])
    best_p99 = min(others.items(), key=lambda kv: kv[1]["ttft_p99"])
    return GoalCheck(
        hit_share=_share(report, policy),
        mean_s=mine["ttft_mean"],
        best_mean=(best_mean[0], best_mean[1]["ttft_mean"]),
        p99_s=mine["ttft_p99"],
        best_p99=(best_p99[0], best_p99[1]["ttft_p99"]),
    )


def median_report(reports: list[dict]) -> dict:
    """Medians over `reports` (one per seed) of `hit_rate`, `ttft_mean` and `ttft_p99`, for
    the policies in all of them.

    Each policy's `hit_rate` is its median share of pooled times the median pooled rate, so
    `check_goals` on the result compares the median share with `HIT_SHARE`."""
    if not reports:
        raise ValueError("no reports")
    names = set.intersection(*(set(dict(policy_items(r))) for r in reports))
    pooled = median(r["pooled_hit_rate"] for r in reports)
    out: dict = {}
    for name in sorted(names):
        share = median(_share(r, name) for r in reports)
        out[name] = {
            "hit_rate": share * pooled,
            "ttft_mean": median(r[name]["ttft_mean"] for r in reports),
            "ttft_p99": median(r[name]["ttft_p99"] for r in reports),
        }
    out["pooled_hit_rate"] = pooled
    return out


def _share(report: dict, name: str) -> float:
    pooled = report["pooled_hit_rate"]
    return report[name]["hit_rate"] / pooled if pooled > 0 else 1.0
