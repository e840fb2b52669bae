"""The router's summary of every worker's cache: chained block hash -> the workers holding it.

Stored flat. Because block hashes are chained (`mem_cache.events.block_hashes`), hash `i` stands
for the whole prefix of blocks `0..i`, so a worker's match for a request is the number of leading
hashes it holds; no tree is needed. Per tier (`device`, `host`) one dict maps a hash to a bitmask
of the workers holding it (`index_store.py`, which also keeps each worker's entries in
LRU order for the memory bound), so a match for N workers is one pass of integer ANDs over the
request's hashes, stopping as soon as no worker continues.

Device entries are born two ways: optimistically when a request is routed to a worker (so a
burst on a new prefix follows the first request), and exactly by the worker's `BlockStored`
events. An optimistic entry not confirmed within `optimistic_ttl_s` expires. `BlockRemoved`
drops an entry whatever its state, `AllCleared` drops all of a worker's entries, and
`remove_worker` leaves no trace. Host entries come only from events (`medium="host"`).

Hybrid workers (`kv_groups`): events tagged with a KV group other than the worker's
full-attention one fill that group's own tier, and the worker's match is where a prefix can
resume on it (`kv_groups.resume_blocks`): at most its full-attention match, at most the
engine's cap (`limit_blocks`), where every group allows it. A worker whose events carry no
group, or only a full-attention group, is matched exactly as before. Routing guesses each
group's blocks as the engine will keep them (`kv_groups.expected_blocks`), as it guesses the
device tier's.

Not thread-safe: one owner (the router's event loop or the simulator) drives it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from mem_cache.events import (
    DEVICE,
    HOST,
    AllCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from router.routing.index_store import TIERS, EntryStore, WorkerEntries
from router.routing.kv_groups import WorkerGroups, expected_blocks, resume_blocks


@dataclass
class IndexConfig:
    """Bounds of the prefix index."""

    # entries (block, worker, tier) kept, least recently used evicted first; ~230 bytes each
    # (measured), so 1M entries ~ 16M cached tokens of 16-token blocks in ~230 MB
    max_blocks: int = 1_000_000
    optimistic_ttl_s: float = 30.0  # an entry made by routing, never confirmed, lives this long
    # read every KV group of a hybrid worker; False: only its full-attention group, as routers
    # blind to hybrid models do (over-predicts hits: for comparison)
    kv_groups: bool = True


@dataclass
class PrefixMatch:
    """Leading blocks of one request held by each worker.

    `device[w]`: leading blocks on worker w's device. `host[w]`: how many blocks right after
    those w holds only on its host tier (loadable instead of recomputed). Workers missing from a
    dict hold 0 there.
    """

    device: dict[str, int]
    host: dict[str, int]


class PrefixIndex:
    """Chained block hash -> workers, with optimistic entries, exact events and a memory bound."""

    def __init__(
        self, config: IndexConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or IndexConfig()
        self._clock = clock
        self._store = EntryStore(self.config.max_blocks)
        self._workers = self._store.workers
        self._hybrid: dict[str, WorkerEntries] = {}  # workers with groups beyond the device tier
        self._next_deadline = math.inf

    # --- workers ---------------------------------------------------------------------------

    def add_worker(self, worker_id: str) -> None:
        """Register a worker (no entries). A known worker is left as it is."""
        self._store.add_worker(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and every entry of it; unknown ids are ignored."""
        self._store.remove_worker(worker_id)
        self._hybrid.pop(worker_id, None)

    def workers(self) -> list[str]:
        return list(self._workers)

    # --- queries -------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Entries held, one per (block, worker, tier): what `max_blocks` bounds."""
        return self._store.size

    def num_blocks(self, worker_id: str, medium: str = DEVICE) -> int:
        worker = self._workers.get(worker_id)
        return 0 if worker is None else len(worker.tiers[medium])

    def confirmed(self, worker_id: str) -> tuple[int, int]:
        """(count, XOR) of the device blocks the worker's events stored, without the entries
        routing guessed: two routers that applied the same events give the same pair (the
        admin's `index_blocks` / `index_digest`, to see that replicas' indexes agree)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return 0, 0
        count, digest = 0, 0
        for h in worker.tiers[DEVICE]:
            if h not in worker.pending:
                count += 1
                digest ^= h
        return count, digest

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

    def match(self, hashes: Sequence[int], limit_blocks: int | None = None,
              block_size: int = 1) -> PrefixMatch:
        """Leading blocks of `hashes` each worker holds, in one pass; see `PrefixMatch`.

        A hybrid worker's `device` entry is where the prefix can resume on it instead, at most
        `limit_blocks` (the engine's cap; None: no cap) of `block_size` tokens, and it has no
        host match."""
        if not self._store.masks[HOST]:
            match = PrefixMatch(self._match_device(hashes), {})
        else:
            match = self._match_tiers(hashes)
        for worker in self._hybrid.values():
            self._resume(worker, hashes, match, limit_blocks, block_size)
        return match

    def _resume(self, worker: WorkerEntries, hashes: Sequence[int], match: PrefixMatch,
                limit_blocks: int | None, block_size: int) -> None:
        groups = worker.groups
        worker_id = worker.worker_id
        bound = match.device.get(worker_id, 0) if groups.full is not None else len(hashes)
        if limit_blocks is not None:
            bound = min(bound, limit_blocks)
        held = [(group, worker.tiers.get(tier, ())) for tier, group in groups.extra.items()]
        length = resume_blocks(hashes, bound, held, block_size)
        match.host.pop(worker_id, None)
        if length:
            match.device[worker_id] = length
        else:
            match.device.pop(worker_id, None)

    def _match_device(self, hashes: Sequence[int]) -> dict[str, int]:
        masks = self._store.masks[DEVICE]
        active = self._store.all_bits
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
        device_masks, host_masks = self._store.masks[DEVICE], self._store.masks[HOST]
        on_device = anywhere = self._store.all_bits
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
                out[self._store.by_bit[low.bit_length() - 1].worker_id] = length
            bits ^= low

    # --- updates -------------------------------------------------------------------------------

    def record_route(self, worker_id: str, hashes: Sequence[int], block_size: int = 1) -> None:
        """A request with `hashes` was sent to the worker: touch what it holds, guess the rest.

        The worker will hold every block of the prompt once it has prefilled it (of a hybrid
        worker's other groups, what each keeps: `expected_blocks`), so blocks it does not hold
        yet become optimistic entries, confirmed by `BlockStored` or expired.
        """
        worker = self._workers[worker_id]
        deadline = self._clock() + self.config.optimistic_ttl_s
        for h in self._store.touch(worker, DEVICE, hashes):
            worker.pending[h] = deadline
        for tier, group in worker.groups.extra.items():
            blocks = expected_blocks(group, len(hashes), block_size)
            for h in self._store.touch(worker, tier, [hashes[i] for i in blocks]):
                worker.group_pending[(tier, h)] = deadline
        self._next_deadline = min(self._next_deadline, deadline)
        self._store.enforce_bound()

    def refresh_pending(self, worker_id: str, hashes: Sequence[int]) -> None:
        """Restart the TTL of the worker's unconfirmed entries among `hashes` (request finished).

        Workers may report blocks only when a request ends, so the TTL counts from then.
        """
        worker = self._workers.get(worker_id)
        if worker is None or not (worker.pending or worker.group_pending):
            return
        deadline = self._clock() + self.config.optimistic_ttl_s
        pending = worker.pending
        for h in hashes:
            if pending.pop(h, None) is not None:
                pending[h] = deadline  # re-inserted last: keeps deadline order
        group_pending = worker.group_pending
        for tier in worker.groups.extra if group_pending else ():
            for h in hashes:
                if group_pending.pop((tier, h), None) is not None:
                    group_pending[(tier, h)] = deadline

    def apply(self, worker_id: str, events: Iterable[KVEvent]) -> None:
        """Apply a worker's KV events in order (the caller checked their sequence)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        store = self._store
        for event in events:
            if isinstance(event, (BlockStored, BlockRemoved)):
                tier = self._tier(worker, event)
                if tier is None:
                    continue
                if isinstance(event, BlockRemoved):
                    for h in event.hashes:
                        store.drop(worker, tier, h)
                    continue
                store.touch(worker, tier, event.hashes)
                if tier == DEVICE:  # confirmed
                    for h in event.hashes:
                        worker.pending.pop(h, None)
                elif tier != HOST:
                    for h in event.hashes:
                        worker.group_pending.pop((tier, h), None)
            elif isinstance(event, AllCleared):
                store.clear(worker)
                # a restarted engine may serve another model: its groups come with its blocks
                worker.groups = WorkerGroups()
                self._hybrid.pop(worker_id, None)
        store.enforce_bound()

    def _tier(self, worker: WorkerEntries, event: BlockStored | BlockRemoved) -> str | None:
        """Where a block event of the worker lands: its medium's tier for the full-attention
        group (or none), its group's tier for another group on the device; None: not
        indexed (another medium, another group off the device, or `kv_groups` off)."""
        if event.medium not in TIERS:
            return None
        groups = worker.groups
        if groups.is_primary(event.group):
            return groups.tier(event.group) if event.medium == DEVICE else event.medium
        if event.medium != DEVICE or not self.config.kv_groups:
            return None
        tier = groups.tier(event.group)
        self._hybrid[worker.worker_id] = worker
        return tier

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
                self._store.drop(worker, DEVICE, h)
                dropped += 1
            group_pending = worker.group_pending
            while group_pending:
                (tier, h), deadline = next(iter(group_pending.items()))
                if deadline > now:
                    next_deadline = min(next_deadline, deadline)
                    break
                self._store.drop(worker, tier, h)
                dropped += 1
        self._next_deadline = next_deadline
        return dropped
