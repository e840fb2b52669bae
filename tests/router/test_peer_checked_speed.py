"""A worker's prefill speed is checked against its peers' until its own traffic backs it.

A worker added live under load first prefills while its peers hold the machine's cores: it
measured 855 tokens/s beside its peers' 50,619, and priced at that it got no request again,
so the figure never changed. A figure more than `speed_outlier` times off the fleet's median
that rests on fewer than `speed_trust_tokens` of the worker's own traffic counts as the
median; with that much traffic behind it, it is the worker's own (a slower machine stays slow).
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from router.routing.core import CoreConfig, RoutingCore
from router.routing.estimate import EstimateConfig
from worker.protocol import WorkerStats

TRUST = EstimateConfig.speed_trust_tokens


def stats(worker_id: str, speed: float, measured: int) -> WorkerStats:
    return WorkerStats(worker_id, prefill_tokens_per_s=speed, prefill_tokens_measured=measured,
                       decode_step_s=0.01, kv_total=65536, kv_free=65536)


def speeds(reports: list[WorkerStats]) -> dict[str, float]:
    core = RoutingCore(config=CoreConfig(estimate=EstimateConfig()))
    for s in reports:
        core.add_worker(s.worker_id, s)
    return {v.worker_id: core.estimator.speeds(v).prefill_tokens_per_s for v in core.workers()}


def test_a_cold_figure_of_a_new_worker_is_priced_as_its_peers():
    got = speeds([stats("worker-0", 50_619, 10**6), stats("worker-1", 49_000, 10**6),
                  stats("worker-2", 855, 1024)])
    assert got["worker-2"] == got["worker-0"] == got["worker-1"]  # within noise: the median


def test_its_own_traffic_decides_once_it_has_enough():
    got = speeds([stats("worker-0", 50_619, 10**6), stats("worker-1", 49_000, 10**6),
                  stats("worker-2", 855, TRUST)])
    assert got["worker-2"] == 855


def test_two_workers_the_trusted_one_sets_the_median():
    got = speeds([stats("worker-0", 50_619, 10**6), stats("worker-1", 855, 512)])
    assert got == {"worker-0": 50_619, "worker-1": 50_619}


@given(
    peer=st.floats(1_000, 1e6),
    ratio=st.floats(0.01, 100),
    measured=st.integers(0, 4 * TRUST),
)
def test_an_untrusted_outlier_never_strays_more_than_the_outlier_band(peer, ratio, measured):
    fresh = peer * ratio
    got = speeds([stats("a", peer, 10**6), stats("b", peer, 10**6), stats("c", fresh, measured)])
    band = EstimateConfig.speed_outlier
    if measured >= TRUST:
        assert got["c"] == fresh or abs(fresh - peer) <= EstimateConfig.speed_noise * peer
    else:
        assert peer / band <= got["c"] <= peer * band
