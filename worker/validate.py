"""Checks on a `GenerateRequest` before the engine accepts it: ValueError says what is wrong.

A request that passes can always finish: its prompt plus `max_tokens` fits the context and the
KV pool, so the scheduler can make progress by retracting the others.
"""

from __future__ import annotations

from worker.protocol import GenerateRequest, SamplingParams

MAX_LOGPROBS = 20  # the OpenAI API's limit for top_logprobs


def validate_request(
    req: GenerateRequest, vocab_size: int, max_context: int, kv_tokens: int, page_size: int
) -> None:
    if not isinstance(req.request_id, str) or not req.request_id:
        raise ValueError("request_id must be a non-empty string")
    if not req.input_ids:
        raise ValueError("the prompt is empty")
    for ids, what in ((req.input_ids, "prompt"), (req.resume_ids, "resume_ids")):
        if any(type(t) is not int or t < 0 or t >= vocab_size for t in ids):  # bool is no id
            raise ValueError(f"{what} has a token id outside 0..{vocab_size - 1}")
    sp = req.sampling
    _validate_sampling(sp)
    if len(req.resume_ids) >= sp.max_tokens:
        raise ValueError("resume_ids already reach max_tokens")
    total = len(req.input_ids) + sp.max_tokens
    if total > max_context:
        raise ValueError(
            f"prompt ({len(req.input_ids)} tokens) + max_tokens ({sp.max_tokens}) exceeds the "
            f"context length {max_context}"
        )
    if total + page_size > kv_tokens:
        raise ValueError(
            f"prompt + max_tokens ({total} tokens) does not fit this worker's KV pool "
            f"({kv_tokens} tokens)"
        )
    if req.session_ttl_s is not None and not req.session_ttl_s > 0:
        raise ValueError("session_ttl_s must be positive")


def _validate_sampling(sp: SamplingParams) -> None:
    if sp.max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    if not 0 <= sp.min_tokens <= sp.max_tokens:
        raise ValueError("min_tokens must be between 0 and max_tokens")
    if not sp.temperature >= 0:
        raise ValueError("temperature must be >= 0")
    if not 0 < sp.top_p <= 1:
        raise ValueError("top_p must be in (0, 1]")
    if sp.top_k < -1:
        raise ValueError("top_k must be -1 (off), 0 (off) or positive")
    if not 0 <= sp.min_p <= 1:
        raise ValueError("min_p must be in [0, 1]")
    if not -2 <= sp.presence_penalty <= 2 or not -2 <= sp.frequency_penalty <= 2:
        raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
    if not sp.repetition_penalty > 0:
        raise ValueError("repetition_penalty must be > 0")
    if sp.logprobs is not None and not 0 <= sp.logprobs <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}")
    if any(not isinstance(t, int) for t in sp.stop_token_ids):
        raise ValueError("stop_token_ids must be integers")
