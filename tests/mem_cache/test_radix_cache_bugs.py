"""One regression test per invariant (docs/mem_cache.md), each the scenario of a real bug.

Every test ends with `check_integrity()` and, where an allocator is involved, slot
conservation (`available + total_size == size` plus whatever the test itself still holds).
"""

import pytest
import torch

from mem_cache.allocator import KVAllocator
from mem_cache.events import AllCleared, BlockRemoved, BlockStored, block_hashes
from mem_cache.radix_cache import RadixCache


def make(size: int = 256, page: int = 1, block: int = 4) -> tuple[RadixCache, KVAllocator]:
    alloc = KVAllocator(size, page)
    return RadixCache(alloc, page_size=page, block_size=block), alloc


def put(cache: RadixCache, alloc: KVAllocator, tokens: list[int], ns: str | None = None) -> int:
    """What an engine does when a request finishes: insert, then free the duplicates."""
    n = len(tokens) // cache.page_size * cache.page_size
    slots = alloc.alloc(n)
    assert slots is not None
    cached = cache.insert(tokens, slots, namespace=ns)
    alloc.free(slots[:cached])
    return cached


def conserved(cache: RadixCache, alloc: KVAllocator, held: int = 0) -> None:
    cache.check_integrity()
    assert alloc.available_size() + cache.total_size() + held == alloc.size


# --- invariant 1: evictable + protected == total, none negative --------------------------------


def test_leaf_gaining_first_child_keeps_sizes_balanced() -> None:
    # SGLang once counted only leaves as evictable: a leaf that gained a child drove
    # evictable_size negative when both were later evicted.
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [1, 2, 3, 4, 5, 6])  # the leaf [1..4] gains its first child
    assert cache.evictable_size() == cache.total_size() == 6
    node = cache.match_prefix([1, 2, 3, 4, 5, 6]).node
    cache.lock(node)
    assert (cache.evictable_size(), cache.protected_size()) == (0, 6)
    cache.unlock(node)
    assert cache.evict(100) == 6
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (0, 0, 0)
    conserved(cache, alloc)


# --- invariant 3: lock counts --------------------------------------------------------------------


def test_unlock_without_lock_raises_and_changes_nothing() -> None:
    # Unmatched unlocks drove lock counts below zero and let locked KV be evicted.
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4, 5, 6])
    node = cache.match_prefix([1, 2, 3, 4, 5, 6]).node
    with pytest.raises(ValueError):
        cache.unlock(node)
    assert node.lock_ref == 0 and cache.evictable_size() == 6 and cache.protected_size() == 0
    cache.lock(node)
    cache.unlock(node)
    with pytest.raises(ValueError):
        cache.unlock(node)
    conserved(cache, alloc)


def test_unlock_of_an_ancestor_of_a_lock_is_refused() -> None:
    # Releasing a descendant's lock through its ancestor would leave the child counted above
    # its parent: the lock was taken at the child and must be released there.
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [1, 2, 3, 4, 5, 6])
    child = cache.match_prefix([1, 2, 3, 4, 5, 6]).node
    parent = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(child)
    with pytest.raises(ValueError):
        cache.unlock(parent)
    assert parent.lock_ref == 1 and child.lock_ref == 1
    cache.unlock(child)
    conserved(cache, alloc)


def test_miss_leaves_every_lock_count_unchanged() -> None:
    # The root's reference count drifted up by one on every cache miss.
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    locked = cache.match_prefix([1, 2, 3]).node
    cache.lock(locked)
    for _ in range(10):
        miss = cache.match_prefix([9, 9, 9])
        assert miss.length == 0 and miss.node is cache.root and len(miss.indices) == 0
        cache.lock(miss.node)
        cache.unlock(miss.node)
        cache.unlock(miss.node)  # the root: always a no-op
    assert cache.root.lock_ref == 0 and locked.lock_ref == 1
    assert cache.protected_size() == 3
    cache.unlock(locked)
    conserved(cache, alloc)


def test_split_under_a_lock_keeps_the_lock_on_both_halves() -> None:
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4, 5, 6, 7, 8])
    whole = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).node
    cache.lock(whole)
    half = cache.match_prefix([1, 2, 3, 4]).node  # splits the locked node
    assert half is not whole and whole.parent is half
    assert half.lock_ref == 1 and whole.lock_ref == 1
    assert cache.protected_size() == 8 and cache.evictable_size() == 0
    assert cache.evict(100) == 0
    cache.unlock(whole)  # the old handle still denotes the whole path
    assert cache.protected_size() == 0 and cache.evictable_size() == 8
    conserved(cache, alloc)


