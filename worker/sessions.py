"""Streaming sessions on the engine side: the KV a session keeps between its turns.

After a turn of a request with `session_id`, its KV is parked here instead of being released,
so the next turn prefills only what is new. The parked KV has two regions, by token position:

    [0, prefix_len)          owned by the radix tree, protected by the session's lock on `node`
    [prefix_len, alloc_len)  owned by the session (whole pages), counted in `kv_session`

The table only stores; every change of KV ownership happens in `worker.kv_memory.KVMemory`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


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

    def __len__(self) -> int:
        return len(self._parked)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._parked

    def get(self, session_id: str) -> ParkedSession | None:
        return self._parked.get(session_id)

    def put(self, parked: ParkedSession) -> None:
        assert parked.session_id not in self._parked, "park over a live session: drop it first"
        self._parked[parked.session_id] = parked

    def pop(self, session_id: str) -> ParkedSession | None:
        return self._parked.pop(session_id, None)

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
