"""The host KV tier of RadixCache: policies, demotion, load back, protection, events, copies.

KV content is checked for real: every slot's K holds a fingerprint of the token prefix it
caches, so a prefix that went device -> host -> device must come back with the same KV.
"""

import pytest
import torch

from mem_cache.allocator import KVAllocator
from mem_cache.events import HOST, BlockRemoved, BlockStored, block_hashes
from mem_cache.host_cache import HostKVPool, KVCopier, PoolCopier
from mem_cache.kv_pool import KVPool
from mem_cache.radix_cache import RadixCache


def fingerprint(tokens: list[int]) -> torch.Tensor:
    """A distinct value per prefix: what a model's KV of token i depends on (tokens[:i+1])."""
    out, acc = [], 0
    for i, t in enumerate(tokens):
        acc = (acc * 31 + t + 7 * i) % 1_000_003
        out.append(float(acc))
    return torch.tensor(out).view(-1, 1, 1)


class Tier:
    """A cache with a device pool, a host pool and a real (CPU, synchronous) copier."""

    def __init__(self, device: int = 32, host: int = 64, page: int = 1, policy: str =
                 "write_through", copier: KVCopier | None = None, block: int = 4) -> None:
        self.alloc = KVAllocator(device, page)
        self.host_alloc = KVAllocator(host, page)
        self.pool = KVPool(device, 1, 1, 1)
        self.host_pool = HostKVPool(host, 1, 1, 1, pin_memory=False)
        self.copier = copier or PoolCopier(self.pool, self.host_pool)
        self.cache = RadixCache(self.alloc, page, block, host_allocator=self.host_alloc,
                                write_policy=policy, copier=self.copier)

    def put(self, tokens: list[int]) -> int:
        n = len(tokens) // self.cache.page_size * self.cache.page_size
        if self.alloc.available_size() < n:
            self.cache.evict(n - self.alloc.available_size())
        slots = self.alloc.alloc(n)
        assert slots is not None
        self.pool.set_kv(0, slots, fingerprint(tokens[:n]), fingerprint(tokens[:n]))
        cached = self.cache.insert(tokens, slots)
        self.alloc.free(slots[:cached])
        return cached

    def kv_ok(self, tokens: list[int], indices: torch.Tensor) -> bool:
        k, _ = self.pool.get_kv(0, indices)
        return torch.equal(k, fingerprint(tokens[: len(indices)]))

    def check(self) -> None:
        self.cache.check_integrity()
        if not self.cache._writes:
            assert self.alloc.available_size() + self.cache.total_size() == self.alloc.size
            assert self.host_alloc.available_size() + self.cache.host_size() == self.host_alloc.size


