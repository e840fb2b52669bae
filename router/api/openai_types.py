"""OpenAI request bodies: parsing and validation into typed models, errors as APIError(400).

Unknown fields are ignored (clients of vLLM and SGLang send many). Numbers are strict, as in
OpenAI's API: an integer field takes a JSON integer only (not `"5"`, `true` or `5.0`), a number
field a JSON number (not a string or a boolean). A `tool` message needs its `tool_call_id`.
Extensions accepted beside
the OpenAI fields: top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
skip_special_tokens, session_id, return_token_ids (vLLM's: output ids in each choice).
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic import StrictFloat as Number  # takes an int too, never a str or bool
from pydantic import StrictInt as Int

from router.errors import APIError, bad_request

M = TypeVar("M", bound=BaseModel)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: StrictBool = False


class SamplingFields(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: Number | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Number | None = Field(default=None, gt=0.0, le=1.0)
    n: Int = Field(default=1, ge=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int | None = None
    presence_penalty: Number = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: Number = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = None
    top_k: Int = Field(default=-1, ge=-1)
    min_p: Number = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: Number = Field(default=1.0, gt=0.0, le=10.0)
    min_tokens: Int = Field(default=0, ge=0)
    ignore_eos: StrictBool = False
    stop_token_ids: list[Int] | None = None
    skip_special_tokens: StrictBool = True
    session_id: str | None = Field(default=None, min_length=1, max_length=256)
    return_token_ids: StrictBool = False

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = Field(default=16, ge=1)
    logprobs: Int | None = Field(default=None, ge=0, le=20)
    echo: StrictBool = False


class ChatMessage(BaseModel):
    """One message; extra keys (name, tool_calls, tool_call_id) go on to the chat template."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    tool_call_id: str | None = Field(default=None, validate_default=True)

    @field_validator("tool_call_id")
    @classmethod
    def _tool_answers_a_call(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("role") == "tool" and not value:
            raise ValueError("a message with role 'tool' needs its 'tool_call_id'")
        return value


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template wants them: content parts flattened to text."""
        out = []
        for i, m in enumerate(self.messages):
            msg = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                msg["content"] = _text_of_parts(m.content, i)
            out.append(msg)
        return out


def _text_of_parts(parts: list[dict[str, Any]], index: int) -> str:
    texts = []
    for part in parts:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(
                "only text content parts are supported", param=f"messages[{index}].content"
            )
        texts.append(part["text"])
    return "".join(texts)


def parse_body(cls: type[M], raw: bytes) -> M:
    """Strict UTF-8, then JSON, then the model's validation; each failure is a 400."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _validation_error(exc: ValidationError) -> APIError:
    first = exc.errors(include_url=False)[0]
    loc = [str(p) for p in first.get("loc", ()) if not _is_union_tag(p)]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "missing":
        message = f"'{param}' is a required property"
    elif param:
        message = f"Invalid value for '{param}': {message}"
    return bad_request(message, param=param)


def _is_union_tag(part: Any) -> bool:
    """pydantic names the union member tried (`str`, `list[int]`) in the error location."""
    return isinstance(part, str) and (part in ("str", "int", "float") or "[" in part)
