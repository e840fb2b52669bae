"""Mooncake-format request traces, replayed at block granularity.

A trace is JSON lines (plain or gzipped), one request a line: `timestamp` (ms), `input_length`,
`output_length` (tokens) and `hash_ids`, one id per `TRACE_BLOCK_TOKENS`-token block of the
prompt (the last block may be partial). Two requests share their first k ids exactly when their
first k blocks are identical, so the ids serve directly as the key elements of a block-granular
radix cache: one key element stands for one 512-token block.

Production traces round timestamps into buckets (the Mooncake conversation trace: ~3 s apart);
replaying every request of a bucket at the same instant would turn smooth traffic into bursts, so
`replay` spreads the requests of a bucket evenly over the gap to the next bucket.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

TRACE_BLOCK_TOKENS = 512


@dataclass(slots=True)
class SimRequest:
    """One request of a workload: `blocks` are its prompt's key elements, one per block.

    `arrival_s` is in simulated seconds from the start. `session_id` pins multi-turn chats.
    """

    request_id: str
    arrival_s: float
    input_length: int
    output_length: int
    blocks: list[int]
    session_id: str | None = None
    extra: dict = field(default_factory=dict)


def read_trace(path: str | Path) -> list[dict]:
    """The raw rows of a JSON-lines trace (`.gz` suffix or gzip magic: gunzipped)."""
    path = Path(path)
    with open(path, "rb") as probe:
        gzipped = probe.read(2) == b"\x1f\x8b"
    opener = gzip.open if gzipped else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                _check_row(row)
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a trace row: {exc}") from exc
            rows.append(row)
    return rows


def _check_row(row: dict) -> None:
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in row:
            raise KeyError(key)
    if int(row["input_length"]) < 0 or int(row["output_length"]) < 0:
        raise ValueError("negative length")
    if not isinstance(row["hash_ids"], list):
        raise TypeError("hash_ids must be a list")


def replay(
    rows: list[dict],
    speed: float = 1.0,
    spread: bool = True,
    seed: int = 0,
    limit: int | None = None,
) -> list[SimRequest]:
    """Requests in arrival order; time divided by `speed`, buckets spread evenly.

    Within a bucket (requests sharing one timestamp) the order of the trace is kept; a small
    seeded jitter keeps evenly spaced arrivals from lining up across buckets.
    """
    if speed <= 0:
        raise ValueError(f"speed must be positive, got {speed}")
    rows = sorted(rows[:limit] if limit else rows, key=lambda r: r["timestamp"])
    rng = random.Random(seed)
    stamps = sorted({r["timestamp"] for r in rows})
    gaps = {t: (b - t) for t, b in zip(stamps, stamps[1:], strict=False)}
    typical_gap = _median(list(gaps.values())) if gaps else 0.0
    counts: dict[int, int] = {}
    for r in rows:
        counts[r["timestamp"]] = counts.get(r["timestamp"], 0) + 1
    out: list[SimRequest] = []
    seen: dict[int, int] = {}
    for i, r in enumerate(rows):
        t = r["timestamp"]
        k = seen.get(t, 0)
        seen[t] = k + 1
        offset_ms = 0.0
        if spread and counts[t] > 1:
            gap = min(gaps.get(t, typical_gap), typical_gap) or typical_gap
            offset_ms = (k + rng.random()) * gap / counts[t]
        out.append(
            SimRequest(
                request_id=f"r{i}",
                arrival_s=(t + offset_ms) / 1000.0 / speed,
                input_length=int(r["input_length"]),
                output_length=max(1, int(r["output_length"])),
                blocks=[int(h) for h in r["hash_ids"]],
            )
        )
    out.sort(key=lambda q: q.arrival_s)
    return out


def _median(values: list[float]) -> float:
    values = sorted(values)
    return float(values[len(values) // 2]) if values else 0.0


def load_trace(
    path: str | Path, speed: float = 1.0, seed: int = 0, limit: int | None = None
) -> list[SimRequest]:
    """`read_trace` then `replay`."""
    return replay(read_trace(path), speed=speed, seed=seed, limit=limit)