class ManualCopier(PoolCopier):
    """Device->host copies stay in flight until `complete()`: the data moves only then."""

    def __init__(self, device_pool: KVPool, host_pool: HostKVPool) -> None:
        super().__init__(device_pool, host_pool)
        self.pending: list[list] = []  # [device_slots, host_slots, done]

    def to_host(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> object:
        ticket = [device_slots.clone(), host_slots.clone(), False]
        self.pending.append(ticket)
        return ticket

    def complete(self, count: int = 1) -> None:
        for ticket in [t for t in self.pending if not t[2]][:count]:
            PoolCopier.to_host(self, ticket[0], ticket[1])
            ticket[2] = True

    def done(self, ticket: object) -> bool:
        return ticket is None or bool(ticket[2])  # type: ignore[index]

    def wait(self, ticket: object) -> None:
        while ticket is not None and not ticket[2]:  # type: ignore[index]
            self.complete()


def manual_tier(**kw: object) -> Tier:
    tier = Tier(**kw)  # type: ignore[arg-type]
    tier.copier = ManualCopier(tier.pool, tier.host_pool)
    tier.cache.copier = tier.copier
    return tier


# --- the two real bugs of issue 8 ---------------------------------------------------------------


def test_host_protected_parent_survives_cascading_deletion_of_its_children() -> None:
    tier = Tier()
    tier.put([1, 2, 3, 4])
    tier.put([1, 2, 3, 4, 5, 6])
    tier.put([1, 2, 3, 4, 7, 8])
    tier.cache.evict(100)  # all three demoted to host
    assert tier.cache.total_size() == 0 and tier.cache.host_size() == 8
    parent = tier.cache.match_prefix([1, 2, 3, 4]).host_node
    assert parent is not None and len(parent) == 4
    tier.cache.protect_host(parent)
    assert tier.cache.evict_host(100) == 4  # both children go; the parent is pinned
    tier.check()
    assert parent.parent is not None and tier.cache.match_prefix([1, 2, 3, 4]).host_length == 4
    tier.cache.release_host(parent)
    assert tier.cache.evict_host(100) == 4 and tier.cache.host_size() == 0
    tier.check()


def test_leaf_split_at_an_eviction_boundary_is_offloaded_not_dropped() -> None:
    tier = Tier(policy="write_through")
    tokens = list(range(1, 13))
    tier.put(tokens)
    assert tier.cache.host_size() == 12  # written through on insert
    tier.cache.match_prefix(tokens[:8])  # splits the backed-up leaf at 8
    tier.cache.match_prefix(tokens[:4])  # and again at 4
    tier.check()
    assert tier.cache.evict(1) == 4  # the leaf [9..12] is demoted to host
    assert tier.cache.evict(100) == 8  # then its freshly split parents, not dropped
    tier.check()
    result = tier.cache.match_prefix(tokens)
    assert (result.length, result.host_length) == (0, 12)
    loaded = tier.cache.load_back(result)
    assert loaded.length == 12 and tier.kv_ok(tokens, loaded.indices)
    tier.check()


# --- policies ----------------------------------------------------------------------------------


def test_write_back_copies_only_when_the_device_evicts() -> None:
    tier = Tier(policy="write_back")
    tier.put([1, 2, 3, 4, 5, 6])
    assert tier.cache.host_size() == 0
    assert tier.cache.evict(6) == 6
    assert tier.cache.host_size() == 6 and tier.cache.total_size() == 0
    result = tier.cache.load_back(tier.cache.match_prefix([1, 2, 3, 4, 5, 6]))
    assert result.length == 6 and tier.kv_ok([1, 2, 3, 4, 5, 6], result.indices)
    tier.check()


def test_write_through_selective_copies_on_the_second_use() -> None:
    tier = Tier(policy="write_through_selective")
    tier.put([1, 2, 3, 4])
    assert tier.cache.host_size() == 0
    tier.cache.match_prefix([1, 2, 3, 4])
    assert tier.cache.host_size() == 4
    tier.put([9, 9])
    assert tier.cache.evict(100) == 6
    assert tier.cache.host_size() == 4  # [9, 9] was used once: dropped, not offloaded
    assert tier.cache.match_prefix([9, 9]).host_length == 0
    tier.check()


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError):
        RadixCache(KVAllocator(8), host_allocator=KVAllocator(8), write_policy="write_around")


# --- load back ---------------------------------------------------------------------------------


def test_load_back_is_all_or_nothing_and_keeps_the_device_prefix() -> None:
    tier = Tier(device=8, host=32)
    tier.put([1, 2, 3, 4, 5, 6, 7, 8])
    tier.cache.evict(4)  # [1..8] is one node: all of it goes to host
    tier.put([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12][:8])  # promote it back through insert
    assert tier.cache.total_size() == 8
    tier.cache.match_prefix([1, 2, 3, 4])  # split: [1..4] | [5..8]
    tier.cache.evict(4)  # [5..8] to host
    result = tier.cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert (result.length, result.host_length) == (4, 4)
    tier.cache.lock(result.node)
    blocker = tier.alloc.alloc(4)  # device full: nothing evictable, the load must fail whole
    assert tier.cache.load_back(result) is result
    tier.alloc.free(blocker)
    loaded = tier.cache.load_back(result)
    tier.cache.unlock(result.node)
    assert loaded.length == 8 and loaded.host_length == 0
    assert tier.kv_ok([1, 2, 3, 4, 5, 6, 7, 8], loaded.indices)
    tier.check()


