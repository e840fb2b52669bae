"""Streaming sessions on the engine side: the KV a session keeps between its turns.

After a turn of a request with `session_id`, its KV is parked here instead of being released,
so the next turn prefills only what is new. The parked KV has two regions, by token position:

    [0, prefix_len)          owned by the radix tree, protected by the session's lock on `node`
    [prefix_len, alloc_len)  owned by the session (whole pages), counted in `kv_session`

The table only stores; every change of KV ownership happens in `worker.kv_memory.KVMemory`.
It also tells the routers which sessions this worker holds (`take_events`): a session is held
while it is parked here or one of its turns runs here, so a turn taken out for its next prompt
does not flicker, and every router replica can send a session's next turn to its KV.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from mem_cache.events import KVEvent, SessionHeld, SessionReleased


@dataclass(eq=False)
class ParkedSession:
    """KV of `tokens` (those with computed KV) in `slots` (`alloc_len` of them)."""

    session_id: str
    namespace: str | None
    tokens: list[int]
    slots: torch.Tensor
    prefix_len: int
    node: Any
    ttl_s: float
    expires_at: float
    state_slot: int | None = None  # recurrent models: the state after `tokens`

    @property
    def alloc_len(self) -> int:
        return int(self.slots.numel())

    @property
    def owned_len(self) -> int:
        """Slots the session owns itself (not through the tree)."""
        return self.alloc_len - self.prefix_len


class SessionTable:
    """session id -> ParkedSession, with expiry."""

    def __init__(self) -> None:
        self._parked: dict[str, ParkedSession] = {}
        self._changed: set[str] = set()  # put or popped since the last take_events
        self._running: set[str] = set()  # sessions with a running turn at the last take_events
        self._published: set[str] = set()  # held, as the last take_events told the routers

    def __len__(self) -> int:
        return len(self._parked)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._parked

    def get(self, session_id: str) -> ParkedSession | None:
        return self._parked.get(session_id)

    def put(self, parked: ParkedSession) -> None:
        assert parked.session_id not in self._parked, "park over a live session: drop it first"
        self._parked[parked.session_id] = parked
        self._changed.add(parked.session_id)

    def pop(self, session_id: str) -> ParkedSession | None:
        parked = self._parked.pop(session_id, None)
        if parked is not None:
            self._changed.add(session_id)
        return parked

    def take_events(self, running: Collection[str]) -> list[KVEvent]:
        """`SessionHeld` / `SessionReleased` for the sessions whose holding changed since the
        last call; `running` are the session ids of the turns running now (a turn that ends,
        is aborted or is retracted leaves it)."""
        running = set(running)
        self._changed |= running ^ self._running
        self._running = running
        events: list[KVEvent] = []
        for sid in sorted(self._changed):
            held = sid in self._parked or sid in running
            if held and sid not in self._published:
                self._published.add(sid)
                events.append(SessionHeld(sid))
            elif not held and sid in self._published:
                self._published.discard(sid)
                events.append(SessionReleased(sid))
        self._changed.clear()
        return events

    def held_events(self) -> list[KVEvent]:
        """`SessionHeld` for every session published as held (for a snapshot; call after
        `take_events`)."""
        return [SessionHeld(sid) for sid in sorted(self._published)]

    def expired(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return [sid for sid, p in self._parked.items() if p.expires_at <= now]

    def oldest(self) -> str | None:
        """The session that expires first: the one to drop under memory pressure."""
        if not self._parked:
            return None
        return min(self._parked.values(), key=lambda p: p.expires_at).session_id

    def owned_tokens(self) -> int:
        return sum(p.owned_len for p in self._parked.values())

    def values(self) -> list[ParkedSession]:
        return list(self._parked.values())
