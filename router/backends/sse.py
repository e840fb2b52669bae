"""Reading a server-sent-events body of the OpenAI streaming API."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any


async def sse_json(lines: AsyncIterable[bytes]) -> AsyncIterator[Any]:
    """The JSON payload of every `data:` line, up to `data: [DONE]`; other lines are skipped.

    Raises `ValueError` (json's) on a payload that is not JSON.
    """
    async for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)
