"""Hypothesis state machine over the host tier: insert / match / lock / unlock / protect /
release / evict device / evict host / load back / copy completion / flush / reset.

After every step: `check_integrity()`, slot conservation on both tiers, the replayed KV events
of each medium equal the blocks that tier holds, and every slot a match or load back returns
holds the KV of exactly that token prefix (copies move real data, completing only when told).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from mem_cache.events import HOST, AllCleared, BlockStored
from mem_cache.radix_node import TreeNode

from .test_radix_host_tier import ManualCopier, Tier, fingerprint


def tier_blocks(tier: Tier) -> tuple[set[int], set[int]]:
    """Block hashes on device and on host, read off the tree (not off the ledgers)."""
    device, host = set(), set()
    stack = list(tier.cache.root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if not node.evicted:
            device.update(node.hashes)
        if node.host_ready:
            host.update(node.hashes)
    return device, host


class HostMachine(RuleBasedStateMachine):
    policy = "write_through"
    steps = 0
    seen_paths: Counter = Counter()  # what the examples exercised, summed over a run

    def __init__(self) -> None:
        super().__init__()
        self.tier = Tier(device=12, host=64, page=2, policy=self.policy, block=2)
        self.inserted: list[list[int]] = []  # earlier prompts: matches that revisit them hit
        self.copier = ManualCopier(self.tier.pool, self.tier.host_pool)
        self.tier.copier = self.copier
        self.tier.cache.copier = self.copier
        self.locks: list[TreeNode] = []
        self.protected: list[TreeNode] = []
        self.seen = {"device": set(), HOST: set()}

    tokens = st.lists(st.integers(0, 1), max_size=12)

    # One rule draws the operation, so hypothesis's preference for simple data cannot starve
    # the operations that need earlier state (a weighted mix, like an engine's traffic).
    OPS = ("insert",) * 4 + ("revisit",) * 3 + ("match",) * 2 + (
        "unlock", "release", "evict_device", "evict_device", "evict_host", "complete_copies",
        "complete_copies", "flush", "reset")

    @rule(op=st.sampled_from(OPS), tokens=tokens, num=st.sampled_from([0, 1, 2, 4, 8, 100]),
          flags=st.tuples(st.booleans(), st.booleans(), st.booleans()), data=st.data())
    def step(self, op: str, tokens: list[int], num: int, flags: tuple, data: st.DataObject) -> None:
        lock, protect, load = flags
        if op == "insert":
            self.insert(tokens)
        elif op == "revisit":
            self.revisit(data, lock, protect, load)
        elif op == "match":
            self.match(tokens, lock, protect, load)
        elif op in ("unlock", "release"):
            getattr(self, op)(data)
        elif op in ("evict_device", "evict_host"):
            getattr(self, op)(num)
        elif op == "complete_copies":
            self.complete_copies(1 + num % 3)
        else:
            getattr(self, op)()

    def insert(self, tokens: list[int]) -> None:
        n = len(tokens) // 2 * 2
        if self.tier.alloc.available_size() < n:
            self.tier.cache.evict(n - self.tier.alloc.available_size())
        if self.tier.alloc.available_size() >= n:
            self.tier.put(tokens)
            self.inserted.append(tokens)
            self.seen_paths["insert"] += 1

    def revisit(self, data: st.DataObject, lock: bool, protect: bool, load: bool) -> None:
        if self.inserted:
            self.match(data.draw(st.sampled_from(self.inserted)), lock, protect, load)

    def match(self, tokens: list[int], lock: bool, protect: bool, load: bool) -> None:
        result = self.tier.cache.match_prefix(tokens)
        assert self.tier.kv_ok(tokens, result.indices)
        self.seen_paths["host hit"] += bool(result.host_length)
        if load and result.host_length:
            loaded = self.tier.cache.load_back(result)
            self.seen_paths["loaded back"] += loaded is not result
            assert loaded.length in (result.length, result.length + result.host_length)
            assert self.tier.kv_ok(tokens, loaded.indices)
            result = loaded
        if lock and result.length and len(self.locks) < 2:  # leave room to make progress
            self.tier.cache.lock(result.node)
            self.locks.append(result.node)
        if protect and result.host_node is not None and len(self.protected) < 2:
            self.tier.cache.protect_host(result.host_node)
            self.protected.append(result.host_node)

    def unlock(self, data: st.DataObject) -> None:
        if self.locks:
            self.tier.cache.unlock(self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1))))

    def release(self, data: st.DataObject) -> None:
        if self.protected:
            i = data.draw(st.integers(0, len(self.protected) - 1))
            self.tier.cache.release_host(self.protected.pop(i))

    def evict_device(self, num: int) -> None:
        evictable = self.tier.cache.evictable_size()
        freed = self.tier.cache.evict(num)
        assert freed >= min(num, evictable)
        self.seen_paths["device evicted"] += bool(freed)

    def evict_host(self, num: int) -> None:
        before = self.tier.cache.host_size()
        freed = self.tier.cache.evict_host(num)
        assert self.tier.cache.host_size() == before - freed
        self.seen_paths["host evicted"] += bool(freed)
        assert all(node.parent is not None for node in self.protected), "a pinned node went"

    def complete_copies(self, count: int) -> None:
        self.copier.complete(count)

    def flush(self) -> None:
        self.tier.cache.flush()
        assert not self.tier.cache._writes

    def reset(self) -> None:
        if self.locks or self.protected:
            with pytest.raises(ValueError):
                self.tier.cache.reset()
        else:
            self.tier.cache.reset()

    @invariant()
    def consistent(self) -> None:
        type(self).steps += 1
        self.tier.check()
        device = self.tier.alloc
        assert device.available_size() + self.tier.cache.total_size() == device.size
        host = self.tier.host_alloc
        assert host.available_size() + self.tier.cache.host_size() == host.size
        for event in self.tier.cache.take_events():
            if isinstance(event, AllCleared):
                for blocks in self.seen.values():
                    blocks.clear()
                continue
            blocks = self.seen[event.medium]
            if isinstance(event, BlockStored):
                assert not blocks & set(event.hashes), "stored twice"
                blocks.update(event.hashes)
            else:
                assert set(event.hashes) <= blocks, "removed twice"
                blocks.difference_update(event.hashes)
        device, host_blocks = tier_blocks(self.tier)
        assert self.seen["device"] == device and self.seen[HOST] == host_blocks


class WriteThroughMachine(HostMachine):
    policy = "write_through"


class SelectiveMachine(HostMachine):
    policy = "write_through_selective"


class WriteBackMachine(HostMachine):
    policy = "write_back"


@pytest.mark.parametrize("machine", [WriteThroughMachine, SelectiveMachine, WriteBackMachine])
def test_host_tier_against_its_invariants(machine: type[HostMachine]) -> None:
    machine.steps = 0
    machine.seen_paths = Counter()
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=40,
            stateful_step_count=60,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        ),
    )
    assert machine.steps >= 1200
    assert all(machine.seen_paths[k] >= 3 for k in (
        "insert", "host hit", "loaded back", "host evicted", "device evicted")), machine.seen_paths


def test_fingerprints_differ_by_prefix() -> None:
    assert not torch.equal(fingerprint([1, 2]), fingerprint([2, 2]))
    assert torch.equal(fingerprint([1, 2, 3])[:2], fingerprint([1, 2]))
