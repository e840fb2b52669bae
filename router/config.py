"""RouterConfig: every knob of the HTTP router, with its default, in one place."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RouterConfig:
    """Configuration of the router app (`router.app.create_app`).

    model: the model id clients name in `model` and `/v1/models` lists.
    tokenizer: HF model directory whose tokenizer and chat template the router uses;
        None: `model` itself is taken as a directory.
    policy: routing policy name (`router.policies.POLICY_NAMES`); `cost` is the default.
    api_key: when set, every `/v1/*` request needs `Authorization: Bearer <api_key>`.
    max_body_bytes: larger request bodies get 413.
    max_context: context length in tokens (prompt + max_tokens); None: the smallest
        `max_context` the workers report, else the tokenizer's `model_max_length`, else 4096.
    max_n: the largest `n` (choices per request) accepted.
    default_chat_max_tokens: chat requests without max_tokens generate at most this many
        tokens (and never past the context).
    max_failovers: how many times one request may move to another worker after its worker
        failed (before or after the first token).
    block_size: tokens per hashed block; overridden by what the workers report.
    namespace: block-hash namespace of every request (a cache salt); None: the default.
    event_poll_s / stats_poll_s: how often KV events / worker stats are pulled.
    revive_s: how often a worker marked dead is probed to see whether it came back.
    session_ttl_s: idle lifetime of a session's KV on its worker.
    """

    model: str = "tiny"
    tokenizer: str | None = None
    policy: str = "cost"
    api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    max_context: int | None = None
    max_n: int = 16
    default_chat_max_tokens: int = 1024
    max_failovers: int = 2
    block_size: int = 16
    namespace: str | None = None
    event_poll_s: float = 0.05
    stats_poll_s: float = 0.5
    revive_s: float = 2.0
    session_ttl_s: float = 600.0
