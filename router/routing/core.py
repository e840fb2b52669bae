"""RoutingCore: the prefix index, the estimate, a policy, the session pins and the booked load.

The live router (`router/api/app.py`) and the simulator (`cluster/sim/`) both drive this object, so
they route identically. The clock is injected: the simulator passes its simulated time. The
workers are the registry's (`registry`); the core follows its membership as a listener
and reads each worker's record (state, shape, stats, event cursor) when it routes.

The life of one request:
    route(request_id, hashes, ...) -> Decision    books its load on the chosen worker, records
                                                  optimistic index entries, renews its session
    ... the worker serves it; its KV events reach apply_events(batch) ...
    finish(request_id, cached_tokens)             releases the booking
A failed request may be routed again under the same id (with the dead worker in `exclude`):
the old booking is released first.

Not thread-safe: one owner (an asyncio loop, the simulator) calls it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace

from mem_cache.events import AllCleared, KVEvent, SessionHeld, SessionReleased, decode_batch
from router.routing.affinity import AffinityRates
from router.routing.bookings import Booking, LoadLedger, Saturation
from router.routing.candidates import Decision, RouteRequest, WorkerView
from router.routing.estimate import EstimateConfig, Estimator
from router.routing.policies import DEFAULT_POLICY, Policy, PolicyConfig, make_policy
from router.routing.prefix_index import IndexConfig, PrefixIndex
from router.routing.registry import DEAD, WorkerRegistry, WorkerState
from router.routing.sessions import SessionConfig, SessionTable
from worker.protocol import EngineShape, WorkerStats

# every routing decision at DEBUG: the request, the choice, and each candidate's view of it
decisions = logging.getLogger("radixray.router.decisions")


@dataclass
class CoreConfig:
    """Routing configuration; `block_size`: the block size until a worker reports its own."""

    policy: str = DEFAULT_POLICY
    block_size: int = 16
    index: IndexConfig = field(default_factory=IndexConfig)
    estimate: EstimateConfig = field(default_factory=EstimateConfig)
    policies: PolicyConfig = field(default_factory=PolicyConfig)
    sessions: SessionConfig = field(default_factory=SessionConfig)


class NoWorkerError(RuntimeError):
    """No worker can take the request (none registered, all draining or excluded)."""


class RoutingCore:
    """Routes requests to workers; see the module docstring for the call sequence."""

    def __init__(
        self,
        policy: Policy | str | None = None,
        clock: Callable[[], float] = time.monotonic,
        block_size: int | None = None,
        config: CoreConfig | None = None,
        registry: WorkerRegistry | None = None,
    ) -> None:
        """`policy`: a Policy object, a policy name, or None for `config.policy`; `block_size`
        overrides `config.block_size`; `clock` (seconds) drives TTLs and booked load;
        `registry`: the workers (default: a new one), whose membership the core follows."""
        self.config = config or CoreConfig()
        if block_size is not None:
            self.config = replace(self.config, block_size=block_size)
        if not isinstance(policy, Policy):
            policy = make_policy(policy or self.config.policy, self.config.policies)
        self.clock = clock
        self.policy = policy
        self.estimator = Estimator(self.config.estimate)
        self.index = PrefixIndex(self.config.index, clock)
        self.sessions = SessionTable(self.config.sessions, clock)
        self._stale_sessions: list[tuple[str, str]] = []  # (worker id, session id) to close
        self.ledger = LoadLedger()
        self.affinity = AffinityRates(self.config.estimate.affinity_window_s)
        self.saturation = Saturation(self.config.estimate.saturation_window_s)
        self.registry = registry or WorkerRegistry(EngineShape(block_size=self.config.block_size))
        self.registry.subscribe(self)

    # --- workers ---------------------------------------------------------------------------

    def add_worker(
        self, worker_id: str, stats: WorkerStats | None = None, shape: EngineShape | None = None
    ) -> WorkerState:
        """Register a worker in the registry (`WorkerRegistry.add`: a fresh record) with its
        first stats. Its index fills from a snapshot batch: fetch one from the worker and pass
        it to `apply_events` (`event_cursor` is None until then)."""
        worker = self.registry.add(worker_id, shape)
        if stats is not None:
            self.update_stats(stats)  # which re-derives the fleet's speeds
        return worker

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker for good (`WorkerRegistry.remove`); unknown ids are ignored."""
        self.registry.remove(worker_id)

    def worker_joined(self, worker: WorkerState) -> None:
        """(Registry listener.) A new record: an empty index entry for it."""
        self.index.add_worker(worker.worker_id)

    def worker_left(self, worker_id: str) -> None:
        """(Registry listener.) The worker left routing (removed or dead): forget its index
        entries, bookings, session pins and rates."""
        self._observe_fleet()
        self.index.remove_worker(worker_id)
        self.sessions.drop_worker(worker_id)
        self.affinity.drop(worker_id)
        self.ledger.drop_worker(worker_id)

    def update_stats(self, stats: WorkerStats) -> None:
        """Latest stats of a live worker; stats of unknown or dead workers are ignored."""
        worker = self.registry.get(stats.worker_id)
        if worker is not None and worker.state != DEAD:
            worker.stats = stats
            booked = self.ledger.load(stats.worker_id, self.clock()).requests
            worker.foreign_requests = max(0, stats.running + stats.waiting - booked)
            self._observe_fleet()

    def _observe_fleet(self) -> None:
        self.estimator.observe_fleet(w.stats for w in self.registry.live())

    def workers(self) -> list[WorkerView]:
        """Every live worker's view with its current booked load (match fields zero)."""
        now = self.clock()
        return [self._view(w, now) for w in self.registry.live()]

    # --- events ----------------------------------------------------------------------------

    def apply_events(self, batch: bytes) -> bool:
        """Apply one encoded event batch (`mem_cache.events.encode_batch`).

        Returns False when events were missed (a gap in `seq`, a new epoch, or no snapshot yet):
        nothing is applied; the caller fetches a snapshot (`kv_events` from `event_cursor`) and
        passes it here. Raises `ValueError` on malformed bytes.
        """
        batch_ = decode_batch(batch)
        worker = self.registry.get(batch_.worker_id)
        if worker is None or worker.state == DEAD:
            return True  # a worker not (or no longer) routed to: nothing to apply
        snapshot = is_snapshot(batch_.events)
        step = next_batch(worker.cursor, batch_.epoch, batch_.seq, snapshot)
        if step == GAP:
            return False
        if step == APPLY:
            self._apply(batch_.worker_id, batch_.events, snapshot)
            worker.cursor = (batch_.epoch, batch_.seq)
        return True

    def _apply(self, worker_id: str, events: Sequence[KVEvent], snapshot: bool) -> None:
        """A worker's events, in order: blocks to the index, held sessions to the pins (a
        session that moved here leaves stale copies elsewhere: `take_stale_sessions`)."""
        self.index.apply(worker_id, events)
        moved = not snapshot  # a snapshot re-lists what the worker holds
        for event in events:
            if isinstance(event, SessionHeld):
                for other in self.sessions.held(worker_id, event.session_id, moved):
                    self._stale_sessions.append((other, event.session_id))
            elif isinstance(event, SessionReleased):
                self.sessions.released(worker_id, event.session_id)
            elif isinstance(event, AllCleared):
                self.sessions.forget_holdings(worker_id)

    def take_stale_sessions(self) -> list[tuple[str, str]]:
        """(worker id, session id) of session copies left behind since the last call: the
        session's turns run on another worker now. Closing them there frees their protected
        KV (it stays cached, evictable); nothing else would before their TTL."""
        stale, self._stale_sessions = self._stale_sessions, []
        return stale

    def event_cursor(self, worker_id: str) -> tuple[int, int] | None:
        """(epoch, seq) of the worker's last applied batch; None until a snapshot arrived."""
        worker = self.registry.get(worker_id)
        return None if worker is None else worker.cursor

    # --- requests --------------------------------------------------------------------------

    def route(
        self,
        request_id: str,
        hashes: Sequence[int],
        num_tokens: int,
        expected_output: int,
        session_id: str | None = None,
        exclude: Collection[str] = (),
    ) -> Decision:
        """Choose a worker for a request and book it there; `NoWorkerError` if none can take it.

        `hashes` are the prompt's block hashes (kept by reference until `finish`: do not mutate);
        `expected_output` is the router's guess of output tokens (e.g. max_tokens, capped).
        """
        now = self.clock()
        self.ledger.release(request_id, now)
        request, decision, view, holders = self._decide(
            request_id, hashes, num_tokens, expected_output, session_id, exclude, now
        )
        self.affinity.add(holders, now)
        self.affinity.add_demand(decision.worker_id, num_tokens, now)
        self.ledger.book(self._booking(request, view, decision, hashes), now)
        self.index.record_route(decision.worker_id, hashes, self.registry.block_size)
        if session_id is not None:
            self.sessions.pin(session_id, decision.worker_id)
        return decision

    def finish(self, request_id: str, cached_tokens: int | None = None) -> Booking | None:
        """Release a request's booking (done, aborted or failed); unknown ids return None.

        `cached_tokens` (the worker's real prefix hit) is recorded on the returned booking so
        the caller can compare it with the prediction. The request's unconfirmed index entries
        get a fresh TTL: workers report a request's blocks when it ends.
        """
        booking = self.ledger.release(request_id, self.clock())
        if booking is None:
            return None
        booking.actual_cached_tokens = cached_tokens
        self.index.refresh_pending(booking.worker_id, booking.hashes)
        return booking

    def first_token(self, request_id: str) -> None:
        """The request's first token is out: its worker's predicted queue moves by the error
        of the prefill prediction (see `LoadLedger.first_token`)."""
        self.ledger.first_token(request_id, self.clock())

    def close_session(self, session_id: str) -> bool:
        """Forget a session pin; True if it existed. (The worker's KV is the caller's job.)"""
        return self.sessions.close(session_id)

    def index_blocks(self) -> int:
        """Entries in the prefix index (for the radixray_index_blocks gauge)."""
        return len(self.index)

    # --- helpers ---------------------------------------------------------------------------

    def _decide(
        self,
        request_id: str,
        hashes: Sequence[int],
        num_tokens: int,
        expected_output: int,
        session_id: str | None,
        exclude: Collection[str],
        now: float,
    ) -> tuple[RouteRequest, Decision, WorkerView, list[str]]:
        """Match, build the candidates' views with the estimate of the request on each (once per
        request: every policy, the booking and the pin read these), run the policy, then follow
        the session pin.
        Also returns the chosen view and the candidates holding the request's longest cached
        prefix."""
        self.index.expire()
        workers = [w for w in self.registry.routable() if w.worker_id not in exclude]
        if not workers:
            raise NoWorkerError("no worker available")
        block_size = self.registry.block_size
        # the engine computes at least the prompt's last token, and resumes at a block end
        limit = (num_tokens - 1) // block_size if num_tokens > 0 else 0
        match = self.index.match(hashes, limit, block_size)
        request = RouteRequest(
            request_id, num_tokens, len(hashes), expected_output, block_size,
            session_id, self.estimator.fleet.prefill_tokens_per_s,
        )
        candidates = []
        for worker in workers:
            view = self._view(worker, now)
            view.matched_blocks = match.device.get(worker.worker_id, 0)
            view.host_blocks = match.host.get(worker.worker_id, 0)
            view.held_blocks = self.ledger.held_prefix(worker.worker_id, hashes)
            view.estimate = self.estimator.estimate(request, view)
            candidates.append(view)
        least_wait = min(v.estimate.wait_s for v in candidates)
        request.saturation = self.saturation.observe(least_wait, now)
        decision = self.policy.choose(request, candidates)
        if session_id is not None:
            decision = self._follow_pin(request, session_id, decision, candidates)
        view = next(v for v in candidates if v.worker_id == decision.worker_id)
        decision.cached_tokens, decision.host_tokens = self.estimator.cached_tokens(request, view)
        top = max(v.matched_blocks for v in candidates)
        holders = [v.worker_id for v in candidates if v.matched_blocks == top] if top else []
        if decisions.isEnabledFor(logging.DEBUG):
            decisions.debug("%s", _describe(request, decision, candidates))
        return request, decision, view, holders

    def _view(self, worker: WorkerState, now: float) -> WorkerView:
        """The worker as a policy sees it now (no prefix match yet)."""
        view = WorkerView(
            worker.worker_id,
            worker.stats,
            foreign_requests=worker.foreign_requests,
            max_running=worker.shape.max_running,
            prefill_budget=worker.shape.prefill_budget,
        )
        load = self.ledger.load(worker.worker_id, now)
        view.requests = load.requests
        view.prefill_tokens = load.prefill_tokens
        view.decode_tokens = load.decode_tokens
        view.active_tokens = load.active_tokens
        view.kv_tokens = load.kv_tokens
        view.drain_tokens_per_s = self.ledger.drain_rate(view.worker_id, now)
        view.queue_s = max(0.0, load.busy_until - now)
        view.cached_blocks = self.index.num_blocks(view.worker_id)
        view.affinity_rate = self.affinity.rate(view.worker_id, now)
        view.demand_tokens_per_s = self.affinity.demand(view.worker_id, now)
        return view

    def _follow_pin(
        self,
        request: RouteRequest,
        session_id: str,
        decision: Decision,
        candidates: list[WorkerView],
    ) -> Decision:
        """Keep the session on its worker unless that one is gone, draining, excluded, or far
        costlier than the policy's choice."""
        pinned_id = self.sessions.get(session_id)
        if pinned_id is None:
            return decision
        pinned = next((v for v in candidates if v.worker_id == pinned_id), None)
        if pinned is None:
            return decision
        if pinned_id != decision.worker_id:
            best = next(v for v in candidates if v.worker_id == decision.worker_id)
            if self.sessions.should_yield(pinned.estimate.ttft_s, best.estimate.ttft_s):
                return decision
        return Decision(pinned_id, "session")

    def _booking(
        self, request: RouteRequest, view: WorkerView, decision: Decision, hashes: Sequence[int]
    ) -> Booking:
        return Booking(
            request_id=request.request_id,
            worker_id=view.worker_id,
            prefill_tokens=request.num_tokens - decision.cached_tokens - decision.host_tokens,
            decode_tokens=request.expected_output,
            active_tokens=request.num_tokens + request.expected_output,
            prefill_s=view.estimate.prefill_s,
            prefill_done_at=0.0,
            hashes=hashes,
            block_size=request.block_size,
            cached_tokens=decision.cached_tokens,
        )


