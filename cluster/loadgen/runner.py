"""Send a list of requests to a target: open loop (arrival times or a Poisson rate) or closed
loop (a fixed number in flight), bounded by a count and a duration."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import aiohttp

from cluster.loadgen.client import Outcome, Target, send
from cluster.loadgen.prompts import BenchRequest
from cluster.progress import Progress


@dataclass(slots=True)
class RunConfig:
    """rate: Poisson requests/s; concurrency: requests in flight (closed loop); neither: the
    workload's own arrival times. num_requests / duration_s: stop issuing after that many /
    that long (requests already sent still finish). timeout_s: per request."""

    rate: float | None = None
    concurrency: int | None = None
    num_requests: int | None = None
    duration_s: float | None = None
    timeout_s: float = 600.0
    seed: int = 0


def schedule(requests: list[BenchRequest], cfg: RunConfig) -> list[float]:
    """Send offsets (s from the start) for the open loop."""
    if cfg.rate:
        rng, t, out = random.Random(cfg.seed), 0.0, []
        for _ in requests:
            out.append(t)
            t += rng.expovariate(cfg.rate)
        return out
    first = requests[0].arrival_s if requests else 0.0
    return [r.arrival_s - first for r in requests]


async def run(
    target: Target, requests: list[BenchRequest], cfg: RunConfig, progress: bool = True
) -> tuple[list[Outcome], float]:
    """All outcomes (in completion order) and the wall time from first send to last answer."""
    requests = requests[: cfg.num_requests] if cfg.num_requests else requests
    bar = Progress(len(requests), "bench", enabled=progress)
    outcomes: list[Outcome] = []
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    # Idle connections are dropped before common servers' keep-alive timeouts (uvicorn: 5 s),
    # so that a request never goes out on a connection the server is closing.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0)
    started = time.perf_counter()
    deadline = started + cfg.duration_s if cfg.duration_s else float("inf")

    async def one(req: BenchRequest, http: aiohttp.ClientSession) -> None:
        outcomes.append(await send(http, target, req))
        bar.update(len(outcomes), f"errors {sum(o.error is not None for o in outcomes)}")

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        if cfg.concurrency:
            queue = iter(requests)

            async def loop() -> None:
                for req in queue:
                    if time.perf_counter() >= deadline:
                        return
                    await one(req, http)

            await asyncio.gather(*(loop() for _ in range(cfg.concurrency)))
        else:
            tasks = []
            for req, offset in zip(requests, schedule(requests, cfg), strict=True):
                delay = started + offset - time.perf_counter()
                if started + offset >= deadline:
                    break
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(req, http)))
            await asyncio.gather(*tasks)
    bar.close()
    return outcomes, time.perf_counter() - started
