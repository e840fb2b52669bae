"""A dependency-free progress bar on stderr, redrawn at most ~10 times a second."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """`update(done)` redraws `label [#####     ] done/total` in place; `close()` ends the line.

    Silent when `enabled` is False (e.g. `--json` piped into a file still shows the bar, since it
    goes to stderr; tests pass enabled=False).
    """

    def __init__(
        self, total: int, label: str = "", enabled: bool = True, stream: TextIO | None = None
    ) -> None:
        self.total = max(total, 1)
        self.label = label
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self._last = 0.0
        self._done = 0

    def update(self, done: int, extra: str = "") -> None:
        self._done = done
        now = time.monotonic()
        if not self.enabled or (now - self._last < 0.1 and done < self.total):
            return
        self._last = now
        filled = int(30 * min(done, self.total) / self.total)
        bar = "#" * filled + " " * (30 - filled)
        self.stream.write(f"\r{self.label} [{bar}] {done}/{self.total} {extra}".rstrip() + " ")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._last = 0.0
            self.update(self._done)
            self.stream.write("\n")
            self.stream.flush()
