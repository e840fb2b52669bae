"""The router's summary of every worker's cache: chained block hash -> the workers holding it.

Stored flat. Because block hashes are chained (`mem_cache.events.block_hashes`), hash `i` stands
for the whole prefix of blocks `0..i`, so a worker's match for a request is the number of leading
hashes it holds; no tree is needed. Per tier (`device`, `host`) one dict maps a hash to a bitmask
of the workers holding it, which makes a match for N workers one pass of integer ANDs over the
request's hashes, stopping as soon as no worker continues.

Each worker's entries also sit in a per-worker, per-tier `OrderedDict` (hash -> last-use tick,
least recently used first). Ticks are global and unique, so the least recently used entry of the
whole index is the oldest head among those dicts: that is how the memory bound (`max_blocks`
entries, one per (block, worker, tier)) evicts.

Device entries are born two ways: optimistically when a request is routed to a worker (so a
burst on a new prefix follows the first request), and exactly by the worker's `BlockStored`
events. An optimistic entry not confirmed within `optimistic_ttl_s` expires. `BlockRemoved`
drops an entry whatever its state, `AllCleared` drops all of a worker's entries, and
`remove_worker` leaves no trace. Host entries come only from events (`medium="host"`).

Not thread-safe: one owner (the router's event loop or the simulator) drives it.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from mem_cache.events import (
    DEVICE,
    HOST,
    AllCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
)

_TIERS = (DEVICE, HOST)


@dataclass
class IndexConfig:
    """Bounds of the prefix index."""

    max_blocks: int = 4_000_000  # entries (block, worker, tier) kept; least recently used go first
    optimistic_ttl_s: float = 30.0  # an entry made by routing, never confirmed, lives this long


@dataclass
class PrefixMatch:
    """Leading blocks of one request held by each worker.

    `device[w]`: leading blocks on worker w's device. `host[w]`: how many blocks right after
    those w holds only on its host tier (loadable instead of recomputed). Workers missing from a
    dict hold 0 there.
    """

    device: dict[str, int]
    host: dict[str, int]


class _Worker:
    """One worker's entries: per tier hash -> last-use tick (LRU first), and unconfirmed ones."""

    __slots__ = ("worker_id", "bit", "tiers", "pending", "cursor")

    def __init__(self, worker_id: str, bit: int) -> None:
        self.worker_id = worker_id
        self.bit = bit
        self.tiers: dict[str, OrderedDict[int, int]] = {t: OrderedDict() for t in _TIERS}
        self.pending: dict[int, float] = {}  # unconfirmed device hash -> deadline, deadline order
        self.cursor: tuple[int, int] | None = None  # (epoch, seq) of the last applied batch