def test_node_handle_survives_splits_and_keeps_its_path_end() -> None:
    cache, alloc = make(page=4, block=4)
    tokens = list(range(32))
    put(cache, alloc, tokens)
    handle = cache.match_prefix(tokens).node
    for cut in (8, 24, 16):
        cache.match_prefix(tokens[:cut])
    assert handle.end == 32 and handle.parent is not cache.root
    cache.lock(handle)
    assert cache.protected_size() == 32
    cache.unlock(handle)
    conserved(cache, alloc)


# --- invariant 4: only unlocked leaves are evicted ---------------------------------------------


def test_evicting_an_empty_tree_frees_nothing() -> None:
    cache, alloc = make()
    assert cache.evict(10) == 0 and cache.evict(0) == 0 and cache.evict(-5) == 0
    put(cache, alloc, [1, 2])
    assert cache.evict(0) == 0 and cache.evict(-1) == 0
    assert cache.total_size() == 2
    conserved(cache, alloc)


def test_eviction_cascades_to_parents_and_stops_at_locked_paths() -> None:
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4, 5, 6])
    put(cache, alloc, [1, 2, 3, 4, 7, 8])
    locked = cache.match_prefix([1, 2, 3, 4, 5, 6]).node
    cache.lock(locked)
    assert cache.evict(100) == 2  # only [7, 8]: [1..4] is on the locked path
    assert cache.match_prefix([1, 2, 3, 4, 7, 8]).length == 4
    cache.unlock(locked)
    assert cache.evict(100) == 6  # [5, 6], then its parent [1..4] became an unlocked leaf
    assert cache.total_size() == 0
    conserved(cache, alloc)


def test_eviction_is_lru_and_a_parent_competes_with_its_own_last_use() -> None:
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4])  # parent P, used at t1
    put(cache, alloc, [1, 2, 3, 4, 5, 6])  # child C, and P again, at t2
    put(cache, alloc, [7, 8])  # D at t3
    cache.match_prefix([9])  # a miss touches nothing
    assert cache.evict(1) == 2  # C is the oldest leaf
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).length == 4  # touches P: now newer than D
    assert cache.evict(1) == 2 and cache.match_prefix([7, 8]).length == 0
    assert cache.evict(1) == 4 and cache.total_size() == 0
    conserved(cache, alloc)


def test_evict_stops_once_enough_is_freed() -> None:
    cache, alloc = make()
    for first in range(5):
        put(cache, alloc, [10 + first, 1, 2])
    assert cache.evict(4) == 6  # two leaves of 3: the first alone is not enough
    assert cache.total_size() == 9
    conserved(cache, alloc)


# --- invariant 2 and 5: slot ownership, page alignment, copies ---------------------------------


@pytest.mark.parametrize("page", [4, 16, 64])
def test_page_aligned_insert_leaves_the_tail_to_the_caller(page: int) -> None:
    cache, alloc = make(size=8 * page, page=page, block=16)
    tokens = list(range(2 * page + page // 2))  # two pages and a partial one
    slots = alloc.alloc(3 * page)
    assert cache.insert(tokens, slots) == 0
    assert cache.total_size() == 2 * page
    assert torch.equal(cache.match_prefix(tokens).indices, slots[: 2 * page])
    conserved(cache, alloc, held=page)  # the tail page is still the caller's
    alloc.free(slots[2 * page :])
    # The same prefix again: the caller gets the count of duplicates it must free.
    again = alloc.alloc(3 * page)
    assert cache.insert(tokens, again) == 2 * page
    alloc.free(again)
    conserved(cache, alloc)
    assert cache.match_prefix(tokens[: page - 1]).length == 0  # less than a page: a miss


def test_aborted_prefill_leaks_nothing() -> None:
    # A request aborted mid-prefill must give back its own slots and its lock.
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4])
    match = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    cache.lock(match.node)
    own = alloc.alloc(4)  # slots for [5..8], being prefilled when the abort comes
    conserved(cache, alloc, held=4)
    alloc.free(own)
    cache.unlock(match.node)
    assert cache.protected_size() == 0
    conserved(cache, alloc)


