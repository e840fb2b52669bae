"""One simulated worker: a real `RadixCache` with no memory behind it, plus a step model.

The cache holds block ids (one key element per block of `block_tokens` tokens), so its sizes
count blocks. Capacity is shared, as on a GPU, between the tree and the running requests:

    capacity_blocks >= cache.total_size() + reserved
    reserved = sum over admitted requests of (prompt blocks not yet in the tree + output blocks)

A request is admitted (FCFS, head of line) when its uncached blocks fit after evicting
unlocked LRU leaves; its matched prefix stays locked while it runs. Each step prefills up to
`prefill_budget` prompt tokens (chunked prefill, FCFS) and decodes one token for every running
request; its time comes from the `TimeProfile`. A finished prefill inserts the prompt's blocks
(the first token leaves at the end of that step); a finished request unlocks its path.

When nothing is left to prefill, the worker runs decode steps as one *run* up to the next
finish, in closed form, so the simulator handles one event per run rather than per token; an
arrival interrupts the run at the end of the step in progress.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cluster.sim.time_model import TimeProfile, attended_pairs
from cluster.sim.trace import SimRequest
from mem_cache.allocator import KVAllocator
from mem_cache.radix_cache import RadixCache


def cached_tokens(matched_blocks: int, block_tokens: int, input_length: int) -> int:
    """Tokens reused from a match of `matched_blocks`: at least the last one is recomputed."""
    return max(0, min(matched_blocks * block_tokens, input_length - 1))


@dataclass(slots=True)
class RequestState:
    """A request's progress on its worker; times in simulated seconds."""

    req: SimRequest
    worker: int = -1
    cached_tokens: int = 0
    host_tokens: int = 0  # of the cached ones, loaded back from the host tier
    load_s: float = 0.0  # host -> device copy still to pay in its first step
    prefilled: int = 0  # prompt tokens done (cached ones count as done)
    generated: int = 0
    node: object = None  # locked tree node
    node_blocks: int = 0  # prompt blocks on the locked path
    reserved: int = 0  # blocks this request holds outside the tree
    first_token_s: float = math.nan
    finish_s: float = math.nan

    @property
    def context(self) -> int:
        return self.req.input_length + self.generated


@dataclass(slots=True)
class DecodeRun:
    """`steps` decode steps of a fixed batch from `start_s`; context grows by `batch` a step."""

    start_s: float
    steps: int
    batch: int
    context: int

    def step_s(self, profile: TimeProfile, i: int) -> float:
        return profile.step_s(0, 0, self.batch, self.context + i * self.batch)

    def span_s(self, profile: TimeProfile, steps: int) -> float:
        """Seconds for the first `steps` steps (sum of an arithmetic series)."""
        first = self.step_s(profile, 0)
        return steps * first + profile.kv_read_s * self.batch * steps * (steps - 1) / 2


