"""`bench/sim_assignment_bound.py`: each group's requests stay on the engine its mask bit names;
a request leaves its engine only past the overflow wait."""

from __future__ import annotations

import argparse
import math

import pytest

from tests.bench_scripts import BENCH, load_bench_script


def load_script():
    return load_bench_script("sim_assignment_bound")


def settings(**kw) -> argparse.Namespace:
    base = dict(groups=4, per_group=4, system_len=640, question_len=200, rate=1.0,
                kv_tokens=40_000, event_delay=0.25,
                profile=str(BENCH / "profiles" / "vllm_cpu_smollm2_intel.json"))
    return argparse.Namespace(**{**base, **kw})


def groups_per_engine(bound, workload, result) -> dict[int, set[int]]:
    """group -> the engines its requests ran on."""
    out: dict[int, set[int]] = {}
    for request, worker in zip(workload.requests, result.worker_of, strict=True):
        out.setdefault(bound.group_of(request.request_id), set()).add(worker)
    return out


@pytest.mark.parametrize("mask", [0b0000, 0b0110, 0b1010])
def test_each_group_stays_on_the_engine_its_bit_names(mask):
    bound = load_script()
    workload, result = bound.simulate("assigned", mask, math.inf, 0, settings())
    assert groups_per_engine(bound, workload, result) == {g: {(mask >> g) & 1} for g in range(4)}


def test_an_overflow_moves_requests_off_their_engine():
    bound = load_script()
    args = settings(rate=4.0)  # a burst: waits of seconds behind the cold prefills
    workload, result = bound.simulate("assigned", 0, 0.5, 0, args)
    assert 1 in result.worker_of  # every group's engine is 0: engine 1 got only overflow
    kept, _, _ = bound.run(("assigned", 0, math.inf, 0, args))
    moved, _, _ = bound.run(("assigned", 0, 0.5, 0, args))
    assert moved < kept  # the moved requests recompute their group's prefix elsewhere
