"""`HttpBackend`: any OpenAI-compatible server (vLLM, SGLang, another radixray) over HTTP with
aiohttp, so the router can front servers it did not start."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from router.backends.base import Backend, BackendDead, BackendRequestError
from router.backends.external.events import EngineEventsConfig, EngineEventStream
from router.backends.external.metrics import EngineMetrics, parse_engine_metrics
from router.backends.external.probe import PROBE_TIMEOUT_S, PROBE_TOKENS, ProbeTiming, probe_engine
from router.backends.external.speed import EngineSpeed
from router.backends.sse import sse_json
from worker.protocol import GenerateRequest, TokenChunk, WorkerStats

log = logging.getLogger("radixray.router")


class HttpBackend(Backend):
    """An OpenAI-compatible server at `base_url` (without the trailing /v1).

    Requests go to `/v1/completions` with the prompt as token ids and `return_token_ids`
    (vLLM >= 0.10.2 and radixray send the output ids back). A server that only returns text has
    its text re-tokenized with `encode` (the router's tokenizer, given by whoever builds the
    backend; without it such text is dropped). Top logprobs are not carried over. A request's
    namespace goes as `cache_salt`.

    With `events` (the engine's ZMQ KV event endpoints, `external.events`) the router's
    index follows what the engine really caches and evicts; without, it holds only the
    router's own routing history. The engine's shape and load come from its `/metrics` where
    it reports them (`external.metrics`): block size, KV capacity, running and waiting
    requests, and its start time (a new one: the engine restarted, its events are purged).
    Its prefill speed and decode step are timed on the router's own streams, the prefill
    speed on the engine's own timings where its `/metrics` has them (`external.speed`),
    and reported in `stats()`, as our workers report theirs; until those give figures, a probe
    of `probe_tokens` run at join on the idle engine stands in (`calibrate`; 0: no probe).
    `block_size` is the granularity its KV events are hashed at, reported by `ready()` as the
    engine shape's `block_size`; None: the engine's own block size. An engine that reports
    none leaves it to the router's default (`EngineShape.from_info`), and then cannot have
    `events` (they need a known granularity).
    """

    def __init__(
        self,
        worker_id: str,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        encode: Callable[[str], list[int]] | None = None,
        timeout_s: float = 600.0,
        events: EngineEventsConfig | None = None,
        block_size: int | None = None,
        probe_tokens: int = PROBE_TOKENS,
    ) -> None:
        self.worker_id = worker_id
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.encode = encode
        self.timeout_s = timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.running = 0
        self.block_size = block_size
        self.events_config = events
        self.events: EngineEventStream | None = None
        self.engine = EngineMetrics()
        self.speed = EngineSpeed()
        self.probe_tokens = probe_tokens
        self.probed = False  # a probe was sent: once per backend, even if it measured nothing
        self.max_context = 0  # the engine's context length where `ready()` read it
        self._session: Any = None

    def _http(self) -> Any:
        import aiohttp

        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            self._session = aiohttp.ClientSession(headers=self.headers, timeout=timeout)
        return self._session

    async def _json(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        import aiohttp

        try:
            async with self._http().request(method, self.base_url + path, json=body) as resp:
                return resp.status, await resp.json(content_type=None)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            raise BackendDead(f"{self.worker_id}: {exc}") from exc

    async def ready(self) -> dict[str, Any]:
        status, body = await self._json("GET", "/v1/models")
        if status != 200 or not body.get("data"):
            raise BackendDead(f"{self.worker_id}: /v1/models answered {status}")
        card = body["data"][0]
        self.model = self.model or card["id"]
        await self._scrape()
        self.block_size = self.block_size or self.engine.block_size
        if self.events_config is not None and self.events is None:
            if self.block_size is None:
                raise BackendDead(f"{self.worker_id}: the engine reports no block size; KV "
                                  "events need one (give block_size)")
            self.events = EngineEventStream(self.worker_id, self.events_config, self.block_size)
        if self.events is not None:
            self.events.start()
        # an OpenAI server tells its context length; vLLM's /metrics its block size. The rest
        # of its shape (max_running, prefill_budget) is unknown: the router's defaults hold.
        self.max_context = int(card.get("max_model_len") or 0)
        return {
            "model": self.model,
            "block_size": self.block_size,
            "max_context": self.max_context,
        }

    async def calibrate(self) -> None:
        """Probes the engine's prefill speed and decode step (`external.probe`) once, if
        it is idle (a busy engine's timings would carry its queue; the router then learns
        from its own traffic). Where the engine counts its prefills (vLLM's `/metrics`), a
        probe it served other requests beside (another router's probe, say) is not used. A
        probe that fails or times out leaves the figures unmeasured: logged, and the engine
        still joins."""
        e = self.engine
        busy = self.running or (e.running or 0) or (e.waiting or 0)
        if self.probe_tokens <= 0 or self.probed or busy:
            return
        self.probed = True
        before = e.prefills
        try:
            result = await asyncio.wait_for(
                probe_engine(self._probe_request, random.Random(), self.probe_tokens,
                             self.max_context),
                PROBE_TIMEOUT_S)
            await self._scrape()
        except Exception as exc:  # noqa: BLE001 - a probe never keeps an engine out
            log.warning("probing engine %s failed, its speeds are learnt from traffic: %r",
                        self.worker_id, exc)
            return
        after = self.engine.prefills
        if before is not None and after is not None and after[0] - before[0] > result.requests:
            log.warning("engine %s served %d other requests during its probe: not used, its "
                        "speeds are learnt from traffic", self.worker_id,
                        after[0] - before[0] - result.requests)
            return
        self.speed.calibrate(result.prefill_tokens_per_s, result.decode_step_s)
        log.info("engine %s probed: prefill %.0f tokens/s, decode step %.4f s", self.worker_id,
                 result.prefill_tokens_per_s, result.decode_step_s)

    async def _probe_request(self, prompt: str, max_tokens: int) -> ProbeTiming:
        """One probe prompt, greedy, exactly `max_tokens` out, timed to its whole answer."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True}
        start = time.monotonic()
        status, answer = await self._json("POST", "/v1/completions", body)
        seconds = time.monotonic() - start
        usage = answer.get("usage") if isinstance(answer, dict) else None
        if status != 200 or not isinstance(usage, dict):
            raise BackendRequestError(f"{self.worker_id}: probe answered {status}: "
                                      f"{str(answer)[:200]}")
        details = usage.get("prompt_tokens_details") or {}
        try:
            return ProbeTiming(seconds, int(usage.get("prompt_tokens") or 0),
                               int(details.get("cached_tokens") or 0),
                               int(usage.get("completion_tokens") or 0))
        except (AttributeError, TypeError, ValueError) as exc:
            raise BackendRequestError(f"{self.worker_id}: probe usage {usage!r}") from exc

    async def _scrape(self) -> None:
        """Reads the engine's `/metrics`; a new start time (it restarted) purges its events and
        drops its timings: the new process is measured anew, as it rejoins empty."""
        import aiohttp

        try:
            async with self._http().get(self.base_url + "/metrics") as resp:
                text = await resp.text() if resp.status == 200 else ""
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            raise BackendDead(f"{self.worker_id}: /metrics: {exc}") from exc
        try:
            metrics = parse_engine_metrics(text)
        except ValueError:  # not Prometheus text: an engine that reports nothing we read
            metrics = EngineMetrics()
        before = self.engine.start_time
        if before is not None and metrics.start_time != before:  # a new engine: timed anew
            self.speed = self.speed.fresh()
            if self.events is not None:
                self.events.purge("restart")
        self._observe_prefills(metrics)
        self.engine = metrics

    def _observe_prefills(self, metrics: EngineMetrics) -> None:
        """The prefills the engine timed since the last scrape (all of them since it started,
        at the first scrape or after a restart), as one point of the speed's line: their mean
        request (`EngineSpeed.observe_engine`)."""
        now = metrics.prefills
        if now is None:
            return
        last = self.engine.prefills if metrics.start_time == self.engine.start_time else None
        count, tokens, seconds = now if last is None else (
            now[0] - last[0], now[1] - last[1], now[2] - last[2])
        if count > 0 and tokens >= 0 and seconds > 0:
            self.speed.observe_engine(tokens / count, seconds / count)

    def _body(self, request: GenerateRequest) -> dict[str, Any]:
        s = request.sampling
        done = len(request.resume_ids)
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": request.input_ids + request.resume_ids,
            "max_tokens": max(s.max_tokens - done, 1),
            "min_tokens": max(s.min_tokens - done, 0),
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "min_p": s.min_p,
            "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty,
            "repetition_penalty": s.repetition_penalty,
            "stop_token_ids": s.stop_token_ids,
            "ignore_eos": s.ignore_eos,
            "skip_special_tokens": False,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        if s.seed is not None:
            body["seed"] = s.seed
        if s.logprobs is not None:
            body["logprobs"] = s.logprobs
        if request.session_id:
            body["session_id"] = request.session_id
        if request.namespace is not None:
            body["cache_salt"] = request.namespace
        return body

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        import aiohttp

        queued = self.running > 0  # sent behind the router's own requests: its TTFT has a queue
        self.running += 1
        last: TokenChunk | None = None
        clock = _StreamClock()
        try:
            async with self._http().post(
                self.base_url + "/v1/completions", json=self._body(request)
            ) as resp:
                if resp.status >= 400:
                    text = await resp.text()
                    kind = BackendRequestError if resp.status < 500 else BackendDead
                    raise kind(f"{self.worker_id}: HTTP {resp.status}: {text[:500]}")
                async for body in sse_json(resp.content):
                    chunk, usage = self._parse(request.request_id, body)
                    if chunk is not None:
                        clock.tokens(len(chunk.token_ids))
                        if last is not None:  # past the finishing chunk: pass that one on
                            yield last
                        last = chunk
                    if usage and last is not None:
                        last.prompt_tokens = usage.get("prompt_tokens", 0)
                        details = usage.get("prompt_tokens_details") or {}
                        last.cached_tokens = int(details.get("cached_tokens") or 0)
                    if last is not None and last.finish_reason is None:
                        yield last  # at once: only the finishing chunk waits for the usage
                        last = None
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            raise BackendDead(f"{self.worker_id}: {exc}") from exc
        finally:
            self.running -= 1
        if last is None or last.finish_reason is None:
            raise BackendDead(f"{self.worker_id}: stream ended before the request finished")
        if last.prompt_tokens:
            clock.observe(self.speed, last.prompt_tokens - last.cached_tokens, queued)
        yield last

    def _parse(self, request_id: str, body: dict) -> tuple[TokenChunk | None, dict | None]:
        if "error" in body:
            raise BackendDead(f"{self.worker_id}: {body['error']}")
        choices = body.get("choices") or []
        if not choices:
            return None, body.get("usage")
        choice = choices[0]
        ids = choice.get("token_ids")
        if ids is None:
            ids = self.encode(choice.get("text") or "") if self.encode else []
        lp = (choice.get("logprobs") or {}).get("token_logprobs")
        chunk = TokenChunk(
            request_id,
            list(ids),
            finish_reason=choice.get("finish_reason"),
            logprobs=list(lp) if lp else None,
        )
        return chunk, body.get("usage")

    async def abort(self, request_id: str) -> None:
        """Closing the stream's connection is how an OpenAI server learns of an abort."""

    async def stats(self) -> WorkerStats:
        """The engine's running and waiting requests, KV capacity and usage where its
        `/metrics` reports them (read at `ready` and here), else the router's own count."""
        if self.engine.start_time is not None:
            await self._scrape()
        e = self.engine
        kv_total = e.kv_tokens or 0
        return WorkerStats(
            worker_id=self.worker_id,
            running=self.running if e.running is None else e.running,
            waiting=e.waiting or 0,
            kv_total=kv_total,
            kv_free=int(kv_total * (1.0 - (e.kv_usage or 0.0))),
            prefill_tokens_per_s=self.speed.prefill_tokens_per_s,
            prefill_tokens_measured=self.speed.measured_tokens,
            decode_step_s=self.speed.decode_step_s,
            model=self.model or "",
        )

    async def kv_events(self, epoch: int, after_seq: int) -> list[bytes]:
        return [] if self.events is None else self.events.batches_after(epoch, after_seq)

    async def close_session(self, session_id: str) -> bool:
        status, body = await self._json("DELETE", f"/v1/sessions/{session_id}")
        return status == 200 and bool(body.get("deleted"))

    async def close(self) -> None:
        if self.events is not None:
            await self.events.close()
        if self._session is not None:
            await self._session.close()


class _StreamClock:
    """When one stream's tokens arrived: its first, its last, and how many after the first."""

    def __init__(self) -> None:
        self.sent = time.monotonic()
        self.first: float | None = None
        self.last = 0.0
        self.after_first = 0

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
        else:
            self.after_first += count
        self.last = now

    def observe(self, speed: EngineSpeed, uncached_tokens: int, queued: bool) -> None:
        if self.first is not None:
            speed.observe(uncached_tokens, self.first - self.sent, self.last - self.first,
                          self.after_first, queued)
