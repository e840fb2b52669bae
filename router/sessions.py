"""Session pins: session id -> the worker that holds the session's KV, with a TTL.

A session (header `X-Session-ID` or body field `session_id`) stays on its worker, whose cache
holds its history. The pin is soft: `RoutingCore` follows it only while the worker is alive, not
draining, not excluded, and not far costlier than the best choice (`should_yield`). Every turn
renews the TTL; an expired pin is gone at the next look-up.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class SessionConfig:
    """Session pin lifetime and how much worse than the best a pinned worker may be."""

    ttl_s: float = 600.0  # a pin not used for this long is dropped (the engine's default too)
    yield_factor: float = 2.0  # leave the pin when its cost > factor x best cost + slack
    yield_slack_s: float = 0.25


@dataclass(slots=True)
class _Pin:
    worker_id: str
    expires_at: float


class SessionTable:
    """session id -> worker id with a TTL. Not thread-safe."""

    def __init__(
        self, config: SessionConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or SessionConfig()
        self._clock = clock
        self._pins: OrderedDict[str, _Pin] = OrderedDict()  # least recently renewed first

    def __len__(self) -> int:
        self.expire()
        return len(self._pins)

    def get(self, session_id: str) -> str | None:
        """The pinned worker, or None if the session is unknown or expired."""
        pin = self._pins.get(session_id)
        if pin is None:
            return None
        if pin.expires_at <= self._clock():
            del self._pins[session_id]
            return None
        return pin.worker_id

    def pin(self, session_id: str, worker_id: str) -> None:
        """Pin (or re-pin) the session to the worker and renew its TTL."""
        self._pins.pop(session_id, None)
        self._pins[session_id] = _Pin(worker_id, self._clock() + self.config.ttl_s)
        self.expire()

    def close(self, session_id: str) -> bool:
        """Forget a session; True if it was pinned (and not expired)."""
        pin = self._pins.pop(session_id, None)
        return pin is not None and pin.expires_at > self._clock()

    def drop_worker(self, worker_id: str) -> list[str]:
        """Unpin every session of a worker (it died or left); returns their ids."""
        gone = [s for s, pin in self._pins.items() if pin.worker_id == worker_id]
        for session_id in gone:
            del self._pins[session_id]
        return gone

    def expire(self) -> int:
        """Drop expired pins (oldest first, so this stops at the first live one)."""
        now = self._clock()
        dropped = 0
        while self._pins:
            session_id, pin = next(iter(self._pins.items()))
            if pin.expires_at > now:
                break
            del self._pins[session_id]
            dropped += 1
        return dropped

    def should_yield(self, pinned_cost: float, best_cost: float) -> bool:
        """True when the pinned worker is far costlier than the best (see SessionConfig)."""
        return pinned_cost > self.config.yield_factor * best_cost + self.config.yield_slack_s