SKIP, APPLY, GAP = "skip", "apply", "gap"


def next_batch(cursor: tuple[int, int] | None, epoch: int, seq: int, snapshot: bool) -> str:
    """What to do with a worker's event batch `(epoch, seq)` after `cursor` (the last applied).

    A snapshot (a batch starting with `AllCleared`) applies whatever the cursor, unless it is
    older than the cursor in the same epoch. Otherwise the batch must be the next `seq` of the
    current epoch: an old duplicate is skipped; a gap, a new epoch or no cursor yet is a GAP
    (nothing applied; the caller fetches a snapshot).
    """
    same_epoch = cursor is not None and cursor[0] == epoch
    if snapshot:
        return SKIP if same_epoch and seq < cursor[1] else APPLY
    if not same_epoch or seq > cursor[1] + 1:
        return GAP
    return SKIP if seq <= cursor[1] else APPLY


def is_snapshot(events: Sequence[object]) -> bool:
    return bool(events) and isinstance(events[0], AllCleared)


def _describe(request: RouteRequest, decision: Decision, views: Sequence[WorkerView]) -> str:
    """One line per decision: the request's size, the choice and why, then per candidate its
    match (blocks), the leading blocks its booked requests hold, booked requests, queue and
    estimate (wait, prefill, first step), seconds."""
    parts = [f"{request.request_id} tokens={request.num_tokens} -> {decision.worker_id} "
             f"({decision.reason})"]
    for v in views:
        e = v.estimate
        parts.append(f"{v.worker_id}: match={v.matched_blocks} held={v.held_blocks} "
                     f"booked={v.requests} "
                     f"queue={v.queue_s:.3f} wait={e.wait_s:.3f} prefill={e.prefill_s:.3f} "
                     f"step={e.step_s:.3f}")
    return " | ".join(parts)
