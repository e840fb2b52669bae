"""The component cache's events (every block tagged with its group) and `check_integrity()`
naming each corrupted invariant."""

from __future__ import annotations

import numpy as np
import pytest

from mem_cache.allocator import KVAllocator
from mem_cache.events import (
    HOST,
    RECURRENT,
    SLIDING_WINDOW,
    AllCleared,
    BlockRemoved,
    BlockStored,
    KVGroup,
    block_hashes,
    decode_batch,
    encode_batch,
)
from mem_cache.hybrid_cache import HybridRadixCache

FULL, WIN, REC = KVGroup(0), KVGroup(1, SLIDING_WINDOW, 4), KVGroup(2, RECURRENT)


def make(host=False):
    allocs = [KVAllocator(64, 2), KVAllocator(64, 2), KVAllocator(8, 1)]
    hosts = [KVAllocator(64, 2), KVAllocator(64, 2), KVAllocator(8, 1)] if host else None
    return HybridRadixCache([FULL, WIN, REC], allocs, page_size=2, block_size=4,
                            host_allocators=hosts)


def fill(cache, tokens, states):
    full, win, st = cache.allocators
    n = len(tokens)
    return cache.insert(tokens, full.alloc(n), {1: (0, win.alloc(n))},
                        {p: int(st.alloc(1)[0]) for p in states})


def test_blocks_are_reported_per_group_with_the_chain_hashes():
    cache = make()
    tokens = list(range(12))
    fill(cache, tokens, states=[6, 8, 12])
    events = cache.take_events()
    hashes = block_hashes(tokens, None, 4)
    stored = {}
    for ev in events:
        assert isinstance(ev, BlockStored) and ev.group is not None
        stored.setdefault(ev.group, []).extend(ev.hashes)
    assert stored[FULL] == hashes and stored[WIN] == hashes
    assert stored[REC] == [hashes[1], hashes[2]], "a state at 6 ends no block; 8 and 12 do"
    # tombstoning the window of the inner nodes reports their window blocks removed, only there
    cache.evict_window(1, 6)
    removed = [ev for ev in cache.take_events() if isinstance(ev, BlockRemoved)]
    assert removed and all(ev.group == WIN for ev in removed)
    assert [h for ev in removed for h in ev.hashes] == hashes[:1]  # the nodes of 0..6, 6..8
    assert cache.evict_states(3) == 3
    ev = cache.take_events()
    assert all(e.group == REC and isinstance(e, BlockRemoved) for e in ev)
    assert sorted(h for e in ev for h in e.hashes) == sorted(hashes[1:3])
    # the wire format keeps the group
    batch = decode_batch(encode_batch("w", 1, 0, events))
    assert batch.events == events
    cache.check_integrity()


def test_snapshot_restates_every_group_and_medium():
    cache = make(host=True)
    fill(cache, list(range(12)), states=[8])
    live: dict = {}
    for ev in cache.take_events():
        key = (ev.group, ev.medium)
        if isinstance(ev, BlockStored):
            live.setdefault(key, set()).update(ev.hashes)
        else:
            live[key] -= set(ev.hashes)
    snap = cache.snapshot_events()
    assert isinstance(snap[0], AllCleared)
    again: dict = {}
    for ev in snap[1:]:
        again.setdefault((ev.group, ev.medium), set()).update(ev.hashes)
    assert again == {k: v for k, v in live.items() if v}
    assert (REC, HOST) in again


def corrupt_cases():
    def tomb_leaf(c, node):
        c._drop_window(node, 0)  # a leaf left a tombstone

    def wlock(c, node):
        node.wlocks[node.end + 100] = 1

    def size(c, node):
        c._evictable[1] -= 1

    def free_slot(c, node):
        c.allocators[0].free_pages(node.value[:1])

    def event(c, node):
        c.ledgers[2].refs.clear()

    def state_off(c, node):
        node.parent.state = node.state  # two nodes hold one state slot

    def host_prefix(c, node):
        parent = node.parent
        parent.host_value, parent.host_ready, parent.host_state = None, False, -1
        parent.host_windows = [None]

    return [
        (tomb_leaf, "tombstones"), (wlock, "locks"), (size, "sizes"), (free_slot, "slots"),
        (event, "events"), (state_off, "slots"), (host_prefix, "host prefix"),
    ]


@pytest.mark.parametrize("corrupt,name", corrupt_cases())
def test_check_integrity_names_the_broken_invariant(corrupt, name):
    cache = make(host=True)
    fill(cache, list(range(8)), states=[4, 8])
    node = cache.match_prefix(list(range(8))).node
    assert node.parent is not cache.root
    cache.check_integrity()
    corrupt(cache, node)
    with pytest.raises(AssertionError, match=f"^{name}"):
        cache.check_integrity()


def test_a_tombstoned_inner_node_is_not_a_resume_point_until_a_window_past_it():
    cache = make()
    tokens = list(range(16))
    fill(cache, tokens, states=[4, 6, 8, 12, 16])
    cache.evict_window(1, 2)  # least recently used first: the node 0..4 (an inner node)
    assert [cache.match_prefix(tokens[:k]).length for k in (4, 6, 8, 12, 16)] == [0, 0, 8, 12, 16]
    assert np.array_equal(cache.match_prefix(tokens).full.numpy() >= 0, np.ones(16, bool))
    cache.check_integrity()
