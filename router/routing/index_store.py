"""The prefix index's storage: (block, worker, tier) entries, bounded, least recently used first.

Per tier (`device`, `host`) one dict maps a block hash to a bitmask of the workers holding it:
what matching reads. Each worker's entries also sit in a per-tier `OrderedDict` (hash ->
last-use tick, least recently used first). Ticks are global and unique, so the least recently
used entry of the whole store is the oldest head among those dicts: that is how the bound
(`max_blocks` entries) evicts. Every entry is added in `add` and removed in `drop`; `clear` and
`enforce_bound` go through `drop`, so masks, dicts and the size always agree.

A hybrid worker's groups other than its full-attention one are tiers of their own
(`kv_groups.WorkerGroups`), added when first seen; their entries count in the same bound.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable

from mem_cache.events import DEVICE, HOST
from router.routing.kv_groups import WorkerGroups

TIERS = (DEVICE, HOST)  # the media; group tiers come on top


class WorkerEntries:
    """One worker's entries: per tier hash -> last-use tick (LRU first), and unconfirmed ones."""

    __slots__ = ("worker_id", "bit", "tiers", "pending", "groups", "group_pending")

    def __init__(self, worker_id: str, bit: int) -> None:
        self.worker_id = worker_id
        self.bit = bit  # its bit in the masks
        self.tiers: dict[str, OrderedDict[int, int]] = {t: OrderedDict() for t in TIERS}
        self.pending: dict[int, float] = {}  # unconfirmed device hash -> deadline, deadline order
        self.groups = WorkerGroups()
        # unconfirmed entries of group tiers: (tier, hash) -> deadline, deadline order
        self.group_pending: dict[tuple[str, int], float] = {}

    def entries(self, tier: str) -> OrderedDict[int, int]:
        """The worker's entries of `tier`, a group tier made on first use."""
        entries = self.tiers.get(tier)
        if entries is None:
            entries = self.tiers[tier] = OrderedDict()
        return entries


class EntryStore:
    """Workers, their entries and the per-hash worker bitmasks, within `max_blocks` entries."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.workers: dict[str, WorkerEntries] = {}
        self.by_bit: dict[int, WorkerEntries] = {}
        self.masks: dict[str, dict[int, int]] = {t: {} for t in TIERS}
        self.all_bits = 0  # every registered worker's bit
        self.size = 0
        self._free_bits: list[int] = []
        self._tick = 0

    def add_worker(self, worker_id: str) -> WorkerEntries:
        """Register a worker (idempotent); a removed worker's bit is reused, already clean."""
        worker = self.workers.get(worker_id)
        if worker is None:
            bit = self._free_bits.pop() if self._free_bits else len(self.by_bit)
            worker = WorkerEntries(worker_id, bit)
            self.workers[worker_id] = worker
            self.by_bit[bit] = worker
            self.all_bits |= 1 << bit
        return worker

    def remove_worker(self, worker_id: str) -> None:
        """Drop every entry of the worker and free its bit; unknown ids are ignored."""
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return
        self.clear(worker)
        del self.by_bit[worker.bit]
        self.all_bits &= ~(1 << worker.bit)
        self._free_bits.append(worker.bit)

    def touch(self, worker: WorkerEntries, medium: str, hashes: Iterable[int]) -> list[int]:
        """Mark the worker's entries for `hashes` used now, adding the missing ones; returns
        the hashes it added."""
        entries = worker.entries(medium)
        added = []
        for h in hashes:
            if h in entries:
                self._tick += 1
                entries.move_to_end(h)
                entries[h] = self._tick
            else:
                self.add(worker, medium, h)
                added.append(h)
        return added

    def add(self, worker: WorkerEntries, medium: str, h: int) -> None:
        """A new entry (the caller checked it is missing), most recently used."""
        self._tick += 1
        worker.entries(medium)[h] = self._tick
        masks = self.masks.get(medium)
        if masks is None:
            masks = self.masks[medium] = {}
        masks[h] = masks.get(h, 0) | (1 << worker.bit)
        self.size += 1

    def drop(self, worker: WorkerEntries, medium: str, h: int) -> None:
        """Remove an entry (and its unconfirmed mark); a missing one is ignored."""
        entries = worker.tiers.get(medium)
        if entries is None or entries.pop(h, None) is None:
            return
        if medium == DEVICE:
            worker.pending.pop(h, None)
        elif medium != HOST:
            worker.group_pending.pop((medium, h), None)
        masks = self.masks[medium]
        rest = masks[h] & ~(1 << worker.bit)
        if rest:
            masks[h] = rest
        else:
            del masks[h]
        self.size -= 1

    def clear(self, worker: WorkerEntries) -> None:
        """Remove every entry of the worker."""
        for medium in list(worker.tiers):
            for h in list(worker.tiers[medium]):
                self.drop(worker, medium, h)
        worker.pending.clear()
        worker.group_pending.clear()

    def enforce_bound(self) -> None:
        """Evict least recently used entries, store-wide, until `max_blocks` holds."""
        excess = self.size - self.max_blocks
        if excess <= 0:
            return
        heads = [
            (next(iter(entries.values())), worker.bit, medium)
            for worker in self.workers.values()
            for medium, entries in worker.tiers.items()
            if entries
        ]
        heapq.heapify(heads)
        while excess > 0 and heads:
            _, bit, medium = heads[0]
            worker = self.by_bit[bit]
            entries = worker.tiers[medium]
            self.drop(worker, medium, next(iter(entries)))
            excess -= 1
            if entries:
                heapq.heapreplace(heads, (next(iter(entries.values())), bit, medium))
            else:
                heapq.heappop(heads)
