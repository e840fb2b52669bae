"""How often requests arrive that want a given worker: the ones whose longest cached prefix
lives there.

A worker that holds many live conversations gets their next turns. A long prefill routed to it
makes every one of those turns wait behind it, or give up its cached prefix by going elsewhere.
`cost` weighs that harm with the rate measured here (`router.cost_model`, `scores`).

The rate is an exponentially decayed count: each arrival adds one, shared evenly among the
workers that hold its longest match, and the count decays with time constant `window_s`; the
rate is count / window_s (arrivals per second, averaged over about the last window).
"""

from __future__ import annotations

import math
from collections.abc import Collection


class AffinityRates:
    """worker id -> decayed count of arrivals that found their longest prefix there."""

    def __init__(self, window_s: float = 30.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        self._counts: dict[str, tuple[float, float]] = {}  # worker id -> (count, as of time)

    def add(self, worker_ids: Collection[str], now: float) -> None:
        """One arrival whose longest cached prefix is on each of `worker_ids` (none: no-op)."""
        if not worker_ids:
            return
        share = 1.0 / len(worker_ids)
        for worker_id in worker_ids:
            self._counts[worker_id] = (self._count(worker_id, now) + share, now)

    def rate(self, worker_id: str, now: float) -> float:
        """Arrivals per second that wanted the worker, lately (0 for an unknown worker)."""
        return self._count(worker_id, now) / self.window_s

    def drop(self, worker_id: str) -> None:
        self._counts.pop(worker_id, None)

    def _count(self, worker_id: str, now: float) -> float:
        count, since = self._counts.get(worker_id, (0.0, now))
        if now <= since:
            return count
        return count * math.exp((since - now) / self.window_s)
