"""check_integrity() catches corruption: each test breaks a healthy tree one way on purpose."""

from collections.abc import Callable

import numpy as np
import pytest

from mem_cache.allocator import KVAllocator
from mem_cache.radix_cache import RadixCache
from mem_cache.radix_node import TreeNode


def healthy() -> tuple[RadixCache, KVAllocator, dict[str, TreeNode]]:
    """A tree with a branch, a lock and a split: root - A[1..4] - {B[5,6] (locked), C[7,8]}."""
    alloc = KVAllocator(64, 2)
    cache = RadixCache(alloc, page_size=2, block_size=2)
    for tokens in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8]):
        slots = alloc.alloc(6)
        cached = cache.insert(tokens, slots)
        alloc.free(slots[:cached])
    b = cache.match_prefix([1, 2, 3, 4, 5, 6]).node
    c = cache.match_prefix([1, 2, 3, 4, 7, 8]).node
    cache.lock(b)
    cache.check_integrity()
    return cache, alloc, {"A": b.parent, "B": b, "C": c}


def corrupt_evictable(cache: RadixCache, alloc: KVAllocator, n: dict) -> None:
    cache._evictable += 2


def corrupt_negative_lock(cache: RadixCache, alloc: KVAllocator, n: dict) -> None:
    n["C"].lock_ref = -1


def corrupt_child_above_parent(cache: RadixCache, alloc: KVAllocator, n: dict) -> None:
    n["A"].lock_ref = 0
    n["A"].locks_here = 0
    cache._protected -= 4
    cache._evictable += 4


def corrupt_root_lock(cache: RadixCache, alloc: KVAllocator, n: dict) -> None:
    cache.root.lock_ref = 1


def corrupt_lost_candidate(cache: RadixCache, alloc: KVAllocator, n: dict) -> None:
    n["C"].heap_seq = -1


def corrupt_root_candidate(cache: RadixCache, alloc: KVAllocator, n: dict) -> None:
    cache._seq += 1
    cache.root.heap_seq = cache._seq
    cache._heap.append((0, cache._seq, cache.root))


def corrupt_view_value(cache: RadixCache, alloc: KVAllocator, n: dict) -> None:
    n["C"].value = np.concatenate([n["C"].value, n["C"].value])[:1]


def corrupt_slot_also_free(cache: RadixCache, alloc: KVAllocator, n: dict) -> None:
    alloc.free_pages(n["C"].value.copy())


def corrupt_shared_slot(cache: RadixCache, alloc: KVAllocator, n: dict) -> None:
    n["C"].value = n["B"].value.copy()


def corrupt_free_twice(cache: RadixCache, alloc: KVAllocator, n: dict) -> None:
    alloc._free_pages[1] = alloc._free_pages[0]


def corrupt_unaligned_key(cache: RadixCache, alloc: KVAllocator, n: dict) -> None:
    n["C"].key = n["C"].key + np.int64(9).tobytes()


def corrupt_parent_pointer(cache: RadixCache, alloc: KVAllocator, n: dict) -> None:
    n["C"].parent = cache.root


def corrupt_block_hash(cache: RadixCache, alloc: KVAllocator, n: dict) -> None:
    n["C"].hashes = [n["C"].hashes[0] ^ 1]


def corrupt_lost_block(cache: RadixCache, alloc: KVAllocator, n: dict) -> None:
    n["C"].hashes = []


def corrupt_namespace(cache: RadixCache, alloc: KVAllocator, n: dict) -> None:
    n["C"].namespace = "tenant-b"


def corrupt_node_count(cache: RadixCache, alloc: KVAllocator, n: dict) -> None:
    cache._num_nodes += 1


def corrupt_start(cache: RadixCache, alloc: KVAllocator, n: dict) -> None:
    n["C"].start += 2


CASES: list[tuple[Callable, str]] = [
    (corrupt_evictable, "sizes"),
    (corrupt_negative_lock, "locks"),
    (corrupt_child_above_parent, "locks"),
    (corrupt_root_lock, "root"),
    (corrupt_lost_candidate, "eviction"),
    (corrupt_root_candidate, "eviction"),
    (corrupt_view_value, "values"),
    (corrupt_slot_also_free, "slots: a tree slot is also free"),
    (corrupt_shared_slot, "slots: a slot is owned by two nodes"),
    (corrupt_free_twice, "slots: a slot is free twice"),
    (corrupt_unaligned_key, "page alignment"),
    (corrupt_parent_pointer, "structure"),
    (corrupt_block_hash, "events"),
    (corrupt_lost_block, "events"),
    (corrupt_namespace, "namespaces"),
    (corrupt_node_count, "structure"),
    (corrupt_start, "structure"),
]


@pytest.mark.parametrize("corrupt, invariant", CASES, ids=[c.__name__ for c, _ in CASES])
def test_check_integrity_names_the_broken_invariant(corrupt: Callable, invariant: str) -> None:
    cache, alloc, nodes = healthy()
    corrupt(cache, alloc, nodes)
    with pytest.raises(AssertionError, match=f"^{invariant}"):
        cache.check_integrity()


def test_healthy_tree_passes_and_the_pure_index_too() -> None:
    healthy()[0].check_integrity()
    index = RadixCache(None, page_size=4, block_size=16)
    index.insert(list(range(40)))
    index.insert(list(range(20)) + [7] * 20)
    assert index.match_prefix(list(range(40))).length == 40
    assert index.total_size() == 60
    index.check_integrity()
    assert index.evict(100) == 60
    index.check_integrity()
