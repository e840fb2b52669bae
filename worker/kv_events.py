"""Numbered batches of one engine's KV events, a bounded buffer of them, and snapshots.

Each engine start picks a fresh `epoch` (time-based with random low bits); within it `seq` grows
by one per batch. A reader that asks for batches after a seq that is no longer buffered, or from
another epoch, gets a snapshot instead: one batch that starts with `AllCleared` and re-stores
every cached block, numbered with the seq of the latest batch (so the next batch follows it).
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque

from mem_cache.events import AllCleared, KVEvent, encode_batch


def new_epoch() -> int:
    """Milliseconds since the epoch in the high bits, 16 random bits below: unique per start."""
    return (int(time.time() * 1000) << 16) | random.getrandbits(16)


class EventLog:
    """The last `capacity` encoded batches of one worker, by seq. Thread-safe: the engine
    thread appends while the actor's event loop reads `since`."""

    def __init__(self, worker_id: str, capacity: int = 4096) -> None:
        self.worker_id = worker_id
        self.epoch = new_epoch()
        self.seq = 0  # seq of the latest batch; the first batch is 1
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def append(self, events: list[KVEvent]) -> bytes | None:
        """Number and buffer one batch; None (and no seq used) when `events` is empty."""
        if not events:
            return None
        with self._lock:
            self.seq += 1
            data = encode_batch(self.worker_id, self.epoch, self.seq, events)
            self._buffer.append((self.seq, data))
        return data

    def since(self, epoch: int, after_seq: int) -> list[bytes] | None:
        """Buffered batches with seq > after_seq, or None when the reader must take a snapshot
        (another epoch, a seq from the future, or batches it missed already dropped)."""
        with self._lock:
            if epoch != self.epoch or after_seq > self.seq or after_seq < 0:
                return None
            oldest = self._buffer[0][0] if self._buffer else self.seq + 1
            if after_seq + 1 < oldest and after_seq != self.seq:
                return None
            return [data for seq, data in self._buffer if seq > after_seq]

    def snapshot(self, cached: list[KVEvent]) -> bytes:
        """One batch: AllCleared, then `cached` (BlockStored of every cached block)."""
        events: list[KVEvent] = [AllCleared()]
        events.extend(e for e in cached if not isinstance(e, AllCleared))
        with self._lock:
            return encode_batch(self.worker_id, self.epoch, self.seq, events)
