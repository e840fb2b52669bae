"""Running the choices of one OpenAI request: dispatch, detokenize, stop strings, accounting.

A `Job` is a validated request reduced to what generation needs (token ids, sampling, stop
strings). Each choice (prompt x n) is one `Dispatch`; `ChoiceRun` turns its chunks into
`ChoiceDelta`s of text. Stop strings end a choice in the router: the worker is told to abort.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from router.dispatch import Dispatch, Dispatcher
from router.metrics import RouterMetrics
from router.tokenizer import TextStream, Tokenizer
from worker.protocol import GenerateRequest, SamplingParams

TokenLogprob = tuple[int, float, list[tuple[int, float]]]  # token, logprob, top alternatives


@dataclass
class Job:
    """One OpenAI request, validated and tokenized."""

    request_id: str
    model: str
    prompts: list[list[int]]
    sampling: SamplingParams
    n: int = 1
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    session_id: str | None = None
    namespace: str | None = None
    session_ttl_s: float | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.perf_counter)

    def generate_requests(self) -> list[GenerateRequest]:
        """One request per choice, index = prompt * n + i; seeds differ per choice."""
        out = []
        for p, ids in enumerate(self.prompts):
            for i in range(self.n):
                sampling = self.sampling
                if sampling.seed is not None and i:
                    sampling = dataclasses.replace(sampling, seed=sampling.seed + i)
                out.append(
                    GenerateRequest(
                        request_id=f"{self.request_id}-{p * self.n + i}",
                        input_ids=ids,
                        sampling=sampling,
                        namespace=self.namespace,
                        session_id=self.session_id,
                        session_ttl_s=self.session_ttl_s if self.session_id else None,
                    )
                )
        return out


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None


class ChoiceRun:
    """One choice: its dispatch and its text stream."""

    def __init__(
        self, index: int, dispatch: Dispatch, job: Job, tokenizer: Tokenizer, metrics: RouterMetrics
    ) -> None:
        self.index = index
        self.dispatch = dispatch
        self.job = job
        self.metrics = metrics
        self.text = TextStream(tokenizer, job.stop, job.skip_special_tokens)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.deltas_seen: list[ChoiceDelta] = []  # kept only when logprobs are asked for

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        last = time.perf_counter()
        try:
            async for chunk in self.dispatch:
                t = time.perf_counter()
                if not self.token_ids:
                    self.metrics.ttft.observe(t - self.job.arrival)
                elif chunk.token_ids:
                    self.metrics.inter_token.observe((t - last) / len(chunk.token_ids))
                last = t
                delta = self._apply(chunk)
                if delta.text or delta.token_ids or delta.finish_reason:
                    yield delta
                if self.finish_reason:
                    return
        finally:
            await self.dispatch.close()

    def _apply(self, chunk) -> ChoiceDelta:
        ids = list(chunk.token_ids)
        self.token_ids.extend(ids)
        text = self.text.push(ids)
        finish = chunk.finish_reason
        if self.text.stopped:
            finish = "stop"
        elif finish is not None:
            text += self.text.finish()
        self.finish_reason = finish
        delta = ChoiceDelta(self.index, text, ids, _logprobs(chunk), finish)
        if delta.logprobs:
            self.deltas_seen.append(delta)
        return delta

    @property
    def cached_tokens(self) -> int:
        return self.dispatch.cached_tokens


def _logprobs(chunk) -> list[TokenLogprob]:
    if chunk.logprobs is None:
        return []
    tops = chunk.top_logprobs or [[] for _ in chunk.logprobs]
    return [
        (t, lp, list(top))
        for t, lp, top in zip(chunk.token_ids, chunk.logprobs, tops, strict=False)
    ]


async def open_choices(
    job: Job, dispatcher: Dispatcher, tokenizer: Tokenizer, metrics: RouterMetrics
) -> list[ChoiceRun]:
    """Starts every choice; on any failure closes the ones started and re-raises."""
    requests = job.generate_requests()
    expected = job.sampling.max_tokens
    if len(requests) == 1:  # the common case, without a task per choice
        return [ChoiceRun(0, await dispatcher.open(requests[0], expected), job, tokenizer, metrics)]
    results = await asyncio.gather(
        *(dispatcher.open(r, expected) for r in requests), return_exceptions=True
    )
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for r in results:
            if isinstance(r, Dispatch):
                await r.close()
        raise errors[0]
    return [ChoiceRun(i, d, job, tokenizer, metrics) for i, d in enumerate(results)]


async def merged(runs: list[ChoiceRun]) -> AsyncIterator[ChoiceDelta]:
    """Deltas of all choices as they come; one choice needs no queue."""
    if len(runs) == 1:
        async for delta in runs[0].deltas():
            yield delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: ChoiceRun) -> None:
        try:
            async for delta in run.deltas():
                await queue.put(delta)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer below
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(r)) for r in runs]
    try:
        for _ in range(len(runs)):
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def account(job: Job, runs: list[ChoiceRun], metrics: RouterMetrics) -> dict:
    """The usage object of a finished job, and its metrics."""
    prompt = sum(len(p) for p in job.prompts)
    completion = sum(len(r.token_ids) for r in runs)
    cached = sum(runs[p * job.n].cached_tokens for p in range(len(job.prompts)))
    predicted = sum(runs[p * job.n].dispatch.predicted_tokens for p in range(len(job.prompts)))
    metrics.prompt_tokens.inc(prompt)
    metrics.generation_tokens.inc(completion)
    metrics.cached_actual.inc(cached)
    metrics.cached_predicted.inc(predicted)
    metrics.e2e.observe(time.perf_counter() - job.arrival)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
