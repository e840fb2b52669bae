"""The messages between the router and a worker: plain dataclasses (Ray pickles them).

The router imports this module and nothing else of `worker`, so it must stay free of torch,
Ray and the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token. Defaults follow the OpenAI API."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n >= 0: the chosen token's plus top-n


@dataclass(slots=True)
class GenerateRequest:
    """One generation on one worker. The router has already tokenized: ids only, never text.

    `resume_ids` are output tokens already streamed to the client by a worker that then died:
    the new worker prefills `input_ids + resume_ids` and continues, counting them against
    `max_tokens`, so the client's stream goes on where it stopped.
    """

    request_id: str
    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    namespace: str | None = None
    session_id: str | None = None
    session_ttl_s: float | None = None
    resume_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class TokenChunk:
    """The tokens one engine step produced for one request (one or more per chunk).

    `finish_reason` is None while running, then "stop", "length" or "abort" on the last chunk.
    `cached_tokens` is the real prefix reuse of this request (set from the first chunk on);
    `top_logprobs[i]` lists (token_id, logprob) pairs for `token_ids[i]` when asked for.
    """

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    error: str | None = None


@dataclass(slots=True, frozen=True)
class EngineShape:
    """The engine facts routing depends on, as a worker reports them in `ready()` (the dict
    keys of the same names). Defaults are our engine's defaults (`worker.engine.EngineConfig`),
    taken for a key a worker does not report.

    block_size: tokens per hashed block (KV events, the router's index).
    page_size: tokens per KV page.
    max_context: prompt + output tokens of one request (0: not reported).
    max_running: requests the engine runs at once; more wait.
    prefill_budget: tokens one engine step computes (chunked prefill).
    """

    block_size: int = 16
    page_size: int = 1
    max_context: int = 0
    max_running: int = 64
    prefill_budget: int = 512

    @classmethod
    def from_info(cls, info: dict[str, Any], default: EngineShape | None = None) -> EngineShape:
        """The shape in a `ready()` answer; a missing, null or zero key keeps `default`'s value
        (the class defaults when None)."""
        known = {f.name for f in fields(cls)}
        return replace(default or cls(), **{k: int(v) for k, v in info.items() if k in known and v})


@dataclass(slots=True)
class WorkerStats:
    """A worker's load and KV accounting, all KV figures in tokens (slots)."""

    worker_id: str
    kv_total: int = 0
    kv_free: int = 0
    kv_evictable: int = 0
    kv_protected: int = 0
    kv_session: int = 0
    kv_host_total: int = 0
    kv_host_free: int = 0
    running: int = 0
    waiting: int = 0
    waiting_prefill_tokens: int = 0
    running_decode_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    # the prompt tokens that speed was measured over (its own traffic, since it joined): a
    # figure over few of them is checked against the peers' (`router.routing.speeds`)
    prefill_tokens_measured: int = 0
    decode_step_s: float = 0.0
    sessions: int = 0
    page_size: int = 1
    block_size: int = 16
    max_context: int = 0
    model: str = ""
