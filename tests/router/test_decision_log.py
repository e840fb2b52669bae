"""The decision log: at DEBUG, every routing decision is one line naming the request, the
chosen worker and why, and each candidate's match and estimate (how an operator finds out
why a request went where it did)."""

from __future__ import annotations

import logging

from mem_cache.events import block_hashes
from router.routing.core import RoutingCore
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


def test_a_prefix_its_booked_requests_hold_takes_no_room(caplog) -> None:
    """One worker, 2,000 tokens of KV, running a request of a 1,024-token prompt with 200 tokens
    of its own. The next request of that prompt shares its 64 leading blocks (held=64) and
    fits; a prompt of the same size it does not share must wait for room."""
    core = RoutingCore()
    core.registry.add("w0")
    core.update_stats(WorkerStats("w0", kv_total=2000))
    shared = list(range(1024))
    with caplog.at_level(logging.DEBUG, logger="radixray.router.decisions"):
        core.route("r1", block_hashes(shared + [1] * 200), 1224, 16)
        core.route("r2", block_hashes(shared + [2] * 200), 1224, 16)
        core.route("r3", block_hashes(list(range(5000, 6224))), 1224, 16)
    lines = [r.getMessage() for r in caplog.records if r.name == "radixray.router.decisions"]
    fields = [dict(kv.split("=") for kv in line.split(" | ")[1].split()[1:]) for line in lines]
    room = [float(f["wait"]) - float(f["queue"]) for f in fields]  # the wait past the queue
    assert fields[1]["held"] == "64" and room[1] == 0.0
    assert fields[2]["held"] == "0" and room[2] > 0.0
