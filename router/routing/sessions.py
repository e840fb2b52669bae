"""Session pins: session id -> the worker that holds the session's KV, with a TTL.

A session (header `X-Session-ID` or body field `session_id`) stays on its worker, whose cache
holds its history. The pin is soft: `RoutingCore` follows it only while the worker is alive, not
draining, not excluded, and not far costlier than the best choice (`should_yield`). Every turn
renews the TTL; an expired pin is gone at the next look-up.

Pins are this router's own. Workers also say which sessions they hold (`SessionHeld` /
`SessionReleased` in their KV events), and every replica reads every worker's events, so a
turn that comes through a replica that never routed the session still finds its KV. When the
pin and the workers' word disagree, the newer fact wins: a pin is as new as the turn it routed,
a holding as new as the event that reported it.
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
    pinned_at: float


class SessionTable:
    """session id -> worker id with a TTL. Not thread-safe."""

    def __init__(
        self, config: SessionConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or SessionConfig()
        self._clock = clock
        self._pins: OrderedDict[str, _Pin] = OrderedDict()  # least recently renewed first
        # session id -> {worker id: when its SessionHeld arrived}; the workers bound this (each
        # holds what its KV can) and release what they drop, so it needs no TTL of its own.
        self._held: dict[str, dict[str, float]] = {}

    def __len__(self) -> int:
        """Sessions this router knows: pinned here or held by a worker."""
        self.expire()
        return len(self._held) + sum(1 for s in self._pins if s not in self._held)

    def get(self, session_id: str) -> str | None:
        """The session's worker: the newer of this router's pin and the latest worker that
        reported holding it; None if neither is known (or the pin expired)."""
        pin = self._pins.get(session_id)
        if pin is not None and pin.expires_at <= self._clock():
            del self._pins[session_id]
            pin = None
        holders = self._held.get(session_id)
        if holders:
            worker_id, held_at = max(holders.items(), key=lambda item: item[1])
            if pin is None or held_at > pin.pinned_at:
                return worker_id
        return None if pin is None else pin.worker_id

    def pin(self, session_id: str, worker_id: str) -> None:
        """Pin (or re-pin) the session to the worker and renew its TTL."""
        self._pins.pop(session_id, None)
        now = self._clock()
        self._pins[session_id] = _Pin(worker_id, now + self.config.ttl_s, now)
        self.expire()

    def held(self, worker_id: str, session_id: str, moved: bool = False) -> list[str]:
        """The worker reports holding the session's KV (a `SessionHeld` event). With `moved`
        (the report of a live batch: a worker reports a session when a turn of it starts
        there, so the session has just moved to it), the other holders' copies are stale:
        their reports are dropped and their ids returned, for the caller to close there."""
        holders = self._held.setdefault(session_id, {})
        stale = [w for w in holders if w != worker_id] if moved else []
        for other in stale:
            del holders[other]
        holders[worker_id] = self._clock()
        return stale

    def released(self, worker_id: str, session_id: str) -> None:
        """The worker reports dropping the session's KV (a `SessionReleased` event): closed
        (perhaps through another replica), expired or pushed out. A pin to that worker goes
        too: nothing is left there to follow."""
        pin = self._pins.get(session_id)
        if pin is not None and pin.worker_id == worker_id:
            del self._pins[session_id]
        self._forget(worker_id, session_id)

    def _forget(self, worker_id: str, session_id: str) -> None:
        holders = self._held.get(session_id)
        if holders is not None:
            holders.pop(worker_id, None)
            if not holders:
                del self._held[session_id]

    def forget_holdings(self, worker_id: str) -> None:
        """The worker's holdings are void (its events restart from a snapshot, or it left)."""
        for session_id in [s for s, holders in self._held.items() if worker_id in holders]:
            self._forget(worker_id, session_id)

    def close(self, session_id: str) -> bool:
        """Forget a session; True if it was pinned (and not expired) or held by a worker.
        (The workers confirm the release with their `SessionReleased` events.)"""
        pin = self._pins.pop(session_id, None)
        held = self._held.pop(session_id, None)
        return bool(held) or (pin is not None and pin.expires_at > self._clock())

    def drop_worker(self, worker_id: str) -> list[str]:
        """Unpin every session of a worker (it died or left) and forget its holdings; returns
        the ids of the sessions that were pinned to it."""
        gone = [s for s, pin in self._pins.items() if pin.worker_id == worker_id]
        for session_id in gone:
            del self._pins[session_id]
        self.forget_holdings(worker_id)
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
