"""How much a worker is wanted: the arrivals whose longest cached prefix lives there, and the
prompt tokens routed there lately.

A worker that holds many live conversations gets their next turns. A long prefill routed to it
makes every one of those turns wait behind it, or give up its cached prefix by going elsewhere.
`cost` weighs that harm with the two rates measured here (`cost_terms`: affinity, demand):

- `rate`: arrivals per second that found their longest match on the worker (each arrival adds
  one, shared evenly among the workers that hold its longest match);
- `demand`: prompt tokens per second routed to the worker. A routed prompt is cached there
  afterwards, and the conversation's next turn will want it: the next turns the worker is
  expected to get, weighed by what they would have to recompute elsewhere. Unlike `rate` it
  counts a conversation from its first turn and tells a 90k-token conversation from a 2k-token
  system prompt.

Both are exponentially decayed sums with time constant `window_s`, divided by `window_s`
(averages over about the last window).
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
        self._tokens: dict[str, tuple[float, float]] = {}  # worker id -> (tokens, as of time)

    def add(self, worker_ids: Collection[str], now: float) -> None:
        """One arrival whose longest cached prefix is on each of `worker_ids` (none: no-op)."""
        if not worker_ids:
            return
        share = 1.0 / len(worker_ids)
        for worker_id in worker_ids:
            self._counts[worker_id] = (self._decayed(self._counts, worker_id, now) + share, now)

    def add_demand(self, worker_id: str, tokens: int, now: float) -> None:
        """A prompt of `tokens` tokens was routed to the worker."""
        self._tokens[worker_id] = (self._decayed(self._tokens, worker_id, now) + tokens, now)

    def rate(self, worker_id: str, now: float) -> float:
        """Arrivals per second that wanted the worker, lately (0 for an unknown worker)."""
        return self._decayed(self._counts, worker_id, now) / self.window_s

    def demand(self, worker_id: str, now: float) -> float:
        """Prompt tokens per second routed to the worker lately (0 for an unknown worker)."""
        return self._decayed(self._tokens, worker_id, now) / self.window_s

    def drop(self, worker_id: str) -> None:
        self._counts.pop(worker_id, None)
        self._tokens.pop(worker_id, None)

    def _decayed(self, sums: dict[str, tuple[float, float]], worker_id: str, now: float) -> float:
        value, since = sums.get(worker_id, (0.0, now))
        if now <= since:
            return value
        return value * math.exp((since - now) / self.window_s)
