"""`Engine`: one worker's model, KV pool, radix cache, sessions and scheduler, stepped by a loop.

`add_request` queues a request (ValueError if it is bad); each `step()` runs one scheduler step
through the model and returns a `TokenChunk` for every request that got tokens or finished.
The caller (the actor's engine thread) serializes all calls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mem_cache.allocator import KVAllocator
from mem_cache.kv_pool import ReqToTokenPool
from worker.attention.registry import resolve_attention
from worker.compiled import compile_model
from worker.heap import retain_freed_memory
from worker.kernels.linear import pack_linears
from worker.kv_events import EventLog
from worker.kv_memory import KVMemory, make_hybrid_cache, make_radix_cache
from worker.loader.weights import quantized_linears, resolve_dtype
from worker.model_runner import ModelRunner
from worker.protocol import GenerateRequest, SamplingParams, TokenChunk, WorkerStats
from worker.request import Request, Status
from worker.sampling import sample, stop_ids
from worker.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from worker.sessions import SessionTable
from worker.validate import validate_request


@dataclass
class EngineConfig:
    model: str = "tiny"  # built-in name or HF model directory
    device: str = "cpu"
    # "float32" | "bfloat16" | "float16"; "auto": the checkpoint's, float32 served in bfloat16
    # where the device computes bf16 natively (vLLM's rule, `auto_dtype`); None: the checkpoint's
    dtype: str | None = None
    # "auto" (triton on CUDA where it imports, else native: `resolve_attention`) | "native" |
    # "torch" (reference) | "triton" | "flashinfer"
    attention: str = "auto"
    kv_tokens: int | None = None  # KV pool slots; None: sized from free memory
    # sliding-window models: slots of the window layers' pool; None: each running request's
    # window and a page either side, plus one step's chunk (`ModelRunner.window_tokens`)
    window_kv_tokens: int | None = None
    page_size: int = 1
    block_size: int = 16  # tokens per block hash (KV events), as the router uses
    max_running: int = 64
    # tokens per step, decodes included (chunked prefill); vLLM 0.32's OpenAI server on CPU
    # takes 2048. A cold prompt in one chunk is no slower than in several (docs/engine.md)
    prefill_budget: int = 2048
    max_context: int | None = None  # None: the model's
    enable_cache: bool = True  # radix prefix cache on/off
    session_ttl_s: float = 600.0  # default for requests that do not set session_ttl_s
    host_kv_tokens: int = 0  # host KV tier slots (0: off); evicted prefixes wait there
    host_policy: str = "write_through"  # | "write_through_selective" | "write_back"
    aging_steps: int = 32  # waiting steps after which a request is admitted oldest-first
    seed: int | None = None  # seed of the shared generator used by unseeded sampling
    # torch.compile the layers' dense work (falls back to eager if compiling fails). Off by
    # default: the first pass waits for the compiler, and a decode step gains little
    # (docs/engine.md)
    compile: bool = False
    # CPU bfloat16/float16/float32: linears through oneDNN with weights packed once at load
    # (faster at decode sizes; see worker.kernels.linear), eager and compiled
    pack_weights: bool = True
    # CPU float32, packed weights: linears that the model's GGUF stores as Q4_0/Q4_1/Q8_0
    # blocks read the blocks over a few rows (the float32 path's bits from ~1/5 of the bytes:
    # worker.kernels.quant_gemm)
    gguf_blocks: bool = True
    # CUDA: replay decode passes from CUDA graphs captured at start, one per padded batch size
    # up to max_running, and the pass of one sequence's sampled chunk, one per padded length up
    # to min(prefill_budget, 2048) (worker.cuda_graphs; attention backends that allow it).
    # Ignored on CPU
    cuda_graphs: bool = True

    def validate(self) -> None:
        """ValueError naming the first knob out of range."""
        positive = ("page_size", "block_size", "max_running", "prefill_budget", "aging_steps")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("kv_tokens", "max_context"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or None)")
        if self.host_kv_tokens < 0 or not self.session_ttl_s > 0:
            raise ValueError("host_kv_tokens must be >= 0 and session_ttl_s > 0")


class Engine:
    def __init__(self, config: EngineConfig, worker_id: str = "worker-0") -> None:
        config.validate()
        self.config = config
        self.worker_id = worker_id
        self.device = torch.device(config.device)
        dtype = resolve_dtype(config.model, config.dtype, self.device)
        attention = resolve_attention(config.attention, self.device)
        self.runner = ModelRunner(config.model, self.device, dtype, attention)
        self.model = self.runner.model
        if config.pack_weights:
            blocks = quantized_linears(config.model, self.model) if config.gguf_blocks else {}
            pack_linears(self.model, blocks)
        if config.compile:
            compile_model(self.model)
        if self.device.type == "cpu":  # activations live in host memory: keep their pages
            retain_freed_memory()
        mc = self.model.config
        self.max_context = min(config.max_context or mc.max_context, mc.max_context)
        self.eos_token_ids = list(mc.eos_token_ids)
        kv_tokens = config.kv_tokens or self.runner.default_kv_tokens(
            config.max_running * self.max_context
        )
        kv_tokens = kv_tokens // config.page_size * config.page_size
        window_tokens = self.runner.window_tokens(
            kv_tokens, config.max_running, config.prefill_budget, config.page_size
        )
        if config.window_kv_tokens is not None and window_tokens:
            window_tokens = config.window_kv_tokens // config.page_size * config.page_size
        # a state per running request, and as many for parked sessions
        self.runner.allocate_kv(kv_tokens, window_tokens, config.page_size,
                                num_states=2 * config.max_running)  # fmt: skip
        self.kv_pool = self.runner.kv_pool
        allocator = KVAllocator(kv_tokens, config.page_size)
        radix = None
        # a hybrid model caches prefixes in the component cache (`worker.kv_memory`)
        window, states = self.runner.window, self.runner.states
        hybrid = window is not None or states is not None
        if hybrid and config.host_kv_tokens:
            raise ValueError(
                "the host KV tier (host_kv_tokens) does not serve hybrid models (sliding-window "
                "or recurrent layers) yet; set it to 0"
            )
        if config.enable_cache and hybrid:
            radix = make_hybrid_cache(allocator, window, states, config.block_size)
        elif config.enable_cache:
            radix = make_radix_cache(
                allocator,
                self.kv_pool,
                config.block_size,
                config.host_kv_tokens,
                config.host_policy,
            )
        rows = ReqToTokenPool(config.max_running, self.max_context + config.page_size, self.device)
        self.runner.use_rows(rows)
        if config.cuda_graphs:  # on a CUDA device only (`worker.cuda_graphs`)
            self.runner.enable_cuda_graphs(config.max_running, config.prefill_budget)
        self.sessions = SessionTable()
        self.memory = KVMemory(
            allocator, radix, rows, self.sessions, self.runner.window, self.runner.states
        )
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_running, config.prefill_budget, config.aging_steps),
            self.memory,
        )
        self.events = EventLog(worker_id)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(
            config.seed if config.seed is not None else torch.seed() & 0xFFFFFFFF
        )
        self._requests: dict[str, Request] = {}
        self._pending: list[TokenChunk] = []  # chunks for the next step() to return
        self._prefill_tps = 0.0
        self._prefill_weight = 0.0  # the decayed sum of the weights behind `_prefill_tps`
        self._prefill_measured = 0  # prompt tokens `_prefill_tps` was measured over
        self._decode_step_s = 0.0
        self.num_steps = 0
        self.num_computed_tokens = 0  # tokens run through the model, all requests, all steps

    # --- requests ------------------------------------------------------------------------------

    def validate(self, request: GenerateRequest) -> None:
        """ValueError when the request is malformed, a duplicate, or can never fit."""
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already running")
        validate_request(
            request,
            self.model.config.vocab_size,
            self.max_context,
            self.memory.allocator.size,
            self.config.page_size,
        )

    def add_request(self, request: GenerateRequest) -> None:
        """Queue a request. ValueError (nothing kept) when `validate` rejects it."""
        self.validate(request)
        req = Request.from_protocol(request, self.device)
        self._requests[req.request_id] = req
        self.scheduler.add(req)

    def abort(self, request_id: str) -> None:
        """Stop a request at any stage; its last chunk (finish_reason "abort") comes with the
        next step(). Unknown or finished ids are ignored."""
        req = self._requests.get(request_id)
        if req is None:
            return
        self._finish(req, "abort")
        self._pending.append(self._chunk(req))

    def has_work(self) -> bool:
        return bool(self._requests or self._pending)

    def close_session(self, session_id: str) -> bool:
        """Release a parked session's KV; False when there is none."""
        parked = self.sessions.pop(session_id)
        if parked is None:
            return False
        self.memory.drop_session(parked)
        return True

    def expire_sessions(self) -> int:
        """Release the sessions whose TTL has passed; returns how many."""
        expired = self.sessions.expired()
        for sid in expired:
            self.close_session(sid)
        return len(expired)

    def warm_up(self) -> None:
        """Run two throwaway requests (a cold prompt, then one over its cached prefix, a few
        decode steps each) and leave no trace of them: the cache emptied, no KV event, the
        measured speeds and counters as at start. What a first pass pays once per process
        (oneDNN's kernels for these shapes, the C kernels' timings, workspace pages) is then
        paid before the worker serves, not by its first request (docs/engine.md)."""
        if self.has_work():
            raise RuntimeError("warm_up(): the engine is serving")
        vocab = self.model.config.vocab_size
        length = max(2, min(self.config.prefill_budget, self.max_context // 2, 512,
                            self.memory.allocator.size // 4))  # fmt: skip
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, vocab, (length,), generator=gen).tolist()
        sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        for i, tokens in enumerate((prompt, prompt + prompt[: max(1, length // 8)])):
            tokens = tokens[: self.max_context - sp.max_tokens]
            self.add_request(GenerateRequest(f"warm-up-{i}", tokens, sp))
            while self.has_work():
                self.step()
        if self.memory.radix is not None:
            self.memory.radix.reset()
            self.memory.radix.take_events()
        self.events = EventLog(self.worker_id)
        self._prefill_tps = self._decode_step_s = self._prefill_weight = 0.0
        self.num_steps = self.num_computed_tokens = self._prefill_measured = 0
        self.check_integrity()

    # --- stepping ------------------------------------------------------------------------------

    def step(self, settle: bool = True) -> list[TokenChunk]:
        """One scheduler step: a chunk for every request that got a token or finished (a
        request part-way through a chunked prefill gets none), plus pending abort chunks.
        When the engine goes idle it settles (`settle_if_idle`) before returning, unless
        `settle` is False: then the caller settles once it has handed the chunks on, so the
        check (O(pool size)) never delays a request's last chunk."""
        self.expire_sessions()
        batch = self.scheduler.schedule()
        if batch:
            self._run(batch)
        chunks, self._pending = self._pending, []
        self.take_event_batch()
        self.num_steps += 1
        if settle:
            self.settle_if_idle()
        return chunks

    def settle_if_idle(self) -> None:
        """With no work left: finish the copies to host in flight (they hold device locks),
        then check every KV slot's ownership (`check_integrity`)."""
        if self.has_work():
            return
        if self.memory.radix is not None:
            self.memory.radix.flush()
        self.check_integrity()

    def _run(self, batch: ScheduledBatch) -> None:
        started = time.perf_counter()
        logits, sampled = self.runner.forward(batch)
        self._computed(batch)
        prefill = self._cache_chunks(batch)
        if sampled:
            self._sample(logits, sampled)
        self._measure(time.perf_counter() - started, prefill)

    def _computed(self, batch: ScheduledBatch) -> None:
        self.num_computed_tokens += sum(batch.num_new)
        for req, n in zip(batch.requests, batch.num_new, strict=True):
            req.num_computed += n
            self.memory.slide(req)

    def _cache_chunks(self, batch: ScheduledBatch) -> int:
        """Hand the prefill chunks the pass computed to the cache; returns their tokens."""
        prefill = 0
        for req, n in zip(batch.requests, batch.num_new, strict=True):
            if n > 1:
                prefill += n
                self.memory.cache(req)  # finished chunks become shareable at once
        return prefill

    # --- sampling and finishing ------------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, sampled: list[Request]) -> list[int]:
        """Append a token to each sampled request, finish those that are done, queue their
        chunks; returns the tokens."""
        result = sample(logits, sampled, self.eos_token_ids, self.generator)
        for i, req in enumerate(sampled):
            token = result.token_ids[i]
            req.tokens.append(token)
            if result.logprobs[i] is not None:
                req.logprobs.append(result.logprobs[i])
                req.top_logprobs.append(result.top_logprobs[i])
            reason = self._finish_reason(req, token)
            if reason is not None:
                self._finish(req, reason)
            self._pending.append(self._chunk(req))
        return result.token_ids

    def _finish_reason(self, req: Request, token: int) -> str | None:
        if token in stop_ids(req, self.eos_token_ids):  # banned below min_tokens
            return "stop"
        if req.num_output >= req.sampling.max_tokens or len(req.tokens) >= self.max_context:
            return "length"
        return None

    def _finish(self, req: Request, reason: str) -> None:
        """A request ends: a session turn parks its KV, anything else releases it."""
        req.finish_reason = reason
        if req.status is Status.RUNNING and req.session_id is not None and reason != "abort":
            self.memory.park(req, req.session_ttl_s or self.config.session_ttl_s)
        else:
            self.memory.release(req)
        self.scheduler.remove(req)
        req.status = Status.FINISHED
        del self._requests[req.request_id]

    def _chunk(self, req: Request) -> TokenChunk:
        new = req.new_output()
        start = req.num_streamed
        req.num_streamed += len(new)
        want = req.sampling.logprobs is not None
        return TokenChunk(
            request_id=req.request_id,
            token_ids=new,
            finish_reason=req.finish_reason,
            prompt_tokens=req.num_input,
            cached_tokens=req.cached_tokens or 0,
            logprobs=req.logprobs[start : start + len(new)] if want else None,
            top_logprobs=req.top_logprobs[start : start + len(new)] if want else None,
        )

    def _measure(self, seconds: float, prefill_tokens: int) -> None:
        """Moving averages of prefill speed (net of the decode work sharing the step, as the
        router's cost model wants it) and of the time of a decode-only step."""
        if prefill_tokens:
            net = max(seconds - self._decode_step_s, 0.5 * seconds)
            # A step of a few prefill tokens (a cache hit, a short turn) is mostly fixed
            # overhead: weight samples by size so such steps cannot drag the measured speed
            # down, the first one included (a weighted mean, not a moving average seeded by
            # whichever step came first: a new worker whose first prompt was short measured
            # 855 tokens/s and kept it).
            weight = 0.2 * min(1.0, prefill_tokens / 256)
            self._prefill_weight = (1 - weight) * self._prefill_weight + weight
            sample = prefill_tokens / max(net, 1e-9)
            self._prefill_tps += (sample - self._prefill_tps) * weight / self._prefill_weight
            self._prefill_measured += prefill_tokens
        else:
            self._decode_step_s = _ema(self._decode_step_s, seconds)

    # --- events, stats, integrity ---------------------------------------------------------------

    def take_event_batch(self) -> bytes | None:
        """The cache's KV events and the held sessions' changes since the last call as one
        numbered batch (None if none)."""
        radix = self.memory.radix
        events = radix.take_events() if radix is not None else []
        running = [r.session_id for r in self.scheduler.running if r.session_id is not None]
        events.extend(self.sessions.take_events(running))
        return self.events.append(events)

    def snapshot_batch(self) -> bytes:
        """AllCleared + every cached block and held session, numbered like the latest batch
        (pending events are drained into a batch first, so the snapshot reflects every batch up
        to its seq)."""
        self.take_event_batch()
        radix = self.memory.radix
        cached = radix.snapshot_events() if radix is not None else []
        return self.events.snapshot(cached + self.sessions.held_events())

    def events_since(self, epoch: int, after_seq: int) -> list[bytes]:
        """Batches of `epoch` with seq > after_seq, or [snapshot] when they are not buffered."""
        self.take_event_batch()
        batches = self.events.since(epoch, after_seq)
        return [self.snapshot_batch()] if batches is None else batches

    def stats(self) -> WorkerStats:
        radix = self.memory.radix
        host = getattr(radix, "host_allocator", None)
        return WorkerStats(
            worker_id=self.worker_id,
            kv_total=self.memory.allocator.size,
            kv_free=self.memory.allocator.available_size(),
            kv_evictable=radix.evictable_size() if radix else 0,
            kv_protected=radix.protected_size() if radix else 0,
            kv_session=self.sessions.owned_tokens(),
            kv_host_total=host.size if host else 0,
            kv_host_free=host.available_size() if host else 0,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            waiting_prefill_tokens=self.scheduler.waiting_prefill_tokens(),
            running_decode_tokens=self.scheduler.running_decode_tokens(),
            prefill_tokens_per_s=self._prefill_tps,
            prefill_tokens_measured=self._prefill_measured,
            decode_step_s=self._decode_step_s,
            sessions=len(self.sessions),
            page_size=self.config.page_size,
            block_size=self.config.block_size,
            max_context=self.max_context,
            model=self.model.config.name,
        )

    def check_integrity(self) -> None:
        """Slot conservation and the cache's invariants; AssertionError names the first broken."""
        self.memory.check(self.scheduler.running)
        for req in self.scheduler.waiting:
            assert req.row is None and req.alloc_len == 0, f"{req.request_id}: waiting with KV"


def _ema(old: float, new: float, weight: float = 0.2) -> float:
    return new if old == 0.0 else (1 - weight) * old + weight * new
