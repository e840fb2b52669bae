"""PrefixIndex: matching, optimistic entries, events, bound, worker removal."""

from __future__ import annotations

import pytest

from mem_cache.events import HOST, AllCleared, BlockRemoved, BlockStored, block_hashes
from router.routing.prefix_index import IndexConfig, PrefixIndex


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def index(clock: Clock) -> PrefixIndex:
    idx = PrefixIndex(IndexConfig(max_blocks=1000, optimistic_ttl_s=10.0), clock)
    for w in ("a", "b", "c"):
        idx.add_worker(w)
    return idx


PROMPT = block_hashes(list(range(160)))  # 10 blocks
OTHER = block_hashes(list(range(1, 161)))  # shares no block with PROMPT


def test_match_counts_leading_blocks_per_worker(index: PrefixIndex) -> None:
    index.apply("a", [BlockStored(PROMPT[:6], None)])
    index.apply("b", [BlockStored(PROMPT[:3], None)])
    index.apply("c", [BlockStored(PROMPT[1:], None)])  # no first block: no prefix
    assert index.match(PROMPT).device == {"a": 6, "b": 3}
    assert index.match(OTHER).device == {}
    assert index.match([]).device == {}


def test_match_stops_at_first_missing_block(index: PrefixIndex) -> None:
    index.apply("a", [BlockStored(PROMPT[:3] + PROMPT[4:], None)])
    assert index.match(PROMPT).device == {"a": 3}


def test_route_adds_optimistic_entries_confirmed_by_events(
    index: PrefixIndex, clock: Clock
) -> None:
    index.record_route("a", PROMPT)
    assert index.match(PROMPT).device == {"a": 10}
    assert not index.is_confirmed("a", PROMPT[0])
    index.apply("a", [BlockStored(PROMPT[:4], None)])
    assert index.is_confirmed("a", PROMPT[3]) and not index.is_confirmed("a", PROMPT[4])
    clock.now = 10.5
    assert index.expire() == 6
    assert index.match(PROMPT).device == {"a": 4}


def test_refresh_pending_restarts_the_ttl(index: PrefixIndex, clock: Clock) -> None:
    index.record_route("a", PROMPT)
    clock.now = 8.0
    index.refresh_pending("a", PROMPT)
    clock.now = 12.0
    assert index.expire() == 0
    clock.now = 18.5
    assert index.expire() == 10
    assert len(index) == 0


def test_block_removed_drops_confirmed_and_optimistic_entries(index: PrefixIndex) -> None:
    index.apply("a", [BlockStored(PROMPT[:5], None)])
    index.record_route("a", PROMPT)
    index.apply("a", [BlockRemoved(PROMPT[4:])])
    assert index.match(PROMPT).device == {"a": 4}
    assert index.num_blocks("a") == 4


def test_host_blocks_extend_a_device_match(index: PrefixIndex) -> None:
    index.apply("a", [BlockStored(PROMPT[:3], None), BlockStored(PROMPT[:8], None, HOST)])
    index.apply("b", [BlockStored(PROMPT[:5], None, HOST)])
    match = index.match(PROMPT)
    assert match.device == {"a": 3}
    assert match.host == {"a": 5, "b": 5}
    index.apply("a", [BlockRemoved(PROMPT[:8], HOST)])
    assert index.match(PROMPT).host == {"b": 5}


def test_all_cleared_forgets_one_worker_only(index: PrefixIndex) -> None:
    index.apply("a", [BlockStored(PROMPT, None)])
    index.apply("b", [BlockStored(PROMPT, None), BlockStored(PROMPT, None, HOST)])
    index.apply("b", [AllCleared()])
    assert index.match(PROMPT).device == {"a": 10}
    assert index.num_blocks("b") == 0 and index.num_blocks("b", HOST) == 0


def test_remove_worker_leaves_no_trace(index: PrefixIndex) -> None:
    index.apply("b", [BlockStored(PROMPT, None), BlockStored(PROMPT, None, HOST)])
    index.record_route("b", OTHER)
    index.remove_worker("b")
    assert len(index) == 0
    assert index._store.masks == {"device": {}, "host": {}}
    assert "b" not in index.workers()
    index.add_worker("d")  # reuses b's bit: must start empty
    assert index.match(PROMPT).device == {} and index.match(OTHER).device == {}


def test_memory_bound_evicts_least_recently_used(clock: Clock) -> None:
    index = PrefixIndex(IndexConfig(max_blocks=15), clock)
    index.add_worker("a")
    index.add_worker("b")
    index.apply("a", [BlockStored(PROMPT, None)])
    index.apply("b", [BlockStored(OTHER[:5], None)])
    index.record_route("a", PROMPT[:2])  # touch a's first blocks: now the newest
    index.apply("b", [BlockStored(OTHER[5:8], None)])  # 18 entries: evict the 3 oldest
    assert len(index) == 15
    assert not any(index.holds("a", h) for h in PROMPT[2:5])
    assert all(index.holds("a", h) for h in PROMPT[:2] + PROMPT[5:])


def test_events_of_unknown_workers_are_ignored(index: PrefixIndex) -> None:
    index.apply("zz", [BlockStored(PROMPT, None)])
    assert len(index) == 0


def test_confirmed_pair_counts_event_blocks_only_in_any_order(clock: Clock) -> None:
    one, two = (PrefixIndex(IndexConfig(max_blocks=1000, optimistic_ttl_s=10.0), clock)
                for _ in range(2))
    for idx in (one, two):
        idx.add_worker("a")
    one.apply("a", [BlockStored(PROMPT[:4], None), BlockStored(OTHER[:2], None)])
    two.apply("a", [BlockStored(OTHER[:2], None), BlockStored(PROMPT[:4], None)])
    one.record_route("a", PROMPT)  # the 6 guessed blocks are this router's own
    assert one.confirmed("a") == two.confirmed("a")
    assert one.confirmed("a")[0] == 6
    two.apply("a", [BlockRemoved(OTHER[1:2])])
    assert two.confirmed("a")[0] == 5 and two.confirmed("a") != one.confirmed("a")
    assert one.confirmed("nobody") == (0, 0)
