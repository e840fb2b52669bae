"""`bench/sweep_cost_weights.py --out`: a saved matrix run with `cost` replaced, for the
matrix's `--summary`; the other policies' figures are kept as they were."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench_scripts import load_bench_script


def load_script():
    return load_bench_script("sweep_cost_weights")


def saved_run(pooled: float) -> list[dict]:
    report = {"pooled_hit_rate": pooled, "cost": {"ttft_mean": 9.0}, "e2": {"ttft_mean": 1.0}}
    return [{"workers": 8, "kv_tokens": 100, "load": 0.5, "report": report}]


def test_cost_is_replaced_and_the_others_kept(tmp_path: Path) -> None:
    sweep = load_script()
    results = {(8, 100, 0.5): {"pooled": 0.3, "ttft_mean": 0.5, "hit_rate": 0.29}}
    sweep.write_with_cost(saved_run(pooled=0.3), str(tmp_path / "out.json"), results)
    (setting,) = json.loads((tmp_path / "out.json").read_text())
    assert setting["report"]["cost"] == {"ttft_mean": 0.5, "hit_rate": 0.29}
    assert setting["report"]["e2"] == {"ttft_mean": 1.0}
    assert setting["report"]["pooled_hit_rate"] == 0.3


def test_a_baseline_of_another_trace_or_seed_is_refused(tmp_path: Path) -> None:
    sweep = load_script()
    results = {(8, 100, 0.5): {"pooled": 0.31, "ttft_mean": 0.5}}
    with pytest.raises(SystemExit, match="another trace or seed"):
        sweep.write_with_cost(saved_run(pooled=0.3), str(tmp_path / "out.json"), results)
    assert not (tmp_path / "out.json").exists()
