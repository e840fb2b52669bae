"""What the stall deadline costs per streamed chunk on the router's hot path.

`Choice._receive` returns the next chunk of an attempt; with `stall_timeout_s` set it must
also notice a worker that sends nothing. This times `_receive` over a stream of chunks that are
ready at once (the router's cost alone; a real chunk also waits on the network), with the
deadline off and on, next to a bare `__anext__` on the same stream.

    python bench/bench_stall_watchdog.py [--chunks 200000] [--runs 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router.dispatch import Choice  # noqa: E402
from router.metrics import RouterMetrics  # noqa: E402
from router.routing.registry import WorkerState  # noqa: E402
from worker.protocol import (  # noqa: E402
    EngineShape,
    GenerateRequest,
    SamplingParams,
    TokenChunk,
)


async def chunks(n: int) -> AsyncIterator[TokenChunk]:
    for i in range(n):
        yield TokenChunk("r", [i % 100], None)


def dispatch(n: int, stall_timeout_s: float | None) -> Choice:
    """A Choice mid-attempt on a stream of `n` ready chunks (no routing core involved)."""
    owner = SimpleNamespace(
        core=None, registry=None, metrics=RouterMetrics(), stall_timeout_s=stall_timeout_s
    )
    request = GenerateRequest("r", [1, 2, 3], SamplingParams(max_tokens=n))
    run = Choice(owner, 0, request, SimpleNamespace(sampling=request.sampling))  # type: ignore[arg-type]
    run.worker_id = "w0"
    run._worker = WorkerState("w0", EngineShape())
    run._stream = chunks(n).__aiter__()
    return run


async def per_chunk_us(n: int, way: str) -> float:
    run = dispatch(n, 30.0 if way == "deadline on" else None)
    t0 = time.perf_counter()
    if way == "bare __anext__":
        stream = run._stream
        for _ in range(n):
            await stream.__anext__()
    else:
        for _ in range(n):
            await run._receive()
    elapsed = time.perf_counter() - t0
    await run.close()
    return elapsed / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    ways = ("bare __anext__", "deadline off", "deadline on")
    figures: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(args.runs):
        for way in ways:  # interleaved, so machine noise hits each alike
            figures[way].append(asyncio.run(per_chunk_us(args.chunks, way)))
    print(f"{args.chunks} chunks per run, {args.runs} runs; us per chunk (median, min-max)")
    for way in ways:
        values = figures[way]
        print(
            f"  {way:15s} {statistics.median(values):7.3f}  ({min(values):.3f}-{max(values):.3f})"
        )


if __name__ == "__main__":
    main()
