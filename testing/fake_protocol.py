"""OpenAI request parsing and response bodies of the fake workers (`testing.fake_worker`), and
their refusal of HTTP/2 (`HTTP2_PROBES`, a filter on aiohttp's server log)."""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage


def word_tokenizer(text: str) -> list[int]:
    """One token per whitespace-separated word (crc32), for runs without a real tokenizer."""
    return [zlib.crc32(w.encode()) & 0x7FFFFFFF for w in text.split()] or [0]


def load_tokenizer(name: str | None) -> Callable[[str], list[int]]:
    if not name or name == "words":
        return word_tokenizer
    from transformers import AutoTokenizer

    from worker.loader.builtin import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(name)))
    return lambda text: tok.encode(text, add_special_tokens=False) or [0]


def error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


def parse_request(
    body: object, chat: bool, encode: Callable[[str], list[int]]
) -> tuple[list[int], int]:
    """(prompt token ids, max_tokens); ValueError on a bad request."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", 16))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError("max_tokens must be a positive integer")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        text = "\n".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
        return encode(text), max_tokens
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt), max_tokens
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("prompt must be a non-empty string or list of token ids")
    return encode(prompt), max_tokens


@dataclass
class ResponseShape:
    """OpenAI response bodies for one request."""

    rid: str
    model: str
    worker_id: str
    chat: bool
    prompt_tokens: int

    def _base(self) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.rid, "object": kind, "created": int(time.time()),
                "model": self.model, "system_fingerprint": self.worker_id}

    def usage(self, completion: int, cached: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _choice(self, text: str, ids: list[int], finish: str | None, stream: bool) -> dict:
        if self.chat:
            key = "delta" if stream else "message"
            return {"index": 0, key: {"role": "assistant", "content": text},
                    "finish_reason": finish, "token_ids": ids}
        return {"index": 0, "text": text, "token_ids": ids, "logprobs": None,
                "finish_reason": finish}

    def chunk(self, i: int, finish: str | None) -> dict:
        body = self._base() | {"choices": [self._choice(" x", [_token(i)], finish, True)]}
        if self.chat:
            body["object"] = "chat.completion.chunk"
        return body

    def usage_chunk(self, completion: int, cached: int) -> dict:
        body = self._base() | {"choices": [], "usage": self.usage(completion, cached)}
        if self.chat:
            body["object"] = "chat.completion.chunk"
        return body

    def full(self, n: int, cached: int) -> dict:
        choice = self._choice(" x" * n, [_token(i) for i in range(n)], "length", False)
        return self._base() | {"choices": [choice], "usage": self.usage(n, cached)}

    @staticmethod
    def sse(body: dict) -> bytes:
        return b"data: " + json.dumps(body).encode() + b"\n\n"


def _token(i: int) -> int:
    return 120 + i % 20  # printable single-byte ids in a byte-level vocabulary


class Http2ProbeFilter(logging.Filter):
    """Drops aiohttp's traceback for an HTTP/2 connection preface (a gRPC client probing the
    worker; its HTTP/1.1 requests work) and says so once, in one line."""

    seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, BadHttpMessage) or "PRI/Upgrade" not in str(exc):
            return True
        if not self.seen:
            self.seen = True
            logging.getLogger("testing.fake_worker").warning(
                "fake worker: HTTP/2 (gRPC) connections are refused with 400; HTTP/1.1 only")
        return False


HTTP2_PROBES = Http2ProbeFilter()
