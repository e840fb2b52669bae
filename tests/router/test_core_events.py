"""The core's event cursor per worker (`WorkerState.cursor`): a snapshot first, then batches in
sequence; a gap or a new epoch asks for a snapshot; stale snapshots, duplicates and batches of
workers it does not route to are ignored."""

from __future__ import annotations

from mem_cache.events import AllCleared, BlockRemoved, BlockStored, block_hashes, encode_batch
from router.routing.core import RoutingCore

PROMPT = block_hashes(list(range(160)))  # 10 blocks
OTHER = block_hashes(list(range(1, 161)))  # shares no block with PROMPT


def core_with(*workers: str) -> RoutingCore:
    core = RoutingCore("round_robin")
    for w in workers:
        core.add_worker(w)
    return core


def held(core: RoutingCore, hashes: list[int]) -> dict[str, int]:
    return core.index.match(hashes).device


def test_batches_need_a_snapshot_first_and_gaps_are_detected() -> None:
    core = core_with("a")
    assert not core.apply_events(encode_batch("a", 7, 1, [BlockStored(PROMPT[:2], None)]))
    assert held(core, PROMPT) == {} and core.event_cursor("a") is None
    assert core.apply_events(encode_batch("a", 7, 1, [AllCleared(), BlockStored(PROMPT[:2], None)]))
    assert core.event_cursor("a") == (7, 1) == core.registry["a"].cursor
    assert core.apply_events(encode_batch("a", 7, 2, [BlockStored(PROMPT[2:4], None)]))
    assert core.apply_events(encode_batch("a", 7, 2, [BlockRemoved(PROMPT)]))  # duplicate
    assert held(core, PROMPT) == {"a": 4}
    assert not core.apply_events(encode_batch("a", 7, 4, [BlockRemoved(PROMPT)]))  # gap
    assert not core.apply_events(encode_batch("a", 8, 3, [BlockRemoved(PROMPT)]))  # new epoch
    assert held(core, PROMPT) == {"a": 4} and core.event_cursor("a") == (7, 2)


def test_a_snapshot_replaces_the_state_and_a_stale_one_is_ignored() -> None:
    core = core_with("a")
    core.apply_events(encode_batch("a", 1, 5, [AllCleared(), BlockStored(PROMPT, None)]))
    core.index.record_route("a", OTHER)
    core.apply_events(encode_batch("a", 2, 0, [AllCleared(), BlockStored(PROMPT[:3], None)]))
    assert held(core, PROMPT) == {"a": 3} and held(core, OTHER) == {}
    assert core.apply_events(encode_batch("a", 2, 3, [AllCleared(), BlockStored(PROMPT, None)]))
    assert core.apply_events(encode_batch("a", 2, 1, [AllCleared()]))  # older than the cursor
    assert held(core, PROMPT) == {"a": 10} and core.event_cursor("a") == (2, 3)


def test_batches_of_unknown_or_dead_workers_are_ignored() -> None:
    core = core_with("a")
    assert core.apply_events(encode_batch("zz", 0, 0, [AllCleared(), BlockStored(PROMPT, None)]))
    core.registry.mark_dead("a")
    assert core.apply_events(encode_batch("a", 0, 0, [AllCleared(), BlockStored(PROMPT, None)]))
    assert len(core.index) == 0 and core.event_cursor("a") is None
