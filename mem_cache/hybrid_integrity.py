"""`HybridRadixCache.check_integrity()`: every component's invariants, each re-derived from a
full walk of the tree (for tests and idle-time self-checks, never for the request path).

Messages start with the invariant's name. The structure, full-KV locks and block hashes are the
plain tree's checks (`radix_integrity.check_nodes`); on top of them:

- sizes, per component: evictable + protected == total, none negative, each equal to what the
  tree holds on the side of its locks (tokens; states for the recurrent group);
- slots, per allocator: the tree's pages (window pages, state slots) unique and not free;
- window locks: each node's lock ends are exactly the locks whose widest window reaches it;
- the root holds nothing and counts nothing (a miss must not change it);
- tombstones: no device leaf is a tombstone unless pinned (locked, or referenced on host);
- states: at most one per node, none off the device;
- eviction candidates: every evictable component of a node is in its LRU, ranked by last use;
- events: per group and medium, the ledger's block holders equal the tree's;
- the host tier's own invariants (`hybrid_host.HybridHostTier.check`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mem_cache.hybrid_host import block_counts
from mem_cache.hybrid_node import NO_STATE, HybridNode
from mem_cache.radix_integrity import check_nodes

# The cache that owns the tier / is checked (`hybrid_cache.HybridRadixCache`, which imports this
# module: named here without an import, so that the package has no import cycle).
HybridRadixCache = Any


def check_hybrid(cache: HybridRadixCache) -> None:
    root = cache.root
    assert root.locks_here == 0 and not root.wlocks and root.state == NO_STATE, (
        "root: must hold no lock, window lock or state (a miss must not count it)"
    )
    nodes: list[HybridNode] = check_nodes(  # type: ignore[assignment]
        root, cache.num_nodes(), cache.page_size, cache.block_size, True
    )
    _check_components(cache, nodes)
    _check_window_locks(cache, nodes)
    _check_sizes(cache, nodes)
    _check_slots(cache, nodes)
    _check_heaps(cache, nodes)
    for c in range(len(cache.groups)):
        cache.ledgers[c].check_counts(block_counts(cache, nodes, c, cache.holds))
    cache.host.check(nodes)


def _check_components(cache: HybridRadixCache, nodes: list[HybridNode]) -> None:
    for node in nodes:
        if node.evicted:
            assert all(w is None for w in node.windows) and node.state == NO_STATE, (
                "tiers: a node off the device still holds window pages or a state"
            )
            continue
        for pages in node.windows:
            if pages is not None:
                assert len(pages) * cache.page_size == len(node), (
                    "values: window page count != token count / page"
                )
                assert pages.dtype == np.int64 and pages.flags.owndata, (
                    "values: window pages must be an int64 copy"
                )
        if cache.recurrent is None:
            assert node.state == NO_STATE, "states: a state without a recurrent group"
        device_leaf = all(child.evicted for child in node.children.values())
        if device_leaf and any(w is None for w in node.windows):
            assert node.lock_ref > 0 or node.host_ref > 0, (
                "tombstones: an unpinned device leaf is a tombstone"
            )


def _check_window_locks(cache: HybridRadixCache, nodes: list[HybridNode]) -> None:
    want: dict[int, dict[int, int]] = {}
    if cache.window_pos:
        for node in nodes:
            if node.locks_here:
                end, x = node.end, node
                while x is not cache.root and x.end > end - cache.widest:
                    row = want.setdefault(id(x), {})
                    row[end] = row.get(end, 0) + node.locks_here
                    x = x.parent  # type: ignore[assignment]
    for node in nodes:
        assert all(v > 0 for v in node.wlocks.values()), "locks: non-positive window lock count"
        assert node.wlocks == want.get(id(node), {}), (
            "locks: window locks != the locks whose window reaches the node"
        )


def _check_sizes(cache: HybridRadixCache, nodes: list[HybridNode]) -> None:
    for c, group in enumerate(cache.groups):
        held = [n for n in nodes if cache.holds(n, c)]
        protected = sum(cache._size_of(n, c) for n in held if cache._protects(n, c))
        evictable = sum(cache._size_of(n, c) for n in held if not cache._protects(n, c))
        ev, pr = cache._evictable[c], cache._protected[c]
        name = f"sizes (group {group.index})"
        assert ev >= 0 and pr >= 0, f"{name}: negative evictable or protected size"
        assert ev == evictable, f"{name}: evictable {ev} != {evictable} unprotected"
        assert pr == protected, f"{name}: protected {pr} != {protected} protected"
        assert cache.total_size(group.index) == ev + pr, f"{name}: total != sum"


def _device_pages(cache: HybridRadixCache, node: HybridNode, c: int) -> np.ndarray:
    if c == cache.full:
        return node.value  # type: ignore[return-value]
    if c == cache.recurrent:
        return np.array([node.state], dtype=np.int64)
    return node.windows[cache.window_pos.index(c)]  # type: ignore[return-value]


def _check_slots(cache: HybridRadixCache, nodes: list[HybridNode]) -> None:
    for c, alloc in enumerate(cache.allocators):
        assert alloc is not None
        pages = [_device_pages(cache, n, c) for n in nodes if cache.holds(n, c)]
        used = np.concatenate(pages) if pages else np.zeros(0, dtype=np.int64)
        unit = 1 if c == cache.recurrent else cache.page_size
        assert len(used) * unit == cache.total_size(cache.groups[c].index), (
            f"slots (group {cache.groups[c].index}): tree pages != total size"
        )
        if len(used):
            assert used.min() >= 0 and used.max() < alloc.num_pages, "slots: out of range"
        owners = np.bincount(used, minlength=alloc.num_pages)
        assert owners.max(initial=0) <= 1, "slots: a page owned by two nodes"
        free = alloc.free_slot_ids()[:: alloc.page_size] // alloc.page_size
        freed = np.bincount(free, minlength=alloc.num_pages)
        assert not (owners & freed).any(), "slots: a tree page is also free"


def _check_heaps(cache: HybridRadixCache, nodes: list[HybridNode]) -> None:
    for c, heap in enumerate(cache._heaps):
        live = {seq: (use, n) for use, seq, n in heap if n.seqs[c] == seq}
        for node in nodes:
            if not cache._candidate(node, c):
                continue
            entry = live.get(node.seqs[c])
            assert entry is not None and entry[1] is node, (
                f"eviction (group {cache.groups[c].index}): a candidate is missing from its LRU"
            )
            assert entry[0] == node.last_access, "eviction: candidate ranked by a stale use"
