"""The Grafana dashboard queries the router's real Prometheus series, with their real labels:
the names pinned in BRIEF.md, and what router/metrics.py actually registers."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

# The router's metrics contract (BRIEF.md): name -> (type, label names).
CONTRACT: dict[str, tuple[str, frozenset[str]]] = {
    "radixray_requests": ("counter", frozenset({"endpoint", "status"})),
    "radixray_ttft_seconds": ("histogram", frozenset()),
    "radixray_inter_token_seconds": ("histogram", frozenset()),
    "radixray_e2e_seconds": ("histogram", frozenset()),
    "radixray_routed": ("counter", frozenset({"worker", "reason"})),
    "radixray_cached_tokens_predicted": ("counter", frozenset()),
    "radixray_cached_tokens_actual": ("counter", frozenset()),
    "radixray_prompt_tokens": ("counter", frozenset()),
    "radixray_generation_tokens": ("counter", frozenset()),
    "radixray_index_blocks": ("gauge", frozenset()),
    "radixray_sessions": ("gauge", frozenset()),
    "radixray_worker_kv_free": ("gauge", frozenset({"worker"})),
    "radixray_worker_running": ("gauge", frozenset({"worker"})),
    "radixray_worker_waiting": ("gauge", frozenset({"worker"})),
    "radixray_failovers": ("counter", frozenset()),
}
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def series(metrics: dict[str, tuple[str, frozenset[str]]]) -> dict[str, frozenset[str]]:
    """Exposed series name -> label names (histogram buckets also carry `le`)."""
    out = {}
    for name, (kind, labels) in metrics.items():
        for suffix in SUFFIXES[kind]:
            out[name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return out


@pytest.fixture(scope="module")
def queries(kube: Any) -> list[tuple[str, str]]:
    """(expr, legendFormat) of every panel target."""
    path = kube.K8S / "base" / "monitoring" / "grafana-dashboard.json"
    dashboard = json.loads(path.read_text())
    targets = [t for p in dashboard["panels"] for t in p.get("targets", [])]
    assert targets
    return [(t["expr"], t.get("legendFormat", "")) for t in targets]


def _names(expr: str) -> set[str]:
    return set(re.findall(r"\bradixray_\w+", expr))


def _labels(expr: str, legend: str) -> set[str]:
    grouped = {w.strip() for g in re.findall(r"\bby \(([^)]*)\)", expr) for w in g.split(",")}
    return (grouped | set(re.findall(r"\{\{(\w+)\}\}", legend))) - {"", "le"}


def test_dashboard_queries_only_contract_series(queries: list) -> None:
    known = series(CONTRACT)
    for expr, legend in queries:
        names = _names(expr)
        assert names, expr
        assert names <= set(known), names - set(known)
        for label in _labels(expr, legend):
            assert all(label in known[n] for n in names), (label, expr)


def test_dashboard_shows_every_contract_metric(queries: list) -> None:
    shown = {n for expr, _ in queries for n in _names(expr)}
    for name, (kind, _) in CONTRACT.items():
        assert any(name + suffix in shown for suffix in SUFFIXES[kind]), name


def _registered(module: Any) -> dict[str, tuple[str, frozenset[str]]]:
    """The metrics a router registers: those of a fresh RouterMetrics, else module globals."""
    from prometheus_client.metrics import MetricWrapperBase

    owner = module.RouterMetrics() if hasattr(module, "RouterMetrics") else module
    found = {}
    for value in vars(owner).values():
        if isinstance(value, MetricWrapperBase):
            # prometheus_client keeps the family name without `_total`, as the contract does
            found[value._name] = (value._type, frozenset(value._labelnames))
    return found


def test_router_registers_what_the_dashboard_queries(queries: list, kube: Any) -> None:
    module = kube.import_or_skip("router.metrics")
    registered = _registered(module)
    assert registered, "router.metrics registers no Prometheus metric"
    exposed = series(registered)
    for expr, legend in queries:
        for name in _names(expr):
            assert name in exposed, f"{name}: not registered by router/metrics.py"
            assert _labels(expr, legend) <= exposed[name] | {"le"}, (name, expr)
