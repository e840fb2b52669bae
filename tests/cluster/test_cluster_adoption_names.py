"""A worker's Ray name holds what a restarted fleet needs to adopt it: its pool, id, group and
bundle (`cluster/adoption.py`); names of other fleets and other actors are not taken."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cluster.adoption import parse_worker, worker_name

part = st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=":@#"),
               min_size=1, max_size=12)


@given(fleet=part, pool=part, worker=part, group=part, bundle=st.integers(0, 10_000))
def test_a_workers_name_gives_back_where_it_runs(fleet, pool, worker, group, bundle):
    name = worker_name(fleet, pool, worker, group, bundle)
    assert parse_worker(fleet, name) == (pool, worker, group, bundle)
    assert parse_worker(fleet + "-other", name) is None


def test_other_names_are_not_workers_of_the_fleet():
    for name in ("radixray-fleet", "radixray:radixray-fleet-bad:p:worker-0@init-1#0",
                 "radixray:radixray-fleet:p:worker-0@init-1", "SERVE_CONTROLLER_ACTOR"):
        assert parse_worker("radixray-fleet", name) is None
