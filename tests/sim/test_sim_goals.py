"""The goal check of the simulator matrix: one run, and the medians over several seeds."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.sim.goals import HIT_SHARE, check_goals, median_report


def report(pooled: float = 0.4, **policies: tuple[float, float, float]) -> dict:
    """`name=(hit_rate, ttft_mean, ttft_p99)`, shaped like `build_report`'s object."""
    out: dict = {
        name: {"hit_rate": h, "ttft_mean": m, "ttft_p99": p} for name, (h, m, p) in policies.items()
    }
    out["pooled_hit_rate"] = pooled
    return out


def test_all_three_goals_met_against_the_best_other_of_each():
    r = report(cost=(0.39, 0.50, 5.0), kv_cost=(0.20, 0.55, 5.1), e2=(0.30, 0.90, 5.2))
    check = check_goals(r)
    assert check.ok and check.flags() == "yyy"
    assert check.best_mean == ("kv_cost", 0.55)
    assert check.best_p99 == ("kv_cost", 5.1)
    assert check.hit_share == pytest.approx(0.39 / 0.4)


@pytest.mark.parametrize(
    ("cost", "flags"),
    [
        ((0.379, 0.50, 5.0), "nyy"),  # 0.9475 of pooled: under 95%
        ((0.39, 0.55, 5.0), "yny"),  # a tie is not lower
        ((0.39, 0.50, 5.2), "yyn"),  # p99 lost to e2, though e2's mean is far worse
    ],
)
def test_each_goal_fails_on_its_own(cost, flags):
    r = report(cost=cost, kv_cost=(0.20, 0.55, 5.3), e2=(0.30, 0.90, 5.1))
    check = check_goals(r)
    assert check.flags() == flags
    assert not check.ok


def test_a_missing_policy_or_no_other_is_an_error():
    with pytest.raises(ValueError, match="not in the report"):
        check_goals(report(kv_cost=(0.2, 0.5, 5.0)))
    with pytest.raises(ValueError, match="no other policy"):
        check_goals(report(cost=(0.2, 0.5, 5.0)))


def test_medians_over_seeds_use_each_runs_own_pooled_rate():
    runs = [
        report(0.40, cost=(0.38, 0.50, 5.9), kv_cost=(0.2, 0.60, 5.8)),  # p99 lost
        report(0.50, cost=(0.48, 0.52, 5.5), kv_cost=(0.3, 0.61, 5.9)),
        report(0.20, cost=(0.19, 0.49, 5.6), kv_cost=(0.1, 0.58, 6.0), e2=(0.1, 1.0, 9.0)),
    ]
    med = median_report(runs)
    assert set(med) == {"cost", "kv_cost", "pooled_hit_rate"}  # e2 is not in every run
    assert med["pooled_hit_rate"] == 0.40
    assert med["cost"]["hit_rate"] / med["pooled_hit_rate"] == pytest.approx(0.95)
    assert med["cost"]["ttft_p99"] == 5.6 and med["kv_cost"]["ttft_p99"] == 5.9
    assert [check_goals(r).ok for r in runs] == [False, True, True]
    assert check_goals(med).ok


def test_medians_of_no_runs_are_an_error():
    with pytest.raises(ValueError):
        median_report([])


figures = st.tuples(st.floats(0.0, 1.0), st.floats(0.01, 10.0), st.floats(0.01, 60.0))


@given(st.floats(0.01, 1.0), figures, figures, st.integers(1, 5))
def test_the_median_of_copies_of_one_run_is_that_run(pooled, cost, other, copies):
    one = report(pooled, cost=cost, kv_cost=other)
    med = median_report([one] * copies)
    assert check_goals(med).flags() == check_goals(one).flags()
    assert check_goals(med).hit_share == pytest.approx(check_goals(one).hit_share)
    assert (check_goals(one).hit_share >= HIT_SHARE) == check_goals(one).hit_ok
