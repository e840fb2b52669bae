"""Regression tests of the component radix cache, one per bug class that hybrid caches in
serving engines have had. Each fails on a cache without the guard it names."""

from __future__ import annotations

import numpy as np
import pytest

from mem_cache.allocator import KVAllocator
from mem_cache.events import RECURRENT, SLIDING_WINDOW, KVGroup
from mem_cache.hybrid_cache import HybridRadixCache

from .hybrid_harness import Harness


def window_cache(window=4, size=64, page=1, host=None, policy="write_through"):
    groups = [KVGroup(0), KVGroup(1, SLIDING_WINDOW, window)]
    allocs = [KVAllocator(size, page), KVAllocator(size, page)]
    hosts = None if host is None else [KVAllocator(host, page), KVAllocator(host, page)]
    return HybridRadixCache(groups, allocs, page, 2, hosts, policy)


def put(cache, tokens, start=0):
    """Insert `tokens` with fresh slots for every token past `start` (the tree's before)."""
    full_alloc, win_alloc = cache.allocators[0], cache.allocators[1]
    m = cache.match_prefix(tokens[:start])
    assert m.length == start
    n = len(tokens) - start
    res = cache.insert(tokens, np.concatenate([m.full.numpy(), full_alloc.alloc(n).numpy()]),
                       {1: (start, win_alloc.alloc(n))})
    assert not len(res.unused_full) and not len(res.unused_windows[1])
    return res.node


def test_split_whose_upper_half_no_window_lock_reaches_moves_it_to_evictable():
    """Window mode: a lock protects only the W tokens before its end. A split far from the end
    must move the upper half's window tokens from protected to evictable; a cache that gives
    both halves the node's protection (as the full-KV lock count is given) counts tokens as
    protected that eviction then tombstones, and its evictable size goes negative."""
    cache = window_cache(window=4)
    tokens = list(range(10))
    node = put(cache, tokens)
    cache.lock(node)
    assert (cache.evictable_size(1), cache.protected_size(1)) == (0, 10)
    cache.match_prefix(tokens[:3] + [99])  # splits the node after 3 tokens
    cache.check_integrity()
    assert (cache.evictable_size(1), cache.protected_size(1)) == (3, 7)
    assert cache.evict_window(1, 100) == 3  # the upper half is tombstoned, the rest is locked
    assert (cache.evictable_size(1), cache.protected_size(1)) == (0, 7)
    cache.check_integrity()
    assert cache.match_prefix(tokens).length == 10  # the window before 10 is intact
    assert cache.match_prefix(tokens[:3]).length == 0  # cut back: tombstone
    cache.unlock(node)
    assert (cache.evictable_size(1), cache.protected_size(1)) == (7, 0)
    cache.check_integrity()


def test_misses_leave_the_roots_counts_unchanged():
    """Locking the match of a miss (the root) must change nothing, in any component; a root
    whose counts drift up on every miss is never evictable and breaks reset()."""
    h = Harness(windows=(2,), recurrent=True, page=1, block=1)
    cache = h.cache
    for tokens in ([], [5], [5, 6, 7]):
        m = cache.match_prefix(tokens)
        assert m.node is cache.root and m.length == 0
        cache.lock(m.node)
        cache.check_integrity()
        cache.unlock(m.node)
    # a full-KV hit cut back to a miss (no state saved on the path) also returns the root
    req = h.start([1, 2, 3])
    h.insert(req, 3)
    h.abort(req)
    assert cache.evict_states(10) == 1
    m = cache.match_prefix([1, 2, 3])
    assert m.full_length == 3 and m.length == 0 and m.node is cache.root
    cache.lock(m.node)
    cache.unlock(m.node)
    root = cache.root
    assert (root.lock_ref, root.locks_here, root.wlocks) == (0, 0, {})
    h.check()
    cache.evict(100)
    cache.reset()  # refused if the root looked locked
    h.check()


def test_states_of_a_request_paused_then_aborted_mid_prefill_all_come_back():
    """Recurrent states: a state given for a position whose node already has one, or for a
    position that is not a node end (not page-aligned), is not taken and must come back to the
    caller as unused; a paused request that is then aborted frees its working state and every
    checkpoint the tree did not take. A cache that drops them silently leaks state slots."""
    groups = [KVGroup(0), KVGroup(1, RECURRENT)]
    full, states = KVAllocator(32, 2), KVAllocator(6, 1)
    cache = HybridRadixCache(groups, [full, states], page_size=2, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6]
    first = states.alloc(1).tolist()
    res = cache.insert(tokens[:4], full.alloc(4), states={4: first[0]})
    assert res.unused_states == []
    # A second request prefills the same tokens: paused after its first chunk, it inserts the
    # chunk with its own checkpoint at 4 (a duplicate) and one at 3 (not a page end).
    m = cache.match_prefix([9, 9])
    assert m.length == 0
    working, dup, odd = states.alloc(3).tolist()
    own = full.alloc(4)
    chunk = cache.insert(tokens[:4], own, states={4: dup, 3: odd})
    assert sorted(chunk.unused_states) == sorted([dup, odd])
    assert sorted(chunk.unused_full.tolist()) == sorted(own.tolist())
    cache.lock(chunk.node)
    full.free(chunk.unused_full)
    states.free(chunk.unused_states)
    cache.check_integrity()
    # aborted mid-prefill: its lock and its working state go back
    cache.unlock(chunk.node)
    states.free([working])
    cache.check_integrity()
    assert states.available_size() + cache.total_size(1) == states.size
    assert cache.evict_states(10) == 1
    assert states.available_size() == states.size
    cache.check_integrity()


