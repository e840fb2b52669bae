"""Request building: validated OpenAI bodies in, `Job`s out.

`JobBuilder` checks the model name, the prompt (text or token ids, within the vocabulary), the
sampling parameters and the context length, tokenizes (the chat template for chat), and
returns the `Job`: a request reduced to what generation needs (token ids, sampling, stop
strings), one `GenerateRequest` per choice. Every failure is an APIError 4xx.
"""

from __future__ import annotations

import uuid
from typing import Any

from router.api.openai_types import ChatRequest, CompletionRequest, SamplingFields
from router.config import RouterConfig
from router.errors import bad_request, model_not_found
from router.job import Job
from router.routing.registry import WorkerRegistry
from router.tokenizer import Tokenizer
from worker.protocol import SamplingParams

MAX_CHOICES = 128  # prompts x n per request
MAX_STOP = 16


class JobBuilder:
    """Turns validated request bodies into `Job`s (see the module docstring)."""

    def __init__(
        self, config: RouterConfig, tokenizer: Tokenizer, registry: WorkerRegistry
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.registry = registry

    def context_limit(self) -> int:
        for limit in (
            self.config.max_context,
            self.registry.max_context(),
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
