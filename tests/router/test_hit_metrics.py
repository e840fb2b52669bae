"""Per-worker predicted and real prefix hits, and false hits, on the router's /metrics."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from router.metrics import RouterMetrics


def samples(metrics: RouterMetrics) -> dict[tuple[str, str], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if "worker" in s.labels:
                out[(s.name, s.labels["worker"])] = s.value
    return out


def run(worker, predicted, cached, block_size=128):
    return SimpleNamespace(first_worker=worker, first_predicted=predicted, cached_tokens=cached,
                           block_size=block_size)


def test_false_hit_is_a_predicted_block_the_worker_did_not_reuse():
    metrics = RouterMetrics()
    metrics.hit(run("a", 1408, 0))  # false hit
    metrics.hit(run("a", 1408, 1408))
    metrics.hit(run("a", 127, 0))  # less than a block predicted: not a false hit
    metrics.hit(run("b", 0, 256))  # a hit the index did not see: not a false hit
    metrics.hit(run("b", 128, 0))  # false hit
    got = samples(metrics)
    assert got[("radixray_false_hits_total", "a")] == 1
    assert got[("radixray_false_hits_total", "b")] == 1
    assert got[("radixray_worker_cached_tokens_predicted_total", "a")] == 1408 * 2 + 127
    assert got[("radixray_worker_cached_tokens_actual_total", "a")] == 1408
    assert got[("radixray_worker_cached_tokens_actual_total", "b")] == 256