@dataclass
class SimWorker:
    """A worker's cache, queues and step state. The simulator drives `begin_step`/`end_step`."""

    index: int
    profile: TimeProfile
    capacity_blocks: int
    block_tokens: int
    cache: RadixCache = field(init=False)
    waiting: list[RequestState] = field(default_factory=list)
    prefilling: list[RequestState] = field(default_factory=list)
    running: list[RequestState] = field(default_factory=list)
    reserved: int = 0
    busy_until: float = -1.0  # end of the step or run in progress; -1: idle
    version: int = 0  # bumps when the pending end event is replaced
    run: DecodeRun | None = None
    step_plan: list[tuple[RequestState, int]] = field(default_factory=list)
    busy_s: float = 0.0
    served: int = 0
    max_run_steps: int | None = None  # cap on a decode run (a live fake worker streams each)
    cache_block_size: int = 1  # key elements per event block
    host_capacity_blocks: int = 0  # host KV tier (0: none)
    host_policy: str = "write_through"

    def __post_init__(self) -> None:
        host = KVAllocator(self.host_capacity_blocks) if self.host_capacity_blocks else None
        self.cache = RadixCache(None, page_size=1, block_size=self.cache_block_size,
                                host_allocator=host, write_policy=self.host_policy)

    @property
    def worker_id(self) -> str:
        return f"worker-{self.index}"

    def enqueue(self, state: RequestState) -> None:
        state.worker = self.index
        self.waiting.append(state)

    # --- admission ---------------------------------------------------------------------------

    def _admit(self) -> None:
        limit, budget = self.profile.max_running, self.profile.prefill_budget
        pending = sum(s.req.input_length - s.prefilled for s in self.prefilling)
        # Admit only what the next step can start on: requests left waiting are matched again
        # later, when the prefixes ahead of them are cached (as SGLang's scheduler does).
        while self.waiting and len(self.running) + len(self.prefilling) < limit:
            if pending >= budget:
                break
            state = self.waiting[0]
            req = state.req
            match = self.cache.match_prefix(req.blocks)
            out_blocks = math.ceil(req.output_length / self.block_tokens)
            room = self.capacity_blocks - match.length  # what eviction can free at most
            need = min(len(req.blocks) - match.length + out_blocks, room)
            self.cache.lock(match.node)  # before evicting: the match itself is evictable
            short = need - (self.capacity_blocks - self.cache.total_size() - self.reserved)
            if short > 0 and self.cache.evict(short) < short:
                self.cache.unlock(match.node)
                break
            self.waiting.pop(0)
            state.node, state.node_blocks = match.node, match.length
            host = self._load_back(state, match.host_length)
            state.reserved = need - host
            self.reserved += need - host
            cached = cached_tokens(match.length + host, self.block_tokens, req.input_length)
            state.cached_tokens = state.prefilled = cached
            state.host_tokens = cached - cached_tokens(match.length, self.block_tokens,
                                                       req.input_length)
            state.load_s = state.host_tokens * self.profile.host_load_token_s
            pending += req.input_length - cached
            self.prefilling.append(state)

    def _load_back(self, state: RequestState, host_blocks: int) -> int:
        """Bring the host-only part of the request's match back to device; returns its blocks.

        Matched again first: the eviction that made room may have moved nodes to host. The
        blocks come out of the room already made (they were counted in `need`)."""
        if not host_blocks:
            return 0
        again = self.cache.match_prefix(state.req.blocks)
        loaded = self.cache.load_back(again)
        if loaded.length <= state.node_blocks:
            return 0
        self.cache.lock(loaded.node)
        self.cache.unlock(state.node)
        host = loaded.length - state.node_blocks
        state.node, state.node_blocks = loaded.node, loaded.length
        return host

    # --- steps -------------------------------------------------------------------------------

    def begin_step(self, now: float) -> float:
        """Start the next step (or decode run); returns its end time, or -1 with nothing to do."""
        self._admit()
        self.run = None
        self.step_plan = []
        if self.prefilling:
            return self._begin_prefill_step(now)
        if self.running:
            steps = min(r.req.output_length - r.generated for r in self.running)
            steps = min(steps, self.max_run_steps or steps)
            context = sum(r.context for r in self.running)
            self.run = DecodeRun(now, max(1, steps), len(self.running), context)
            return self._busy(now, self.run.span_s(self.profile, self.run.steps))
        self.busy_until = -1.0
        return -1.0

    def _begin_prefill_step(self, now: float) -> float:
        budget, pairs, load_s = self.profile.prefill_budget, 0.0, 0.0
        for state in self.prefilling:
            if budget <= 0:
                break
            n = min(budget, state.req.input_length - state.prefilled)
            pairs += attended_pairs(n, state.prefilled)
            load_s, state.load_s = load_s + state.load_s, 0.0
            self.step_plan.append((state, n))
            budget -= n
        tokens = self.profile.prefill_budget - budget
        context = sum(r.context for r in self.running)
        step = self.profile.step_s(tokens, pairs, len(self.running), context)
        return self._busy(now, step + load_s)

    def _busy(self, now: float, seconds: float) -> float:
        self.busy_s += seconds
        self.busy_until = now + seconds
        return self.busy_until

    def interrupt(self, now: float) -> float | None:
        """Cut a decode run at the end of the step in progress; returns the new end time."""
        run = self.run
        if run is None or self.busy_until <= now:
            return None
        elapsed, done = 0.0, 0
        while done < run.steps and run.start_s + elapsed <= now:
            elapsed += run.step_s(self.profile, done)
            done += 1
        if done >= run.steps:
            return None
        self.busy_s -= self.busy_until - (run.start_s + elapsed)
        run.steps = done
        self.busy_until = run.start_s + elapsed
        return self.busy_until

    def end_step(self, now: float) -> tuple[list[RequestState], list[RequestState]]:
        """Apply the step that ends now: (requests that got their first token, finished ones)."""
        steps = self.run.steps if self.run else 1
        for r in self.running:
            r.generated += steps
        finished = [r for r in self.running if r.generated >= r.req.output_length]
        self.running = [r for r in self.running if r.generated < r.req.output_length]
        first: list[RequestState] = []
        for state, n in self.step_plan:
            state.prefilled += n
            if state.prefilled < state.req.input_length:
                self._cache_prefix(state, state.prefilled // self.block_tokens)
            else:
                self._cache_prefix(state, len(state.req.blocks))
                state.first_token_s = now
                state.generated = 1
                first.append(state)
        self.prefilling = [s for s in self.prefilling if s.prefilled < s.req.input_length]
        for state in first:
            (finished if state.generated >= state.req.output_length else self.running).append(
                state
            )
        for state in finished:
            self._release(state, now)
        self.run, self.step_plan, self.busy_until = None, [], -1.0
        return first, finished

    def _cache_prefix(self, state: RequestState, n: int) -> None:
        """Insert the first `n` prompt blocks (computed so far) and move the lock to their end.

        Chunks are cached as they finish, so a request queued behind a long prefill reuses
        the part already computed."""
        if n <= state.node_blocks:
            return
        blocks = state.req.blocks[:n]
        before = self.cache.insert(blocks, None)
        node = self.cache.match_prefix(blocks).node
        if node is not state.node:
            self.cache.lock(node)
            self.cache.unlock(state.node)
            state.node = node
        state.node_blocks = n
        moved = min(max(0, n - before), state.reserved)
        state.reserved -= moved
        self.reserved -= moved

    def _release(self, state: RequestState, now: float) -> None:
        self.cache.unlock(state.node)
        self.reserved -= state.reserved
        state.reserved, state.node, state.finish_s = 0, None, now
        self.served += 1

    # --- load --------------------------------------------------------------------------------

    def queued_prefill_tokens(self) -> int:
        todo = sum(s.req.input_length - s.prefilled for s in self.prefilling)
        return todo + sum(s.req.input_length for s in self.waiting)
