"""KV events of the radix cache: blocks are independent of pages; snapshots replay the tree."""

import random

import pytest

from mem_cache.allocator import KVAllocator
from mem_cache.events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    block_hashes,
    extend_block_hashes,
)
from mem_cache.radix_cache import RadixCache


def replay(events: list[KVEvent], blocks: dict[int, int | None] | None = None) -> dict:
    """Apply events to a router-like index: hash -> parent hash. Checks the event contract."""
    blocks = {} if blocks is None else blocks
    for event in events:
        if isinstance(event, AllCleared):
            blocks.clear()
        elif isinstance(event, BlockStored):
            assert event.parent is None or event.parent in blocks, "parent reported first"
            parent = event.parent
            for h in event.hashes:
                assert h not in blocks, "stored twice"
                blocks[h] = parent
                parent = h
        else:
            assert isinstance(event, BlockRemoved)
            for h in event.hashes:
                assert h in blocks, "removed twice"
                del blocks[h]
    return blocks


def test_extend_block_hashes_continues_block_hashes() -> None:
    rng = random.Random(0)
    for _ in range(200):
        block = rng.choice([1, 4, 16])
        tokens = [rng.randrange(50_000) for _ in range(rng.randrange(100))]
        cut = rng.randrange(len(tokens) + 1)
        head, state = extend_block_hashes(tokens[:cut], 0, 0, "ns", block)
        tail, _ = extend_block_hashes(tokens[cut:], cut, state, "ns", block)
        assert head + tail == block_hashes(tokens, "ns", block)


@pytest.mark.parametrize("page, block", [(1, 16), (4, 16), (16, 16), (64, 16), (16, 4)])
def test_events_and_snapshot_agree_with_the_cached_blocks(page: int, block: int) -> None:
    rng = random.Random(page * 31 + block)
    alloc = KVAllocator(64 * 64, page)
    cache = RadixCache(alloc, page_size=page, block_size=block)
    shared = [rng.randrange(1000) for _ in range(200)]
    index: dict[int, int | None] = {}
    for step in range(60):
        tokens = shared[: rng.randrange(200)] + [rng.randrange(3) for _ in range(rng.randrange(90))]
        n = len(tokens) // page * page
        if alloc.available_size() < n:
            cache.evict(n)
        slots = alloc.alloc(n)
        cached = cache.insert(tokens, slots)
        alloc.free(slots[:cached])
        if step % 7 == 0:
            cache.evict(rng.randrange(300))
        replay(cache.take_events(), index)
        assert replay(cache.snapshot_events()) == index
    cache.check_integrity()


def test_sibling_pages_sharing_a_block_report_it_once() -> None:
    # Pages of 64, blocks of 16: two prompts that agree on 20 tokens share block 0 but sit in
    # different nodes (they differ inside their first page).
    alloc = KVAllocator(512, 64)
    cache = RadixCache(alloc, page_size=64, block_size=16)
    a = list(range(64))
    b = list(range(20)) + [999] * 44
    for tokens in (a, b):
        cache.insert(tokens, alloc.alloc(64))
    stored = [h for e in cache.take_events() for h in e.hashes]
    assert len(stored) == len(set(stored)) == 4 + 3
    assert stored.count(block_hashes(a, None, 16)[0]) == 1
    cache.evict(64)
    removed = [h for e in cache.take_events() for h in e.hashes]
    assert block_hashes(a, None, 16)[0] not in removed  # still held by the other sibling
    cache.evict(64)
    removed += [h for e in cache.take_events() for h in e.hashes]
    assert sorted(removed) == sorted(stored)


def test_pure_index_emits_the_same_events() -> None:
    tokens = list(range(40))
    index = RadixCache(None, page_size=1, block_size=16)
    index.insert(tokens)
    assert index.take_events() == [BlockStored(block_hashes(tokens, None, 16), None)]
    assert index.evict(100) == 40
    assert index.take_events() == [BlockRemoved(block_hashes(tokens, None, 16))]
