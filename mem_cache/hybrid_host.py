"""The host-memory tier of the component radix cache (`HybridRadixCache`).

A node's host copy holds every component it had on device when it was backed up: its full KV
(`host_value`), the window KV of each group in which it was not a tombstone (`host_windows`) and
its state (`host_state`), each in the pages of that group's host allocator. A copy is complete
(`host_ready`) as soon as it is made: copies are synchronous (each group's `KVCopier` is waited
for at once), so none is ever in flight.

Invariants (checked by `check`): host copies are prefix-closed (a node is backed up only if its
parent is: a backup copies the missing ancestors first); a node off the device has a complete
host copy; a node the host tier references (`protect`, `host_ref`) has one too, so that device
eviction and the tombstone cascade demote it instead of removing it; a split gives the upper half
its share of the copy (so that, under write-through, the upper half's later eviction demotes it
rather than dropping it and orphaning its child's copy).

Policies: `write_through` backs a node up when it is inserted, `write_back` when the device
evicts it. `evict` removes host-only leaves that nothing pins, least recently used first,
cascading to host-only parents. Host blocks are reported per group with `medium="host"`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from mem_cache.allocator import KVAllocator, pages_to_slots
from mem_cache.block_ledger import BlockLedger
from mem_cache.host_cache import KVCopier, NullCopier
from mem_cache.hybrid_node import NO_STATE, HybridNode

# The cache that owns the tier / is checked (`hybrid_cache.HybridRadixCache`, which imports this
# module: named here without an import, so that the package has no import cycle).
HybridRadixCache = Any

HYBRID_WRITE_POLICIES = ("write_through", "write_back")


class HybridHostTier:
    """Host copies of a `HybridRadixCache`'s nodes (no host memory: `allocators=None`, and
    every hook does nothing)."""

    def __init__(
        self,
        cache: HybridRadixCache,
        allocators: list[KVAllocator] | tuple[KVAllocator, ...] | None,
        write_policy: str,
        copiers: Mapping[int, KVCopier] | None,
        ledgers: list[BlockLedger],
    ) -> None:
        if write_policy not in HYBRID_WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {HYBRID_WRITE_POLICIES}")
        self.cache = cache
        self.enabled = allocators is not None
        self.allocators = tuple(allocators) if allocators is not None else ()
        if self.enabled and len(self.allocators) != len(cache.groups):
            raise ValueError("one host allocator per group")
        for c, alloc in enumerate(self.allocators):
            if alloc.page_size != cache.allocators[c].page_size:  # type: ignore[union-attr]
                raise ValueError("a host allocator's page size differs from its device one")
        self.write_policy = write_policy
        self.copiers = dict(copiers or {})
        self.ledgers = ledgers
        self._size = 0
        self._heap: list[tuple[int, int, HybridNode]] = []
        self._seq = 0

    def _copier(self, c: int) -> KVCopier:
        return self.copiers.get(self.cache.groups[c].index) or NullCopier()

    def size(self) -> int:
        return self._size

    def holds(self, node: HybridNode, c: int) -> bool:
        """Whether `node`'s host copy holds component `c`."""
        if not node.host_ready:
            return False
        cache = self.cache
        if c == cache.full:
            return True
        if c == cache.recurrent:
            return node.host_state != NO_STATE
        return node.host_windows[cache.window_pos.index(c)] is not None

    # --- hooks the cache calls --------------------------------------------------------------

    def split(self, child: HybridNode, upper: HybridNode, length: int) -> None:
        upper.host_ready = child.host_ready
        upper.host_ref = child.host_ref
        upper.hits = child.hits
        if child.host_value is not None:
            cut = length // self.cache.page_size
            upper.host_value = child.host_value[:cut].copy()
            child.host_value = child.host_value[cut:].copy()

    def after_use(self, path: list[HybridNode], inserted: bool) -> None:
        if self.enabled and inserted and self.write_policy == "write_through" and path:
            self.backup(path[-1])

    def before_offload(self, node: HybridNode) -> None:
        """The device is about to free `node`: under write-back, back it up now."""
        if self.enabled and self.write_policy == "write_back" and node.host_value is None:
            self.backup(node)

    def loaded(self, node: HybridNode) -> None:
        node.host_heap_seq = -1

    def rerank(self, node: HybridNode) -> None:
        if node.evicted and not node.children and not node.host_ref and node.parent is not None:
            self._seq += 1
            node.host_heap_seq = self._seq
            heapq.heappush(self._heap, (node.last_access, self._seq, node))

    def pinned(self) -> bool:
        return any(n.host_ref for n in self.cache.root.children.values())

    # --- protection -------------------------------------------------------------------------

    def protect(self, node: HybridNode) -> None:
        root = self.cache.root
        if node is root:
            return
        if node.parent is None or not node.host_ready:
            raise ValueError("protect_host(): the node has no host copy")
        node.host_here += 1
        while node is not root:
            node.host_ref += 1
            node = node.parent  # type: ignore[assignment]

    def release(self, node: HybridNode) -> None:
        root = self.cache.root
        if node is root:
            return
        if node.host_here <= 0 or node.parent is None:
            raise ValueError("release_host(): the node is not protected")
        node.host_here -= 1
        leaf = node
        while node is not root:
            node.host_ref -= 1
            node = node.parent  # type: ignore[assignment]
        self.rerank(leaf)

    # --- copies -----------------------------------------------------------------------------

    def _parts(self, node: HybridNode, host: bool) -> dict[int, int]:
        """Component -> pages (slots, for states) that `node` holds on device (or on host)."""
        cache = self.cache
        wins = node.host_windows if host else node.windows
        state = node.host_state if host else node.state
        need = {cache.full: len(node) // cache.page_size}
        for i, c in enumerate(cache.window_pos):
            if wins[i] is not None:
                need[c] = len(node) // cache.page_size
        if cache.recurrent is not None and state != NO_STATE:
            need[cache.recurrent] = 1
        return need

    def _alloc_all(self, allocs: list[KVAllocator], wants: list[dict[int, int]]) -> list | None:
        """Pages per node per component from `allocs`, all or nothing."""
        totals: dict[int, int] = {}
        for want in wants:
            for c, k in want.items():
                totals[c] = totals.get(c, 0) + k
        got: dict[int, np.ndarray] = {}
        for c, k in totals.items():
            pages = allocs[c].alloc_pages(k)
            if pages is None:
                for c2, p in got.items():
                    allocs[c2].free_pages(p)
                return None
            got[c] = pages
        out, at = [], dict.fromkeys(totals, 0)
        for want in wants:
            part = {}
            for c, k in want.items():
                part[c] = got[c][at[c] : at[c] + k].copy()
                at[c] += k
            out.append(part)
        return out

    def _slots(self, c: int, pages: list[np.ndarray]) -> torch.Tensor:
        size = 1 if c == self.cache.recurrent else self.cache.page_size
        return torch.from_numpy(pages_to_slots(np.concatenate(pages), size))

    def backup(self, node: HybridNode) -> bool:
        """Copy `node` and its ancestors without a host copy to host, parents first. False
        (nothing changed) if host memory cannot be found."""
        cache, path = self.cache, []
        while node is not cache.root and node.host_value is None:
            path.append(node)
            node = node.parent  # type: ignore[assignment]
        if not path:
            return True
        path.reverse()
        wants = [self._parts(n, host=False) for n in path]
        parts = self._alloc_all(list(self.allocators), wants)
        if parts is None:
            need = sum(len(n) for n in path)
            self.evict(need - self.allocators[cache.full].available_size())
            parts = self._alloc_all(list(self.allocators), wants)
        if parts is None:
            return False
        for c in range(len(cache.groups)):
            dev, host = [], []
            for n, part in zip(path, parts, strict=True):
                if c in part:
                    dev.append(self._device_pages(n, c))
                    host.append(part[c])
            if dev:
                copier = self._copier(c)
                copier.wait(copier.to_host(self._slots(c, dev), self._slots(c, host)))
        for n, part in zip(path, parts, strict=True):
            n.host_value = part[cache.full]
            for i, c in enumerate(cache.window_pos):
                n.host_windows[i] = part.get(c)
            if cache.recurrent is not None and cache.recurrent in part:
                n.host_state = int(part[cache.recurrent][0])
            n.host_ready = True
            self._size += len(n)
            for c in range(len(cache.groups)):
                if self.holds(n, c):
                    blocks = cache.blocks(n, c)
                    if blocks:
                        self.ledgers[c].stored(blocks, cache.block_before(n, c))
        return True

    def _device_pages(self, node: HybridNode, c: int) -> np.ndarray:
        cache = self.cache
        if c == cache.full:
            return node.value  # type: ignore[return-value]
        if c == cache.recurrent:
            return np.array([node.state], dtype=np.int64)
        return node.windows[cache.window_pos.index(c)]  # type: ignore[return-value]

    def load(self, path: list[HybridNode]) -> bool:
        """Bring the host-only nodes of `path` (parents first) back to device with every
        component their copies hold, all or nothing; False when device memory is short."""
        cache = self.cache
        wants = [self._parts(n, host=True) for n in path]
        allocs = list(cache.allocators)
        parts = self._alloc_all(allocs, wants)  # type: ignore[arg-type]
        if parts is None:
            totals: dict[int, int] = {}
            for want in wants:
                for c, k in want.items():
                    totals[c] = totals.get(c, 0) + k
            for c, k in totals.items():
                unit = 1 if c == cache.recurrent else cache.page_size
                short = k * unit - allocs[c].available_size()  # type: ignore[union-attr]
                if short <= 0:
                    continue
                if c == cache.full:
                    cache.evict(short)
                elif c == cache.recurrent:
                    cache.evict_states(short)
                else:
                    cache.evict_window(cache.groups[c].index, short)
            if any(n.parent is None or not n.evicted for n in path):
                return False  # making room changed the path
            parts = self._alloc_all(allocs, wants)  # type: ignore[arg-type]
        if parts is None:
            return False
        for c in range(len(cache.groups)):
            host, dev = [], []
            for n, part in zip(path, parts, strict=True):
                if c in part:
                    host.append(self._host_pages(n, c))
                    dev.append(part[c])
            if host:
                copier = self._copier(c)
                copier.wait(copier.to_device(self._slots(c, host), self._slots(c, dev)))
        for n, part in zip(path, parts, strict=True):
            full = part.pop(cache.full)
            if cache.recurrent in part:
                part[cache.recurrent] = int(part[cache.recurrent][0])  # type: ignore[index]
            cache._to_device(n, full, part)
        return True

    def _host_pages(self, node: HybridNode, c: int) -> np.ndarray:
        cache = self.cache
        if c == cache.full:
            return node.host_value  # type: ignore[return-value]
        if c == cache.recurrent:
            return np.array([node.host_state], dtype=np.int64)
        return node.host_windows[cache.window_pos.index(c)]  # type: ignore[return-value]

    # --- host eviction ----------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        root, freed = self.cache.root, 0
        while freed < num_tokens and self._heap:
            _, seq, node = heapq.heappop(self._heap)
            if node.host_heap_seq != seq:
                continue
            node.host_heap_seq = -1
            if not node.evicted or node.children or node.host_ref or node.parent is None:
                continue
            parent = node.parent
            freed += len(node)
            self._drop_copy(node)
            self.cache.detach(node)
            if parent is not root:
                self.rerank(parent)  # type: ignore[arg-type]
        return freed

    def _drop_copy(self, node: HybridNode) -> None:
        cache = self.cache
        for c in range(len(cache.groups)):
            if self.holds(node, c):
                blocks = cache.blocks(node, c)
                if blocks:
                    self.ledgers[c].removed(blocks)
                self.allocators[c].free_pages(self._host_pages(node, c))
        self._size -= len(node)
        node.host_value = None
        node.host_windows = [None] * len(node.host_windows)
        node.host_state = NO_STATE
        node.host_ready = False

    def clear(self, nodes: list[HybridNode]) -> None:
        if not self.enabled:
            return
        for node in nodes:
            if node.host_ready:
                for c in range(len(self.cache.groups)):
                    if self.holds(node, c):
                        self.allocators[c].free_pages(self._host_pages(node, c))
        self._size = 0
        self._heap = []
        for ledger in self.ledgers:
            ledger.clear()

    # --- integrity --------------------------------------------------------------------------

    def check(self, nodes: list[HybridNode]) -> None:
        """Raise `AssertionError` naming the first violated host-tier invariant."""
        cache, root = self.cache, self.cache.root
        assert root.host_ref == 0 and root.host_value is None, "root: must stay off the host tier"
        size = 0
        for node in nodes:
            parent = node.parent
            assert node.host_ref >= 0 and node.host_here >= 0, "host refs: negative count"
            below = sum(child.host_ref for child in node.children.values())
            assert node.host_ref == node.host_here + below, (
                "host refs: count != protections ending here + children's counts"
            )
            if node.evicted:
                assert node.host_ready, "tiers: a node is neither on device nor on host"
                assert node.lock_ref == 0 and not node.wlocks, "tiers: a node off device is locked"
            if node.host_ref:
                assert node.host_ready, "host refs: a referenced node has no host copy"
            if node.host_value is None:
                assert not node.host_ready, "tiers: host copy marked ready without pages"
                assert node.host_state == NO_STATE and all(
                    w is None for w in node.host_windows
                ), "tiers: host components without a full-KV host copy"
                continue
            assert parent is root or parent.host_value is not None, (  # type: ignore[union-attr]
                "host prefix: a node on host without its parent on host"
            )
            assert len(node.host_value) * cache.page_size == len(node), (
                "host values: page count != token count / page"
            )
            for w in node.host_windows:
                assert w is None or len(w) * cache.page_size == len(node), (
                    "host values: window page count != token count / page"
                )
            size += len(node)
        assert size == self._size, "host sizes: host_size drifted"
        for c, alloc in enumerate(self.allocators):
            pages = [self._host_pages(n, c) for n in nodes if self.holds(n, c)]
            used = np.concatenate(pages) if pages else np.zeros(0, dtype=np.int64)
            owners = np.bincount(used, minlength=alloc.num_pages)
            assert owners.max(initial=0) <= 1, "host slots: a host page owned by two nodes"
            free = alloc.free_slot_ids()[:: alloc.page_size] // alloc.page_size
            freed = np.bincount(free, minlength=alloc.num_pages)
            assert not (owners & freed).any(), "host slots: a tree page is also free"
            assert len(used) + len(free) == alloc.num_pages, (
                f"host slots: group {cache.groups[c].index} pages neither free nor in the tree"
            )
            self.ledgers[c].check_counts(block_counts(cache, nodes, c, self.holds))
        live = {seq: (use, n) for use, seq, n in self._heap if n.host_heap_seq == seq}
        for node in nodes:
            if node.evicted and not node.children and not node.host_ref:
                entry = live.get(node.host_heap_seq)
                assert entry is not None and entry[1] is node, (
                    "host eviction: a host-only leaf is missing from the candidates"
                )
                assert entry[0] == node.last_access, "host eviction: stale candidate rank"


def block_counts(
    cache: HybridRadixCache, nodes: list[HybridNode], c: int, holds: Callable
) -> dict[int, int]:
    """How many of `nodes` hold each block of component `c` (where `holds(node, c)`)."""
    counts: dict[int, int] = {}
    for node in nodes:
        if holds(node, c):
            for h in cache.blocks(node, c):
                counts[h] = counts.get(h, 0) + 1
    return counts
