"""`Router`: everything behind the HTTP handlers, with no HTTP in it.

It owns the tokenizer, the routing core, the worker registry (with its polling task), the
dispatcher and the metrics; turns validated OpenAI bodies into `Job`s (prompt length, vocab and
parameter checks happen here, every failure an APIError 4xx); and runs the admin operations.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

from router.backends import Backend, BackendDead
from router.config import RouterConfig, cost_config
from router.core import CoreConfig, RoutingCore
from router.dispatch import Dispatcher
from router.errors import APIError, bad_request, model_not_found, not_implemented
from router.generation import Job
from router.metrics import RouterMetrics
from router.openai_types import ChatRequest, CompletionRequest, SamplingFields
from router.policies import PolicyConfig
from router.tokenizer import Tokenizer
from router.workers import WorkerRegistry
from worker.protocol import SamplingParams

MAX_CHOICES = 128  # prompts x n per request
MAX_STOP = 16
_WORKER_KEYS = (
    "kv_total",
    "kv_free",
    "kv_evictable",
    "kv_protected",
    "kv_session",
    "kv_host_total",
    "kv_host_free",
    "running",
    "waiting",
    "sessions",
)


class WorkerControl(Protocol):
    """What the admin endpoints need from whoever starts workers (the cluster launcher).

    `add_worker()` starts one worker and returns once it serves: either its `Backend` (the router
    registers it) or its id (the launcher has already registered it, e.g. via
    `WorkerRegistry.attach`). `remove_worker(id)` stops it for good; the router has already
    stopped routing to it. Either may be a plain function or a coroutine function.
    """

    def add_worker(self) -> Any: ...
    def remove_worker(self, worker_id: str) -> Any: ...


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class Router:
    """The router's state and operations; `router.app` is its HTTP face."""

    def __init__(
        self,
        config: RouterConfig,
        backends: Sequence[Backend] = (),
        control: WorkerControl | None = None,
        tokenizer: Tokenizer | None = None,
        core: RoutingCore | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer or Tokenizer(config.tokenizer or config.model)
        if core is None:
            policies = PolicyConfig(cost=cost_config(overrides=config.cost_config))
            core = RoutingCore(config=CoreConfig(
                policy=config.policy, block_size=config.block_size, policies=policies
            ))
        self.core = core
        self.metrics = RouterMetrics()
        self.workers = WorkerRegistry(config, self.core, self.metrics)
        self.workers.encode = self.tokenizer.encode_plain
        self.dispatcher = Dispatcher(
            self.core, self.workers, self.metrics, config.max_failovers, config.namespace
        )
        self.control = control
        self._initial = list(backends)
        self._started: asyncio.Task | None = None

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Adds the initial backends and starts polling; safe to call many times."""
        if self._started is None:
            self._started = asyncio.get_running_loop().create_task(self._start())
        if not self._started.done():  # every request calls this: stay cheap once started
            await asyncio.shield(self._started)

    async def _start(self) -> None:
        await self.workers.join(self._initial)
        self.workers.start()

    async def stop(self) -> None:
        await self.workers.stop()

    # --- requests -----------------------------------------------------------------------------

    def context_limit(self) -> int:
        for limit in (
            self.config.max_context,
            self.workers.max_context(),
            self.tokenizer.model_max_length,
        ):
            if limit:
                return int(limit)
        return 4096

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model:
            raise model_not_found(model)

    def completion_job(self, body: CompletionRequest, session_id: str | None) -> Job:
        if body.echo:
            raise bad_request("echo is not supported", param="echo")
        prompts = self._prompt_ids(body.prompt)
        return self._job(body, prompts, body.max_tokens, body.logprobs, session_id)

    def chat_job(self, body: ChatRequest, session_id: str | None) -> Job:
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
        try:
            ids = self.tokenizer.apply_chat(body.template_messages(), body.tools)
        except ValueError as exc:
            raise bad_request(str(exc), param="messages") from None
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        return self._job(body, [ids], max_tokens, logprobs, session_id)

    def _prompt_ids(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [self.tokenizer.encode(prompt)]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        else:
            prompts = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
        if not prompts or any(not p for p in prompts):
            raise bad_request("prompt must not be empty", param="prompt")
        vocab = self.tokenizer.vocab_size
        if min(min(p) for p in prompts) < 0 or max(max(p) for p in prompts) >= vocab:
            raise bad_request(f"prompt token ids must be in [0, {vocab})", param="prompt")
        return prompts

    def _job(
        self,
        body: SamplingFields,
        prompts: list[list[int]],
        max_tokens: int | None,
        logprobs: int | None,
        session_id: str | None,
    ) -> Job:
        self.check_model(body.model)
        if body.n > self.config.max_n or body.n * len(prompts) > MAX_CHOICES:
            raise bad_request(f"n must be at most {self.config.max_n}", param="n")
        stop = body.stop_list()
        if len(stop) > MAX_STOP:
            raise bad_request(f"at most {MAX_STOP} stop strings", param="stop")
        stop_ids = body.stop_token_ids or []
        if any(t < 0 or t >= self.tokenizer.vocab_size for t in stop_ids):
            raise bad_request("stop_token_ids out of the vocabulary", param="stop_token_ids")
        if body.seed is not None and not -(1 << 63) <= body.seed < (1 << 64):
            raise bad_request("seed must fit in 64 bits", param="seed")
        max_tokens = self._check_length(max(len(p) for p in prompts), max_tokens)
        if body.min_tokens > max_tokens:
            raise bad_request("min_tokens must not exceed max_tokens", param="min_tokens")
        sampling = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k == 0 else body.top_k,
            min_p=body.min_p,
            seed=body.seed,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            stop_token_ids=stop_ids,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
        )
        return Job(
            uuid.uuid4().hex,
            self.config.model,
            prompts,
            sampling,
            body.n,
            stop,
            body.skip_special_tokens,
            body.session_id or session_id,
            self.config.namespace,
            self.config.session_ttl_s,
        )

    def _check_length(self, prompt_len: int, max_tokens: int | None) -> int:
        context = self.context_limit()
        if prompt_len >= context:
            raise bad_request(
                f"This model's maximum context length is {context} tokens; the prompt has "
                f"{prompt_len} tokens.",
                param="messages",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return min(self.config.default_chat_max_tokens, context - prompt_len)
        if prompt_len + max_tokens > context:
            raise bad_request(
                f"This model's maximum context length is {context} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} for the completion).",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    # --- workers and sessions -----------------------------------------------------------------

    def workers_json(self) -> list[dict]:
        ids = [*self.workers.backends, *self.workers.dead]
        out = []
        for wid in ids:
            stats = self.workers.stats.get(wid)
            row: dict[str, Any] = {
                "id": wid,
                "state": self.workers.state(wid),
                "in_flight": self.workers.in_flight(wid),
            }
            row.update({k: getattr(stats, k, 0) if stats else 0 for k in _WORKER_KEYS})
            row["max_context"] = int(self.workers.info.get(wid, {}).get("max_context") or 0)
            out.append(row)
        return out

    async def close_session(self, session_id: str) -> bool:
        """Forgets the pin and frees the session's KV on whichever worker holds it."""
        pinned = self.core.close_session(session_id)
        backends = list(self.workers.backends.values())
        results = await asyncio.gather(
            *(b.close_session(session_id) for b in backends), return_exceptions=True
        )
        return pinned or any(r is True for r in results)

    async def add_workers(self, count: int) -> list[str]:
        if self.control is None:
            raise not_implemented("Adding workers")
        added = []
        for _ in range(count):
            result = await _maybe_await(self.control.add_worker())
            if isinstance(result, Backend):
                await self.workers.add(result)
                result = result.worker_id
            added.append(str(result))
        return added

    async def add_url_worker(self, body: dict) -> str:
        """Registers the external engine `body` names (`{"url", "events", "replay"}`), through
        the control's `url_worker(body) -> Backend` (`cluster.route`); 501 without one."""
        make = getattr(self.control, "url_worker", None)
        if make is None:
            raise not_implemented("Adding a worker by url")
        backend = make(body)
        try:
            await self.workers.add(backend)
        except BackendDead as exc:
            self.workers.forget(backend.worker_id)
            await _maybe_await(self.control.remove_worker(backend.worker_id))
            await backend.close()
            raise bad_request(f"the engine does not answer: {exc}", param="url",
                              code="worker_unreachable") from None
        return backend.worker_id

    def _known(self, worker_id: str) -> None:
        if worker_id not in self.workers.backends and worker_id not in self.workers.dead:
            raise APIError(
                404, f"no worker {worker_id!r}", param="worker_id", code="worker_not_found"
            )

    async def drain(self, worker_id: str, timeout_s: float = 600.0) -> dict:
        """Stops routing to the worker, waits for its requests to end, then removes it."""
        self._known(worker_id)
        if worker_id in self.workers.backends:
            self.workers.set_draining(worker_id, True)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while self.workers.in_flight(worker_id) > 0 and loop.time() < deadline:
                await asyncio.sleep(0.05)
        return await self.remove(worker_id)

    async def remove(self, worker_id: str) -> dict:
        """Removes the worker from routing at once (and stops it, when a control is given)."""
        self._known(worker_id)
        self.workers.detach(worker_id)
        if self.control is not None:
            await _maybe_await(self.control.remove_worker(worker_id))
        return {"id": worker_id, "state": "removed"}
