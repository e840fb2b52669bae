"""What routing sees: the request (`RouteRequest`), each candidate worker with the core's
estimate of the request there (`WorkerView`, `Estimate`), and the choice (`Decision`).

`RoutingCore` builds them once per request; policies read them and choose. They hold numbers
only, copied from the worker's record and the core's ledger, index and rates for this one
decision: nothing here outlives it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from worker.protocol import WorkerStats


class Estimate(NamedTuple):
    """Predicted seconds for one request on one worker (`wait_s + prefill_s + step_s` is its
    TTFT there), and the speeds they come from."""

    wait_s: float  # prefill queued ahead + wait for a running slot or KV room
    prefill_s: float  # its own prefill, cached prefix skipped, host hit loaded back
    step_s: float  # the step that emits its first token
    effective_tokens_per_s: float  # prefill speed with its running requests decoding alongside
    prefill_tokens_per_s: float  # prefill speed with no decode alongside
    joined_step_s: float  # a decode step once it has joined the batch

    @property
    def ttft_s(self) -> float:
        return self.wait_s + self.prefill_s + self.step_s


NO_ESTIMATE = Estimate(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


@dataclass(slots=True)
class WorkerView:
    """What a policy sees of one worker for one request (filled by `RoutingCore`; read-only)."""

    worker_id: str
    stats: WorkerStats | None = None  # last reported, None until the first report
    matched_blocks: int = 0  # leading blocks of the request on its device (index's belief)
    host_blocks: int = 0  # further blocks found only on its host tier
    cached_blocks: int = 0  # blocks the index holds for it in all: its cache's size
    requests: int = 0  # routed here and not finished (booked)
    prefill_tokens: int = 0  # booked uncached prompt tokens whose prefill is still ahead
    decode_tokens: int = 0  # booked expected output tokens
    active_tokens: int = 0  # booked contexts: prompt + expected output, each request's own
    kv_tokens: int = 0  # the KV those hold: a prefix several of them share counted once
    held_blocks: int = 0  # leading blocks of the request those hold already: KV it shares
    drain_tokens_per_s: float = 0.0  # KV its ending requests released lately (0: none yet)
    queue_s: float = 0.0  # predicted seconds until its booked prefill queue drains
    affinity_rate: float = 0.0  # arrivals/s lately whose longest cached prefix is here
    demand_tokens_per_s: float = 0.0  # prompt tokens/s routed here lately (`affinity`)
    # requests its last stats counted beyond this router's bookings when they arrived (other
    # routers'): fixed until the next stats, so releases since then do not look like load
    foreign_requests: int = 0
    max_running: int = 64  # its engine's shape (`worker.protocol.EngineShape`)
    prefill_budget: int = 512
    estimate: Estimate = NO_ESTIMATE  # the request on this worker (`estimate`)

    @property
    def load(self) -> int:
        """Requests on the worker: booked here, plus other routers' as last reported."""
        return self.requests + self.foreign_requests


@dataclass(slots=True)
class RouteRequest:
    """The request as routing sees it: sizes only, never text."""

    request_id: str
    num_tokens: int
    num_blocks: int  # full blocks (len of its block hashes)
    expected_output: int = 0
    block_size: int = 16
    session_id: str | None = None
    fleet_tokens_per_s: float = 0.0  # the fleet's median prefill speed now (`speeds`)
    saturation: float = 0.0  # share of the recent past no worker was free (`bookings`)


@dataclass(slots=True)
class Decision:
    """The chosen worker, why, and the prefix hit the index predicts there (tokens)."""

    worker_id: str
    reason: str
    cached_tokens: int = 0
    host_tokens: int = 0
