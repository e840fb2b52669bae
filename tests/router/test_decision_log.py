"""The decision log: at DEBUG, every routing decision is one line naming the request, the
chosen worker and why, and each candidate's match and estimate (how an operator finds out
why a request went where it did)."""

from __future__ import annotations

import logging

from router.core import RoutingCore
from worker.protocol import WorkerStats


def test_each_decision_is_logged_with_every_candidates_view(caplog) -> None:
    core = RoutingCore()
    for wid in ("a", "b"):
        core.registry.add(wid)
        core.update_stats(WorkerStats(wid))
    hashes = [11, 12, 13]
    with caplog.at_level(logging.DEBUG, logger="radixray.router.decisions"):
        first = core.route("r1", hashes, 48, 8)
        core.index.record_route(first.worker_id, hashes)
        second = core.route("r2", hashes, 48, 8)
    lines = [r.getMessage() for r in caplog.records if r.name == "radixray.router.decisions"]
    assert len(lines) == 2
    assert lines[0].startswith(f"r1 tokens=48 -> {first.worker_id} (")
    assert lines[1].startswith(f"r2 tokens=48 -> {second.worker_id} (")
    assert f"{first.worker_id}: match=3 " in lines[1]  # the second sees the first's blocks
    assert all(f"{w}: match=" in line for w in ("a", "b") for line in lines)


def test_nothing_is_formatted_above_debug(caplog) -> None:
    core = RoutingCore()
    core.registry.add("a")
    with caplog.at_level(logging.INFO, logger="radixray.router.decisions"):
        core.route("r1", [1], 16, 8)
    assert not [r for r in caplog.records if r.name == "radixray.router.decisions"]
