"""Admission: how many generation requests one router holds at once, and waiting them out.

A request is admitted (`enter`) when it arrives and leaves (`leave`) when its response has
been sent in full, streamed or not, or has failed. At `limit` requests in flight the next one
is refused at once with 429 and a `Retry-After` (`too_busy`), instead of waiting in a queue
that nothing bounds. On shutdown `drained` waits, up to a timeout, for the admitted requests
to end, so that a SIGTERM does not cut streams short.
"""

from __future__ import annotations

import asyncio

from router.errors import APIError


class Admission:
    """The in-flight count of one router against its limit (0: no limit)."""

    def __init__(self, limit: int = 0, retry_after_s: int = 1) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> bool:
        """Admits one request; False (not admitted) at the limit."""
        if self.limit and self.in_flight >= self.limit:
            return False
        self.in_flight += 1
        self._idle.clear()
        return True

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def drained(self, timeout_s: float) -> bool:
        """Waits until no request is in flight, at most `timeout_s`; True when none is."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


    def too_busy(self) -> APIError:
        """The error a request refused at the limit gets (with `Retry-After: retry_after_s`)."""
        return APIError(
            429,
            f"The router is at its limit of {self.limit} requests in flight; retry later.",
            code="too_many_requests",
            type_="rate_limit_error",
        )
