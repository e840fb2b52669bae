"""Integrity checks of the radix cache's host tier (part of `RadixCache.check_integrity`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mem_cache.allocator import pages_to_slots
from mem_cache.radix_node import TreeNode

if TYPE_CHECKING:
    from mem_cache.radix_cache import RadixCache


def check_host_tier(cache: RadixCache, nodes: list[TreeNode]) -> None:
    """Raise `AssertionError` naming the first violated host-tier invariant."""
    root = cache.root
    assert root.host_ref == 0 and root.host_value is None, "root: must stay off the host tier"
    for node in nodes:
        _check_host_node(cache, node)
    _check_host_heap(cache, nodes)
    _check_host_slots(cache, nodes)


def _check_host_node(cache: RadixCache, node: TreeNode) -> None:
    parent = node.parent
    assert parent is not None
    if parent is not cache.root:
        assert not (parent.evicted and not node.evicted), (
            "tiers: a node on device whose parent is not (device nodes must be prefix-closed)"
        )
        assert node.host_value is None or parent.host_value is not None, (
            "tiers: a node on host without its parent on host"
        )
    if node.evicted:
        assert node.host_value is not None and node.host_ready, (
            "tiers: a node is neither on device nor completely on host"
        )
        assert node.lock_ref == 0, "tiers: a node off the device is locked"
    assert node.host_ref >= 0 and node.host_here >= 0, "host refs: negative host reference count"
    below = sum(child.host_ref for child in node.children.values())
    assert node.host_ref == node.host_here + below, (
        "host refs: count != protections ending here + children's counts"
    )
    if node.host_value is not None:
        assert len(node.host_value) * cache.page_size == len(node), (
            "host values: page count != token count / page"
        )
        assert node.host_value.flags.owndata, "host values: must be a copy, never a view"
        if not node.host_ready:
            assert node.lock_ref > 0 and node.host_ref > 0, (
                "in flight: a node being copied to host is not pinned on both tiers"
            )
    else:
        assert not node.host_ready, "tiers: host copy marked ready without host pages"


def _check_host_heap(cache: RadixCache, nodes: list[TreeNode]) -> None:
    live = {seq: (access, node) for access, seq, node in cache._host_heap
            if node.host_heap_seq == seq}
    for node in nodes:
        if not node.evicted or node.children or node.host_ref:
            continue
        entry = live.get(node.host_heap_seq)
        assert entry is not None and entry[1] is node, (
            "host eviction: a host-only leaf is missing from the candidates"
        )
        assert entry[0] == node.last_access, "host eviction: candidate ranked by a stale use"


def _check_host_slots(cache: RadixCache, nodes: list[TreeNode]) -> None:
    allocator = cache.host_allocator
    assert allocator is not None
    values = [n.host_value for n in nodes if n.host_value is not None]
    pages = np.concatenate(values) if values else np.zeros(0, dtype=np.int64)
    assert len(pages) * cache.page_size == cache.host_size(), "host sizes: host_size drifted"
    assert len(np.unique(pages)) == len(pages), "host slots: a host page owned by two nodes"
    tree = pages_to_slots(pages, cache.page_size)
    assert not np.isin(tree, allocator.free_slot_ids()).any(), "host slots: a tree slot is free"