def test_the_tombstone_cascade_demotes_a_host_referenced_node_instead_of_deleting_it():
    """A window leaf evicted takes tombstoned parents with it (no device leaf is a tombstone).
    A parent the host tier references (protect_host, a load back in progress) must survive:
    demoted to its host copy, still in the tree; a cascade that deletes it leaves the host tier
    holding a reference to a node that is gone."""
    cache = window_cache(window=2, host=64)
    a = list(range(6))
    x = put(cache, a)
    y = put(cache, a + [6, 7, 8, 9], start=6)
    assert x.host_ready and y.host_ready  # write-through
    cache.protect_host(x)
    assert cache.evict_window(1, 6) == 6  # x is inner: tombstoned
    assert x.windows[0] is None and not x.evicted
    cache.check_integrity()
    cache.evict_window(1, 4)  # y is a leaf: off the device, and x would be a tombstone leaf
    assert y.evicted and x.evicted and x.parent is cache.root, "x must stay, on host"
    cache.check_integrity()
    m = cache.match_prefix(a + [6, 7, 8, 9])
    assert m.length == 0 and m.host_node is y and m.host_length == 10
    cache.release_host(x)
    loaded = cache.load_back(m)
    assert loaded.length == 10 and loaded.node is y
    cache.check_integrity()


def test_a_split_parent_keeps_its_host_copy_under_write_through():
    """Under write-through, a split must give the new upper half its share of the host copy;
    otherwise its eviction drops it instead of demoting it, and its child's copy is orphaned
    (dropped instead of offloaded)."""
    h = Harness(windows=(4,), page=2, block=2, device=32, host=64)
    cache = h.cache
    tokens = list(range(8))
    req = h.start(tokens)
    h.finish(req)
    node = cache.match_prefix(tokens).node
    assert node.host_ready
    cache.match_prefix(tokens[:4] + [50, 51])  # splits after 4
    upper = node.parent
    assert upper is not cache.root and upper.host_ready and upper.host_value is not None
    h.check()
    cache.evict(100)
    assert node.evicted and upper.evicted and node.parent is upper  # offloaded, not dropped
    h.check()
    req = h.start(tokens, load=True)  # the whole prompt comes back from host
    assert req.done == 8
    h.abort(req)
    h.check()


@pytest.mark.parametrize("page", [1, 2])
def test_insert_refills_a_tombstone_the_request_covers(page):
    """A request that recomputed tokens whose window KV the tree had evicted gives it back: the
    tombstone is refilled (split where the request's window KV starts) and matches resume
    past it again."""
    cache = window_cache(window=4, page=page)
    tokens = list(range(12))
    node = put(cache, tokens)
    put(cache, tokens + [20, 21], start=12)  # node becomes inner
    cache.evict_window(1, 12)
    assert node.windows[0] is None
    assert cache.match_prefix(tokens).length == 0
    full_alloc, win_alloc = cache.allocators
    m = cache.match_prefix(tokens[:0])
    ids = win_alloc.alloc(6)  # the request kept the window KV of tokens 6..12
    res = cache.insert(tokens, np.concatenate([full_alloc.alloc(12).numpy()]), {1: (6, ids)})
    full_alloc.free(res.unused_full)
    win_alloc.free(res.unused_windows[1])
    assert len(res.unused_windows[1]) == 0
    cache.check_integrity()
    assert m.length == 0 and cache.match_prefix(tokens).length == 12


def test_a_locked_tombstone_survives_the_cascade_and_goes_when_unlocked():
    """An insert that ends at an inner tombstoned node (the request has no window KV there)
    returns that node, and the engine locks it. Evicting its children must not remove it (its
    full KV is in use); it is removed once unlocked, as no device leaf may be a tombstone."""
    cache = window_cache(window=2)
    a = list(range(6))
    x = put(cache, a)
    put(cache, a + [6, 7, 8, 9], start=6)
    cache.evict_window(1, 6)  # x (inner) becomes a tombstone
    full_alloc, _ = cache.allocators
    res = cache.insert(a, cache.slots(x))  # no window KV: x stays a tombstone
    assert res.node is x and x.windows[0] is None and not len(res.unused_full)
    cache.lock(x)
    cache.evict(100)  # the child goes; x is now a locked tombstone leaf
    assert x.parent is cache.root and not x.evicted
    cache.check_integrity()
    cache.unlock(x)
    assert x.parent is None, "unlocked, the tombstone leaf is removed"
    assert full_alloc.available_size() == full_alloc.size
    cache.check_integrity()


def test_insert_over_a_host_only_node_splits_it_where_the_window_kv_starts():
    """An insert that brings a host-only node back to device with the request's KV gives it the
    window KV the request has; a node that the request covers only in part is split there, so
    that the device does not gain a tombstoned leaf."""
    cache = window_cache(window=2, host=64, page=2)
    tokens = list(range(8))
    put(cache, tokens)
    cache.evict(100)
    node = cache.match_prefix(tokens).host_node
    assert node is not None and node.evicted and len(node) == 8
    full_alloc, win_alloc = cache.allocators
    res = cache.insert(tokens, full_alloc.alloc(8), {1: (4, win_alloc.alloc(4))})
    assert res.node is node and not node.evicted and node.windows[0] is not None
    assert node.start == 4 and node.parent.windows[0] is None  # the split: a tombstone above
    assert not len(res.unused_full) and not len(res.unused_windows[1])
    cache.check_integrity()
    assert cache.match_prefix(tokens).length == 8
