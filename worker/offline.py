"""Drive an `Engine` to completion in-process, without Ray: for tests, benchmarks and scripts."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from worker.engine import Engine
from worker.protocol import GenerateRequest, TokenChunk


@dataclass
class Completion:
    """Everything one request streamed, joined."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    num_chunks: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    def add(self, chunk: TokenChunk) -> None:
        self.token_ids.extend(chunk.token_ids)
        self.finish_reason = chunk.finish_reason
        self.prompt_tokens = chunk.prompt_tokens
        self.cached_tokens = chunk.cached_tokens
        self.num_chunks += 1
        self.logprobs.extend(chunk.logprobs or [])
        self.top_logprobs.extend(chunk.top_logprobs or [])


def run_to_completion(
    engine: Engine,
    requests: Iterable[GenerateRequest] = (),
    after_step: Callable[[Engine, int], None] | None = None,
    max_steps: int = 1_000_000,
) -> dict[str, Completion]:
    """Add `requests`, step until the engine is idle; `after_step(engine, step)` runs after
    every step (tests check integrity or abort there). Returns a Completion per request id."""
    out: dict[str, Completion] = {}
    for req in requests:
        engine.add_request(req)
        out[req.request_id] = Completion()
    step = 0
    while engine.has_work():
        if step >= max_steps:
            raise RuntimeError(f"engine still busy after {max_steps} steps")
        for chunk in engine.step():
            out.setdefault(chunk.request_id, Completion()).add(chunk)
        if after_step is not None:
            after_step(engine, step)
        step += 1
    return out