class PrefixIndex:
    """Chained block hash -> workers, with optimistic entries, exact events and a memory bound."""

    def __init__(
        self, config: IndexConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or IndexConfig()
        self._clock = clock
        self._workers: dict[str, _Worker] = {}
        self._by_bit: dict[int, _Worker] = {}
        self._free_bits: list[int] = []
        self._masks: dict[str, dict[int, int]] = {t: {} for t in _TIERS}
        self._all_bits = 0
        self._size = 0
        self._tick = 0
        self._next_deadline = math.inf

    # --- workers ---------------------------------------------------------------------------

    def add_worker(self, worker_id: str) -> None:
        """Register a worker (no entries, no event cursor). A known worker is left as it is."""
        if worker_id in self._workers:
            return
        bit = self._free_bits.pop() if self._free_bits else len(self._by_bit)
        worker = _Worker(worker_id, bit)
        self._workers[worker_id] = worker
        self._by_bit[bit] = worker
        self._all_bits |= 1 << bit

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and every entry of it; unknown ids are ignored."""
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return
        self._clear(worker)
        del self._by_bit[worker.bit]
        self._all_bits &= ~(1 << worker.bit)
        self._free_bits.append(worker.bit)

    def clear_worker(self, worker_id: str) -> None:
        """Drop all entries of a worker (it restarted or is about to send a snapshot)."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            self._clear(worker)

    def workers(self) -> list[str]:
        return list(self._workers)

    def cursor(self, worker_id: str) -> tuple[int, int] | None:
        """(epoch, seq) of the last event batch applied for the worker, None before a snapshot."""
        worker = self._workers.get(worker_id)
        return None if worker is None else worker.cursor

    # --- queries -------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Entries held, one per (block, worker, tier): what `max_blocks` bounds."""
        return self._size

    def num_blocks(self, worker_id: str, medium: str = DEVICE) -> int:
        worker = self._workers.get(worker_id)
        return 0 if worker is None else len(worker.tiers[medium])

    def holds(self, worker_id: str, block_hash: int, medium: str = DEVICE) -> bool:
        worker = self._workers.get(worker_id)
        return worker is not None and block_hash in worker.tiers[medium]

    def is_confirmed(self, worker_id: str, block_hash: int) -> bool:
        """True when the worker's events stored this device block (not only routing guessed it)."""
        worker = self._workers.get(worker_id)
        return (
            worker is not None
            and block_hash in worker.tiers[DEVICE]
            and block_hash not in worker.pending
        )

    def match(self, hashes: Sequence[int]) -> PrefixMatch:
        """Leading blocks of `hashes` each worker holds, in one pass; see `PrefixMatch`."""
        if not self._masks[HOST]:
            return PrefixMatch(self._match_device(hashes), {})
        return self._match_tiers(hashes)

    def _match_device(self, hashes: Sequence[int]) -> dict[str, int]:
        masks = self._masks[DEVICE]
        active = self._all_bits
        lengths: dict[str, int] = {}
        for i, h in enumerate(hashes):
            held = masks.get(h, 0) & active
            if held != active:
                self._record(active & ~held, i, lengths)
                active = held
                if not active:
                    return lengths
        self._record(active, len(hashes), lengths)
        return lengths

    def _match_tiers(self, hashes: Sequence[int]) -> PrefixMatch:
        device_masks, host_masks = self._masks[DEVICE], self._masks[HOST]
        on_device = anywhere = self._all_bits
        device: dict[str, int] = {}
        total: dict[str, int] = {}
        n = len(hashes)
        for i, h in enumerate(hashes):
            d = device_masks.get(h, 0)
            held = on_device & d
            if held != on_device:
                self._record(on_device & ~held, i, device)
                on_device = held
            held_any = anywhere & (d | host_masks.get(h, 0))
            if held_any != anywhere:
                self._record(anywhere & ~held_any, i, total)
                anywhere = held_any
                if not anywhere:
                    break
        self._record(on_device, n, device)
        self._record(anywhere, n, total)
        host = {w: t - device.get(w, 0) for w, t in total.items() if t > device.get(w, 0)}
        return PrefixMatch(device, host)

    def _record(self, bits: int, length: int, out: dict[str, int]) -> None:
        while bits:
            low = bits & -bits
            if length:
                out[self._by_bit[low.bit_length() - 1].worker_id] = length
            bits ^= low

    # --- updates -------------------------------------------------------------------------------

    def record_route(self, worker_id: str, hashes: Sequence[int]) -> None:
        """A request with `hashes` was sent to the worker: touch what it holds, guess the rest.

        The worker will hold every block of the prompt once it has prefilled it, so blocks it
        does not hold yet become optimistic entries, confirmed by `BlockStored` or expired.
        """
        worker = self._workers[worker_id]
        deadline = self._clock() + self.config.optimistic_ttl_s
        device = worker.tiers[DEVICE]
        for h in hashes:
            if h in device:
                self._tick += 1
                device.move_to_end(h)
                device[h] = self._tick
            else:
                self._add(worker, DEVICE, h)
                worker.pending[h] = deadline
        self._next_deadline = min(self._next_deadline, deadline)
        self._enforce_bound()

    def refresh_pending(self, worker_id: str, hashes: Sequence[int]) -> None:
        """Restart the TTL of the worker's unconfirmed entries among `hashes` (request finished).

        Workers may report blocks only when a request ends, so the TTL counts from then.
        """
        worker = self._workers.get(worker_id)
        if worker is None or not worker.pending:
            return
        deadline = self._clock() + self.config.optimistic_ttl_s
        pending = worker.pending
        for h in hashes:
            if pending.pop(h, None) is not None:
                pending[h] = deadline  # re-inserted last: keeps deadline order

    def apply(self, worker_id: str, events: Iterable[KVEvent]) -> None:
        """Apply a worker's KV events in order (no sequence check; see `apply_batch`)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        for event in events:
            if isinstance(event, BlockStored) and event.medium in _TIERS:
                self._store(worker, event.medium, event.hashes)
            elif isinstance(event, BlockRemoved) and event.medium in _TIERS:
                for h in event.hashes:
                    self._drop(worker, event.medium, h)
            elif isinstance(event, AllCleared):
                self._clear(worker)
        self._enforce_bound()

    def apply_batch(self, batch: EventBatch) -> bool:
        """Apply one numbered batch; False when events were missed and a snapshot is needed.

        A batch starting with `AllCleared` is a snapshot: applied whatever the cursor (unless it
        is older than the cursor in the same epoch). Otherwise it must be the next `seq` of the
        current epoch; an old duplicate is ignored (True); a gap, a new epoch, or no cursor yet
        returns False and changes nothing. Batches of unknown workers are ignored (True).
        """
        worker = self._workers.get(batch.worker_id)
        if worker is None:
            return True
        cursor = worker.cursor
        same_epoch = cursor is not None and cursor[0] == batch.epoch
        if batch.events and isinstance(batch.events[0], AllCleared):
            if same_epoch and batch.seq < cursor[1]:
                return True
        elif not same_epoch or batch.seq > cursor[1] + 1:
            return False
        elif batch.seq <= cursor[1]:
            return True
        self.apply(batch.worker_id, batch.events)
        worker.cursor = (batch.epoch, batch.seq)
        return True

    def expire(self) -> int:
        """Drop optimistic entries past their deadline; returns how many were dropped."""
        now = self._clock()
        if now < self._next_deadline:
            return 0
        dropped = 0
        next_deadline = math.inf
        for worker in self._workers.values():
            pending = worker.pending
            while pending:
                h, deadline = next(iter(pending.items()))
                if deadline > now:
                    next_deadline = min(next_deadline, deadline)
                    break
                self._drop(worker, DEVICE, h)
                dropped += 1
        self._next_deadline = next_deadline
        return dropped

    # --- entry ownership: every entry is added in _add and removed in _drop or _clear --------

    def _store(self, worker: _Worker, medium: str, hashes: Iterable[int]) -> None:
        entries = worker.tiers[medium]
        for h in hashes:
            if h in entries:
                self._tick += 1
                entries.move_to_end(h)
                entries[h] = self._tick
            else:
                self._add(worker, medium, h)
            if medium == DEVICE:
                worker.pending.pop(h, None)

    def _add(self, worker: _Worker, medium: str, h: int) -> None:
        self._tick += 1
        worker.tiers[medium][h] = self._tick
        masks = self._masks[medium]
        masks[h] = masks.get(h, 0) | (1 << worker.bit)
        self._size += 1

    def _drop(self, worker: _Worker, medium: str, h: int) -> None:
        if worker.tiers[medium].pop(h, None) is None:
            return
        if medium == DEVICE:
            worker.pending.pop(h, None)
        masks = self._masks[medium]
        rest = masks[h] & ~(1 << worker.bit)
        if rest:
            masks[h] = rest
        else:
            del masks[h]
        self._size -= 1

    def _clear(self, worker: _Worker) -> None:
        for medium in _TIERS:
            for h in list(worker.tiers[medium]):
                self._drop(worker, medium, h)
        worker.pending.clear()

    def _enforce_bound(self) -> None:
        """Evict least recently used entries, index-wide, until `max_blocks` holds."""
        excess = self._size - self.config.max_blocks
        if excess <= 0:
            return
        heads = [
            (next(iter(entries.values())), worker.bit, medium)
            for worker in self._workers.values()
            for medium, entries in worker.tiers.items()
            if entries
        ]
        heapq.heapify(heads)
        while excess > 0 and heads:
            _, bit, medium = heads[0]
            worker = self._by_bit[bit]
            entries = worker.tiers[medium]
            self._drop(worker, medium, next(iter(entries)))
            excess -= 1
            if entries:
                heapq.heapreplace(heads, (next(iter(entries.values())), bit, medium))
            else:
                heapq.heappop(heads)
