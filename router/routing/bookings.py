"""Load booked at dispatch: what the router has sent each worker and not yet seen finish.

Worker stats arrive late (a poll interval, an event delay), so a burst routed on stats alone
piles onto the worker that looked idle. Each routed request therefore books, on its worker, its
uncached prefill tokens, its expected decode tokens and its whole KV footprint, at once; `finish`
releases them. Prefill work also ages out: the request's prefill is assumed done at the time the
cost model predicted (`prefill_done_at`), because the engine starts decoding long before the
request ends. `busy_until` is the worker's predicted prefill-queue drain time (FIFO).

When a request's first token comes out (`first_token`), its prefill is known to be done: the
queue behind it moves by the prediction's error, earlier or later. The error is measured against
the prediction as already corrected, so a late worker is not charged once per request queued
behind the one that made it late.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Booking:
    """One routed request's share of its worker's load."""

    request_id: str
    worker_id: str
    prefill_tokens: int  # uncached prompt tokens the worker must compute
    decode_tokens: int  # expected output tokens
    active_tokens: int  # its context: prompt + expected output
    prefill_s: float  # predicted time of its own prefill
    prefill_done_at: float  # predicted time its first token is out
    hashes: Sequence[int] = ()  # its block hashes (index bookkeeping, shared KV)
    block_size: int = 0  # tokens per hashed block
    cached_tokens: int = 0  # prefix hit the index predicted
    actual_cached_tokens: int | None = None  # prefix hit the worker reported, set by finish
    prefilled: bool = False  # its prefill is out of the queue (predicted done, or first token)
    shift_at_booking: float = 0.0  # the worker's queue correction when it was booked
    started: bool = False  # its first token came out (`first_token`)


@dataclass(slots=True)
class WorkerLoad:
    """Sums over the bookings of one worker."""

    requests: int = 0
    prefill_tokens: int = 0  # of bookings whose predicted prefill is still ahead
    decode_tokens: int = 0
    active_tokens: int = 0  # the bookings' contexts: what their decode steps read
    # the KV they hold: a block that several bookings share (a common prefix) counted once
    kv_tokens: int = 0
    blocks: dict[int, int] = field(default_factory=dict)  # block hash -> bookings holding it
    busy_until: float = 0.0
    shift_s: float = 0.0  # sum of the first-token corrections applied to busy_until
    prefill_ahead: list[tuple[float, int, Booking]] = field(default_factory=list)  # heap


class DrainRate:
    """KV tokens per second that a worker's ending requests released, over a sliding window:
    how fast room frees up on a full worker (measured, so it holds whatever the worker's
    mix of prefill and decode)."""

    def __init__(self, since: float, window_s: float) -> None:
        self.since = since  # first booking: the window never reaches before it
        self.window_s = window_s
        self._released: deque[tuple[float, int]] = deque()
        self._total = 0

    def add(self, now: float, tokens: int) -> None:
        self._released.append((now, tokens))
        self._total += tokens

    def rate(self, now: float) -> float:
        """Tokens per second; 0 until some request has ended."""
        start = now - self.window_s
        while self._released and self._released[0][0] < start:
            self._total -= self._released.popleft()[1]
        span = min(self.window_s, now - self.since)
        return self._total / span if span > 0 else 0.0


class Saturation:
    """How much of the recent past the fleet was saturated: every worker had a queue, so none
    could start a new request at once. A time average, exponentially decayed with time constant
    `window_s`, of what each decision saw: the least wait among the workers says the fleet stays
    saturated that long (or until the next decision, whichever comes first).

    A worker free for a moment in a saturated fleet is not spare capacity: the next arrivals
    fill it anyway (`cost_terms` reads this to tell that moment from a lull).
    """

    def __init__(self, window_s: float = 10.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        self._value = 0.0  # as of `_since`
        self._busy_s = 0.0  # the least wait seen at `_since`
        self._since: float | None = None

    def observe(self, least_wait_s: float, now: float) -> float:
        """The saturated share up to `now` (the first observation starts the clock: 0); then
        record that every worker is busy for `least_wait_s` from now."""
        if self._since is not None and now > self._since:
            elapsed = now - self._since
            busy = min(self._busy_s, elapsed)
            decay = math.exp(-elapsed / self.window_s)
            # decay what was, then add the busy span [since, since + busy] as seen from now
            self._value = self._value * decay + math.exp((busy - elapsed) / self.window_s) - decay
        if self._since is None or now >= self._since:
            self._since = now
            self._busy_s = max(0.0, least_wait_s)
        return self._value


class LoadLedger:
    """request id -> Booking, and per-worker sums. Not thread-safe."""

    def __init__(self, drain_window_s: float = 60.0) -> None:
        self._bookings: dict[str, Booking] = {}
        self._loads: dict[str, WorkerLoad] = {}
        self._drains: dict[str, DrainRate] = {}
        self._drain_window_s = drain_window_s
        self._pushed = 0  # heap tie-breaker

    def __len__(self) -> int:
        return len(self._bookings)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._bookings

    def get(self, request_id: str) -> Booking | None:
        return self._bookings.get(request_id)

    def bookings(self) -> list[Booking]:
        """Every current booking, in booking order."""
        return list(self._bookings.values())

    def load(self, worker_id: str, now: float) -> WorkerLoad:
        """The worker's sums, with prefills predicted done by `now` aged out."""
        load = self._loads.get(worker_id)
        if load is None:
            load = self._loads[worker_id] = WorkerLoad()
        ahead, due = load.prefill_ahead, now - load.shift_s  # heap keys leave the shift out
        while ahead and ahead[0][0] <= due:
            _, _, booking = heapq.heappop(ahead)
            if self._bookings.get(booking.request_id) is booking and not booking.prefilled:
                booking.prefilled = True
                load.prefill_tokens -= booking.prefill_tokens
        return load

    def drain_rate(self, worker_id: str, now: float) -> float:
        """KV tokens per second the worker's ending requests released lately (0: none yet)."""
        drain = self._drains.get(worker_id)
        return 0.0 if drain is None else drain.rate(now)

    def held_prefix(self, worker_id: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` the worker's bookings hold: KV a request over
        that prefix shares with them instead of taking room of its own."""
        load = self._loads.get(worker_id)
        if load is None or not load.blocks:
            return 0
        held = load.blocks
        for i, h in enumerate(hashes):
            if h not in held:
                return i
        return len(hashes)

    def queue_s(self, worker_id: str, now: float) -> float:
        """Predicted seconds until the worker's booked prefill queue drains."""
        load = self._loads.get(worker_id)
        return 0.0 if load is None else max(0.0, load.busy_until - now)

    def book(self, booking: Booking, now: float) -> None:
        """Add a request's load to its worker; its prefill queues behind the booked ones."""
        if booking.request_id in self._bookings:
            raise ValueError(f"request {booking.request_id!r} is already booked")
        load = self.load(booking.worker_id, now)
        if booking.worker_id not in self._drains:
            self._drains[booking.worker_id] = DrainRate(now, self._drain_window_s)
        load.busy_until = max(load.busy_until, now) + booking.prefill_s
        booking.prefill_done_at = load.busy_until
        booking.shift_at_booking = load.shift_s
        load.requests += 1
        load.decode_tokens += booking.decode_tokens
        load.active_tokens += booking.active_tokens
        load.kv_tokens += self._hold(load, booking, 1)
        if booking.prefill_done_at > now:
            load.prefill_tokens += booking.prefill_tokens
            self._pushed += 1
            key = booking.prefill_done_at - load.shift_s
            heapq.heappush(load.prefill_ahead, (key, self._pushed, booking))
        else:
            booking.prefilled = True
        self._bookings[booking.request_id] = booking

    def first_token(self, request_id: str, now: float) -> Booking | None:
        """The request's first token is out: correct its worker's queue by the prediction's
        error (only the first call per booking counts; unknown ids return None)."""
        booking = self._bookings.get(request_id)
        if booking is None:
            return None
        if booking.started:
            return booking  # corrected already
        booking.started = True
        load = self._loads[booking.worker_id]  # corrected first, then aged with the correction
        error = now - self._done_at(load, booking)
        load.shift_s += error
        load.busy_until = max(now, load.busy_until + error)
        self.load(booking.worker_id, now)
        if not booking.prefilled:
            booking.prefilled = True
            load.prefill_tokens -= booking.prefill_tokens
        return booking

    @staticmethod
    def _hold(load: WorkerLoad, booking: Booking, step: int) -> int:
        """Take (`step` 1) or drop (-1) the booking's hold on its blocks; the KV tokens that
        adds or frees: its blocks no other booking there holds, its partial last block and
        its expected output."""
        held, alone = load.blocks, 0
        lone = 1 if step > 0 else 0  # the count of a block this booking alone holds
        for h in booking.hashes:
            n = held.get(h, 0) + step
            if n > 0:
                held[h] = n
            else:
                del held[h]
            alone += n == lone
        return booking.active_tokens - (len(booking.hashes) - alone) * booking.block_size

    @staticmethod
    def _done_at(load: WorkerLoad, booking: Booking) -> float:
        """The booking's predicted prefill end, with the corrections made since it was booked."""
        return booking.prefill_done_at + load.shift_s - booking.shift_at_booking

    def release(self, request_id: str, now: float) -> Booking | None:
        """Remove a request's load (finished, aborted, or rerouted); unknown ids return None.

        A request that ends before its predicted prefill end takes its own prefill time off the
        worker's queue; the queue resets when the worker has nothing booked.
        """
        booking = self._bookings.get(request_id)
        if booking is None:
            return None
        load = self.load(booking.worker_id, now)  # age out first: the sums must match the heap
        del self._bookings[request_id]
        freed = self._hold(load, booking, -1)
        self._drains[booking.worker_id].add(now, freed)
        load.requests -= 1
        load.decode_tokens -= booking.decode_tokens
        load.active_tokens -= booking.active_tokens
        load.kv_tokens -= freed
        if not booking.prefilled:  # ended (aborted) before its prefill was predicted done
            load.prefill_tokens -= booking.prefill_tokens
            load.busy_until -= min(booking.prefill_s, self._done_at(load, booking) - now)
        if load.requests == 0:
            self._loads[booking.worker_id] = WorkerLoad()
        return booking

    def drop_worker(self, worker_id: str) -> list[Booking]:
        """Release and return every booking on the worker (it died or was removed)."""
        gone = [b for b in self._bookings.values() if b.worker_id == worker_id]
        for booking in gone:
            del self._bookings[booking.request_id]
        self._loads.pop(worker_id, None)
        self._drains.pop(worker_id, None)
        return gone