def test_load_back_below_the_minimum_recomputes_instead() -> None:
    tier = Tier()
    tier.cache.load_back_min = 8
    tier.put([1, 2, 3, 4])
    tier.cache.evict(4)
    result = tier.cache.match_prefix([1, 2, 3, 4])
    assert tier.cache.load_back(result) is result


def test_release_host_below_zero_raises_and_changes_nothing() -> None:
    tier = Tier()
    tier.put([1, 2, 3, 4])
    node = tier.cache.match_prefix([1, 2, 3, 4]).node
    with pytest.raises(ValueError):
        tier.cache.release_host(node)
    assert node.host_ref == 0
    tier.cache.protect_host(node)
    tier.cache.release_host(node)
    with pytest.raises(ValueError):
        tier.cache.release_host(node)
    tier.check()


# --- copies in flight --------------------------------------------------------------------------


def test_a_node_being_copied_is_neither_evicted_nor_removed_until_the_copy_completes() -> None:
    tier = manual_tier()
    tier.put([1, 2, 3, 4])
    assert tier.cache.host_size() == 4 and tier.cache.protected_size() == 4  # in flight
    assert tier.cache.evict(100) == 0
    assert tier.cache.evict_host(100) == 0
    tier.check()
    stored = [e for e in tier.cache.take_events() if getattr(e, "medium", None) == HOST]
    assert stored == []  # host blocks are reported when the copy completes
    tier.cache.flush()
    assert tier.cache.protected_size() == 0
    stored = BlockStored(block_hashes([1, 2, 3, 4], None, 4), None, HOST)
    assert tier.cache.take_events() == [stored]
    assert tier.cache.evict(100) == 4 and tier.cache.host_size() == 4
    result = tier.cache.load_back(tier.cache.match_prefix([1, 2, 3, 4]))
    assert tier.kv_ok([1, 2, 3, 4], result.indices)
    tier.check()


def test_events_carry_the_tier() -> None:
    tier = Tier()
    tier.put([1, 2, 3, 4])
    tier.cache.take_events()
    tier.cache.evict(4)
    h = block_hashes([1, 2, 3, 4], None, 4)
    assert tier.cache.take_events() == [BlockRemoved(h)]  # device copy gone, host copy stays
    tier.cache.evict_host(4)
    assert tier.cache.take_events() == [BlockRemoved(h, HOST)]


def test_snapshot_lists_both_tiers() -> None:
    tier = Tier()
    tier.put([1, 2, 3, 4, 5, 6, 7, 8])
    tier.cache.match_prefix([1, 2, 3, 4])
    tier.cache.evict(4)
    snap = tier.cache.snapshot_events()
    device = [h for e in snap[1:] if e.medium != HOST for h in e.hashes]
    host = [h for e in snap[1:] if e.medium == HOST for h in e.hashes]
    assert device == block_hashes([1, 2, 3, 4], None, 4)
    assert host == block_hashes([1, 2, 3, 4, 5, 6, 7, 8], None, 4)


def test_without_a_host_tier_nothing_changes() -> None:
    cache = RadixCache(KVAllocator(16), 1, 4)
    cache.insert([1, 2, 3, 4], cache.allocator.alloc(4))
    cache.evict(4)
    result = cache.match_prefix([1, 2, 3, 4])
    assert (result.length, result.host_length, cache.host_size()) == (0, 0, 0)
    assert cache.load_back(result) is result and cache.evict_host(10) == 0
    cache.flush()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copy_stream_round_trip() -> None:
    pool = KVPool(64, 2, 2, 8, device="cuda")
    host = HostKVPool(64, 2, 2, 8)
    copier = PoolCopier(pool, host)
    slots = torch.arange(8, 24)
    data = torch.randn(16, 2, 8, device="cuda")
    for layer in range(2):
        pool.set_kv(layer, slots.cuda(), data, -data)
    ticket = copier.to_host(slots, torch.arange(40, 56))
    copier.wait(ticket)
    assert copier.done(ticket)
    copier.to_device(torch.arange(40, 56), torch.arange(0, 16))
    for layer in range(2):
        k, v = pool.get_kv(layer, torch.arange(0, 16).cuda())
        assert torch.equal(k, data) and torch.equal(v, -data)
