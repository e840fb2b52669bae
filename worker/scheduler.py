"""Which tokens of which requests go through the model in the next step.

Continuous batching with chunked prefill: every step has a budget of `prefill_budget` tokens.
Running requests come first, oldest first: each decoding request gets its one token (always,
so decodes never stall), a request part-way through its prefill gets its next chunk. What is
left of the budget admits waiting requests, each with the first chunk of its prompt, so new
requests join the running decode batch without waiting for it to finish.

Waiting order is prefix-aware: requests with the longest cached prefix first (they cost the
least and their prefix is hot now), except that a request waiting `aging_steps` steps or more
goes first, oldest first, so nothing starves. With a long queue (over `order_limit`), plain
arrival order is used to keep the per-step cost bounded. A request that shares at least
`defer_shared` not-yet-cached tokens with a request still prefilling waits for that prefill to
land in the cache rather than computing the same prefix twice (aged requests never wait).

Memory: a running request that cannot get its slots even after eviction makes the scheduler
drop parked sessions, then retract the newest running request (its computed prefix goes to the
cache, it goes back to the head of the queue and recomputes later). A waiting request that
does not fit is simply not admitted this step.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.kv_memory import KVMemory
from worker.request import Request, Status, common_prefix_len


@dataclass
class SchedulerConfig:
    max_running: int = 64  # requests holding a row at once
    prefill_budget: int = 2048  # tokens per step, decodes included (chunked prefill)
    aging_steps: int = 32  # a request waiting this many steps is admitted oldest-first
    order_limit: int = 256  # beyond this queue length, waiting order is plain arrival order
    defer_shared: int = 32  # defer a request sharing this many uncached tokens with a prefill
    hint_every: int = 8  # refresh a waiting request's cached-prefix estimate every N steps


@dataclass
class ScheduledBatch:
    """`requests[i]` runs `num_new[i]` tokens from its `num_computed` on."""

    requests: list[Request]
    num_new: list[int]

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(self, config: SchedulerConfig, memory: KVMemory) -> None:
        self.config = config
        self.memory = memory
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_retracted = 0

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Forget a request (finished or aborted); its KV must already be released."""
        assert req.row is None, "remove a request that still holds KV"
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def schedule(self) -> ScheduledBatch:
        """The next step's batch."""
        batch = ScheduledBatch([], [])
        budget = self.config.prefill_budget
        retracted = self.num_retracted
        budget = self._schedule_running(batch, budget)
        if self.num_retracted == retracted:
            self._admit_waiting(batch, budget)  # memory is short: admit nothing
        for req in self.waiting:
            req.waited_steps += 1
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        running = self.running
        decoding = running and all(r.remaining == 1 for r in running)
        if decoding and self.memory.alloc_decodes(running):
            # every running request decodes and the free list covers them all: one allocation
            batch.requests.extend(running)
            batch.num_new.extend([1] * len(running))
            return max(budget - len(running), 0)
        i = 0
        while i < len(self.running):
            req = self.running[i]
            n = 1 if req.remaining == 1 else min(req.remaining, budget)
            if n <= 0:
                i += 1
                continue
            if not self._alloc_or_retract(req, req.num_computed + n):
                continue  # req itself was retracted; running[i] is now the next one
            batch.requests.append(req)
            batch.num_new.append(n)
            budget = max(budget - n, 0)
            i += 1
        return budget

    def _alloc_or_retract(self, req: Request, upto: int) -> bool:
        """Slots for a running request: evict, drop sessions, then retract the newest running
        request, possibly `req` itself. False when `req` got no slots: it was retracted."""
        while not self.memory.alloc(req, upto):
            if self.memory.drop_oldest_session():
                continue
            victim = self.running[-1]
            self.retract(victim)
            if victim is req:
                return False
        return True

    def retract(self, req: Request) -> None:
        """Preempt: release the request's KV (its computed prefix stays cached) and put it at
        the head of the queue; it prefills its prompt and output so far again later."""
        self.memory.release(req)
        self.running.remove(req)
        req.status = Status.WAITING
        req.waited_steps = self.config.aging_steps  # it was admitted before: first in line
        self.waiting.insert(0, req)
        self.num_retracted += 1

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        if not self.waiting:
            return
        for req in self._ordered_waiting():
            if budget <= 0 or len(self.running) >= self.config.max_running:
                break
            if self._shares_a_running_prefill(req):
                continue
            if not self.memory.admit(req):
                break
            n = min(req.remaining, budget)
            if not self._alloc_for_admission(req, req.num_computed + n):
                self.memory.release(req)
                break
            self.waiting.remove(req)
            req.status = Status.RUNNING
            req.waited_steps = 0
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new.append(n)
            budget -= n

    def _shares_a_running_prefill(self, req: Request) -> bool:
        """True when a request still prefilling (or admitted this step) computes a long prefix
        of `req` that is not cached yet: `req` waits, then finds it in the cache instead of
        computing it twice. Aged requests never wait for this."""
        if self.memory.radix is None or req.waited_steps >= self.config.aging_steps:
            return False
        need = req.cached_hint + self.config.defer_shared
        return any(
            other.remaining > 1
            and common_prefix_len(req.tokens, other.tokens) >= need
            for other in self.running
        )

    def _alloc_for_admission(self, req: Request, upto: int) -> bool:
        """A new request may evict cache leaves; it may drop parked sessions only when nothing
        runs (else the running requests will free memory soon, and sessions are worth more)."""
        while not self.memory.alloc(req, upto):
            if self.running or not self.memory.drop_oldest_session():
                return False
        return True

    def _ordered_waiting(self) -> list[Request]:
        if len(self.waiting) > self.config.order_limit or self.memory.radix is None:
            return list(self.waiting)
        aged = [r for r in self.waiting if r.waited_steps >= self.config.aging_steps]
        fresh = [r for r in self.waiting if r.waited_steps < self.config.aging_steps]
        aged.sort(key=lambda r: r.arrival)
        for req in fresh:
            # a look-ahead match counts as a use of the cache (recency, selective write-through
            # hits): refresh the estimate now and then, not every step
            if req.waited_steps % self.config.hint_every == 0:
                req.cached_hint = self._cached_len(req)
        fresh.sort(key=lambda r: (-r.cached_hint, r.arrival))
        return aged + fresh

    def _cached_len(self, req: Request) -> int:
        """Tokens of the request's prompt the cache holds now (a look-ahead: no lock)."""
        radix = self.memory.radix
        return radix.match_prefix(req.tokens[: len(req.tokens) - 1], req.namespace).length

    def waiting_prefill_tokens(self) -> int:
        """Tokens still to prefill: waiting prompts less their cached prefix as last seen by
        the queue ordering, plus the rest of running prefills."""
        waiting = sum(len(r.tokens) - r.cached_hint for r in self.waiting)
        running = sum(r.remaining for r in self.running if r.remaining > 1)
        return waiting + running

    def running_decode_tokens(self) -> int:
        """KV tokens of the running requests (what each decode step attends over)."""
        return sum(r.num_computed for r in self.running)