def test_shorter_next_turn_leaves_the_longer_tail_with_its_owner() -> None:
    # A session held KV for prompt+output; the next turn's prompt matched only part of it.
    # Whatever the tree did not take stays the caller's to free: it must not vanish.
    cache, alloc = make(page=4, block=4)
    turn1 = list(range(14))
    slots = alloc.alloc(16)
    cached = cache.insert(turn1, slots)
    assert cached == 0 and cache.total_size() == 12
    tail = slots[12:]
    turn2 = turn1[:6] + [99, 98, 97]
    assert cache.match_prefix(turn2).length == 4
    conserved(cache, alloc, held=len(tail))
    alloc.free(tail)
    conserved(cache, alloc)


def test_tree_values_are_copies_not_views() -> None:
    cache, alloc = make()
    slots = alloc.alloc(4)
    expected = slots.clone()
    cache.insert([1, 2, 3, 4], slots)
    slots.fill_(0)  # the caller reuses its buffer
    assert torch.equal(cache.match_prefix([1, 2, 3, 4]).indices, expected)
    got = cache.match_prefix([1, 2, 3, 4]).indices
    got.fill_(7)
    assert torch.equal(cache.match_prefix([1, 2, 3, 4]).indices, expected)
    conserved(cache, alloc)


def test_freeing_slots_the_tree_owns_is_caught() -> None:
    # The caller freed all its slots instead of only the duplicates: a double owner.
    cache, alloc = make()
    slots = alloc.alloc(4)
    cache.insert([1, 2, 3, 4], slots)
    alloc.free(slots)
    with pytest.raises(AssertionError, match="slots"):
        cache.check_integrity()
    with pytest.raises(ValueError, match="already free"):
        cache.evict(4)  # evicting would free them a second time; the allocator refuses


def test_insert_needs_enough_indices() -> None:
    cache, alloc = make()
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], alloc.alloc(2))
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], None)


# --- namespaces ----------------------------------------------------------------------------------


def test_namespaces_never_share_nodes_or_blocks() -> None:
    cache, alloc = make(block=2)
    tokens = [1, 2, 3, 4]
    assert put(cache, alloc, tokens, ns="lora-a") == 0
    assert put(cache, alloc, tokens, ns="lora-b") == 0
    assert put(cache, alloc, tokens) == 0
    assert cache.total_size() == 12
    assert cache.match_prefix(tokens, namespace="lora-c").length == 0
    a = cache.match_prefix(tokens, namespace="lora-a")
    b = cache.match_prefix(tokens, namespace="lora-b")
    assert a.length == b.length == 4 and a.node is not b.node
    assert set(a.indices.tolist()).isdisjoint(b.indices.tolist())
    stored = [h for e in cache.take_events() if isinstance(e, BlockStored) for h in e.hashes]
    assert len(stored) == len(set(stored)) == 6
    assert set(block_hashes(tokens, "lora-a", 2)) <= set(stored)
    cache.lock(a.node)
    assert cache.evict(100) == 8 and cache.match_prefix(tokens, namespace="lora-a").length == 4
    cache.unlock(a.node)
    conserved(cache, alloc)


# --- invariant 6: events -------------------------------------------------------------------------


def test_a_split_reports_nothing_and_eviction_removes_each_block_once() -> None:
    cache, alloc = make(block=4)
    tokens = list(range(16))
    put(cache, alloc, tokens)
    events = cache.take_events()
    assert events == [BlockStored(block_hashes(tokens, None, 4), None)]
    for cut in (8, 4, 12):
        cache.match_prefix(tokens[:cut])
    assert cache.take_events() == []
    put(cache, alloc, tokens[:8] + [50, 51, 52, 53, 54])
    (stored,) = cache.take_events()
    branch = block_hashes(tokens[:8] + [50, 51, 52, 53], None, 4)
    assert stored == BlockStored(branch[2:], branch[1])
    cache.evict(1000)
    removed = [h for e in cache.take_events() if isinstance(e, BlockRemoved) for h in e.hashes]
    assert sorted(removed) == sorted(set(block_hashes(tokens, None, 4)) | {branch[2]})
    conserved(cache, alloc)


def test_reset_frees_everything_and_emits_one_clear() -> None:
    cache, alloc = make()
    put(cache, alloc, list(range(10)))
    node = cache.match_prefix(list(range(10))).node
    cache.lock(node)
    with pytest.raises(ValueError):
        cache.reset()
    cache.unlock(node)
    cache.take_events()
    cache.reset()
    assert cache.take_events() == [AllCleared()]
    assert cache.total_size() == 0 and alloc.available_size() == alloc.size
    with pytest.raises(ValueError):
        cache.lock(node)  # a handle from before the reset is dead
    conserved(cache, alloc)
