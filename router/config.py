"""RouterConfig: every knob of the HTTP router, with its default, in one place."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from router.routing.cost_terms import TERMS, CostTerms
from router.routing.estimate import EstimateConfig


@dataclass
class RouterConfig:
    """Configuration of the router app (`router.api.app.create_app`).

    model: the model id clients name in `model` and `/v1/models` lists.
    tokenizer: HF model directory whose tokenizer and chat template the router uses;
        None: `model` itself is taken as a directory.
    policy: routing policy name (`router.routing.policies.POLICY_NAMES`); `cost` is the default.
    api_key: when set, inference (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
        `/v1/sessions/*`) needs `Authorization: Bearer <api_key>` (`router.api.access`).
    admin_key: when set, the admin verbs (add, drain, remove workers) need
        `Authorization: Bearer <admin_key>`; None: they answer loopback clients only. The
        inference key never opens them.
    metrics_public: `/metrics` and `GET /v1/workers` answer every client; False: the admin key
        or a loopback client only.
    max_body_bytes: larger request bodies get 413.
    body_timeout_s: a request body must arrive in full within this long of the headers, else
        408 (the connection is closed). 0: no deadline.
    send_timeout_s: a client that takes no byte of its response for this long (a stream it
        stopped reading) is dropped: the request is aborted on its worker. 0: no deadline.
    max_header_bytes: request headers larger than this in total get 431.
    max_context: context length in tokens (prompt + max_tokens); None: the smallest
        `max_context` the workers report, else the tokenizer's `model_max_length`, else 4096.
    max_n: the largest `n` (choices per request) accepted.
    default_chat_max_tokens: chat requests without max_tokens generate at most this many
        tokens (and never past the context).
    max_failovers: how many times one request may move to another worker after its worker
        failed (before or after the first token).
    stall_timeout_s: a worker that sends a request nothing (no first token, no next token)
        for this long, its polled stats unchanged meanwhile, is taken for hung: the request
        fails over as from a dead worker, and the worker is marked dead (routed to again once
        its probe answers). 0: no deadline.
    max_concurrent: generation requests (completions, chat) in flight at once; one more gets
        429 with `Retry-After: retry_after_s` instead of a queue without bound. 0: no limit.
    retry_after_s: the `Retry-After` a 429 advises, in whole seconds.
    tokenize_threads: threads that parse request bodies, render chat templates and tokenize
        prompts, so none of it runs on the event loop; the tokenizer releases the GIL while
        it encodes, so prompts are tokenized on more than one core. 0: all on the loop.
    drain_timeout_s: on shutdown (SIGTERM), how long in-flight requests may take to finish.
    block_size: tokens per hashed block; overridden by what the workers report.
    namespace: block-hash namespace of every request (a cache salt); None: the default.
    event_poll_s / stats_poll_s: how often KV events / worker stats are pulled.
    revive_s: how often a worker marked dead is probed to see whether it came back.
    session_ttl_s: idle lifetime of a session's KV on its worker.
    cost_config: overrides of the core's estimate and the `cost` terms (`cost_config`).
    kv_groups: index every KV group of a hybrid model (sliding-window, recurrent) and predict
        where a prefix can really resume; False: its full-attention group only, as routers
        blind to hybrid models do (they over-predict; kept for comparison).
    """

    model: str = "tiny"
    tokenizer: str | None = None
    policy: str = "cost"
    api_key: str | None = None
    admin_key: str | None = None
    metrics_public: bool = False
    max_body_bytes: int = 8 * 1024 * 1024
    body_timeout_s: float = 30.0
    send_timeout_s: float = 30.0
    max_header_bytes: int = 64 * 1024
    max_context: int | None = None
    max_n: int = 16
    default_chat_max_tokens: int = 1024
    max_failovers: int = 2
    stall_timeout_s: float = 60.0
    max_concurrent: int = 1024
    retry_after_s: int = 1
    tokenize_threads: int = 2
    drain_timeout_s: float = 30.0
    block_size: int = 16
    namespace: str | None = None
    event_poll_s: float = 0.05
    stats_poll_s: float = 0.5
    revive_s: float = 2.0
    session_ttl_s: float = 600.0
    cost_config: dict = field(default_factory=dict)
    kv_groups: bool = True


def cost_config(
    overrides: dict | None = None,
    estimate: EstimateConfig | None = None,
    terms: CostTerms | None = None,
) -> tuple[EstimateConfig, CostTerms]:
    """The core's estimate config and the `cost` terms, `estimate` and `terms` (default: the
    defaults) with `overrides` applied: a JSON object as `--cost-config` gives it, e.g.
    `{"compute": {"idle_while_decoding": true}, "guard": null, "estimate": {"step_noise": 0.1},
    "tail_ttft_s": 3}`. A term set to null is off. Unknown names or values of the wrong type
    raise ValueError."""
    overrides = dict(overrides or {})
    estimate = _replaced(estimate or EstimateConfig(), overrides.pop("estimate", {}), "estimate")
    return estimate, _replaced(terms or CostTerms(), overrides, "cost")


def _replaced(base: Any, overrides: Any, where: str) -> Any:
    """`base` (a dataclass) with `overrides` (field name -> value, nested for nested ones)."""
    if not isinstance(overrides, dict):
        raise ValueError(f"cost config {where!r} must be an object, got {overrides!r}")
    names = {f.name: f for f in fields(base)}
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise ValueError(f"unknown cost config keys {unknown} in {where!r}; known: {sorted(names)}")
    values = {}
    for name, value in overrides.items():
        current = getattr(base, name)
        if name in TERMS:
            default = type(getattr(CostTerms(), name))
            values[name] = None if value is None else _replaced(current or default(), value, name)
            continue
        kind = type(current)  # bool, int or float; an int does for a float
        if kind is bool:
            ok = isinstance(value, bool)
        else:
            ok = isinstance(value, int | float if kind is float else int)
            ok = ok and not isinstance(value, bool)
        if not ok:
            wanted = {bool: "true or false", int: "an integer", float: "a number"}[kind]
            raise ValueError(f"cost config {where}.{name} must be {wanted}, got {value!r}")
        values[name] = value
    return replace(base, **values)
