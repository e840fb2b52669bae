"""OpenAI response shapes: completion and chat completion bodies and their SSE chunks."""

from __future__ import annotations

import json
from typing import Any

from router.dispatch import Choice, ChoiceDelta, TokenLogprob
from router.job import Job
from router.tokenizer import Tokenizer


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def sse(obj: Any) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class Renderer:
    """Builds one job's response objects; `chat` picks the chat or the completion shape."""

    def __init__(
        self,
        job: Job,
        tokenizer: Tokenizer,
        chat: bool,
        top_logprobs: int | None,
        return_token_ids: bool = False,
    ) -> None:
        self.job = job
        self.tokenizer = tokenizer
        self.chat = chat
        self.top = top_logprobs  # None: no logprobs in the response
        self.return_token_ids = return_token_ids
        self.object = "chat.completion" if chat else "text_completion"
        self.id = ("chatcmpl-" if chat else "cmpl-") + job.request_id
        self._offsets: dict[int, int] = {}  # completions: text offset per choice
        # Streams without logprobs or ids: each chunk is this prefix + a small formatted tail,
        # so the per-token cost is one string escape instead of a whole json.dumps.
        object_ = "chat.completion.chunk" if chat else "text_completion"
        self._plain = top_logprobs is None and not return_token_ids
        self._prefix = b"data: " + _dumps(self._head(object_))[:-1] + b',"choices":[{"index":'

    def _head(self, object_: str) -> dict:
        return {
            "id": self.id,
            "object": object_,
            "created": self.job.created,
            "model": self.job.model,
        }

    def body(self, runs: list[Choice], texts: list[str], usage: dict) -> dict:
        """The non-streaming response; `texts[i]` is choice i's whole text."""
        choices = []
        for run, text in zip(runs, texts, strict=True):
            lps = [lp for d in run.deltas_seen for lp in d.logprobs]
            if self.chat:
                choice: dict[str, Any] = {
                    "index": run.index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": self._chat_logprobs(lps),
                    "finish_reason": run.finish_reason,
                }
            else:
                choice = {
                    "index": run.index,
                    "text": text,
                    "logprobs": self._completion_logprobs(run.index, lps),
                    "finish_reason": run.finish_reason,
                }
            if self.return_token_ids:
                choice["token_ids"] = run.token_ids
                choice["prompt_token_ids"] = self.job.prompts[run.index // self.job.n]
            choices.append(choice)
        return {**self._head(self.object), "choices": choices, "usage": usage}

    def first_chunk(self, index: int) -> bytes:
        """Chat streams open each choice with the assistant role."""
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return sse({**self._head("chat.completion.chunk"), "choices": [choice]})

    def chunk(self, delta: ChoiceDelta) -> bytes:
        if self._plain:
            return self._plain_chunk(delta)
        if self.chat:
            choice: dict[str, Any] = {
                "index": delta.index,
                "delta": {"content": delta.text} if delta.text else {},
                "logprobs": self._chat_logprobs(delta.logprobs),
                "finish_reason": delta.finish_reason,
            }
            object_ = "chat.completion.chunk"
        else:
            choice = {
                "index": delta.index,
                "text": delta.text,
                "logprobs": self._completion_logprobs(delta.index, delta.logprobs),
                "finish_reason": delta.finish_reason,
            }
            object_ = "text_completion"
        if self.return_token_ids:
            choice["token_ids"] = delta.token_ids
        return sse({**self._head(object_), "choices": [choice]})

    def _plain_chunk(self, delta: ChoiceDelta) -> bytes:
        text = json.dumps(delta.text)
        finish = "null" if delta.finish_reason is None else json.dumps(delta.finish_reason)
        if self.chat:
            content = f'{{"content":{text}}}' if delta.text else "{}"
            tail = f'{delta.index},"delta":{content},"logprobs":null,"finish_reason":{finish}}}]}}'
        else:
            tail = f'{delta.index},"text":{text},"logprobs":null,"finish_reason":{finish}}}]}}'
        return self._prefix + tail.encode() + b"\n\n"

    def usage_chunk(self, usage: dict) -> bytes:
        object_ = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self._head(object_), "choices": [], "usage": usage})

    def _alternatives(self, top: list[tuple[int, float]]) -> list[tuple[str, float]]:
        return [(self.tokenizer.token_text(t), lp) for t, lp in top[: self.top or 0]]

    def _chat_logprobs(self, lps: list[TokenLogprob]) -> dict | None:
        if self.top is None:
            return None
        content = []
        for token, lp, top in lps:
            text = self.tokenizer.token_text(token)
            content.append(
                {
                    "token": text,
                    "logprob": lp,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {"token": t, "logprob": v, "bytes": list(t.encode())}
                        for t, v in self._alternatives(top)
                    ],
                }
            )
        return {"content": content}

    def _completion_logprobs(self, index: int, lps: list[TokenLogprob]) -> dict | None:
        if self.top is None:
            return None
        tokens, values, tops, offsets = [], [], [], []
        offset = self._offsets.get(index, 0)
        for token, lp, top in lps:
            text = self.tokenizer.token_text(token)
            tokens.append(text)
            values.append(lp)
            tops.append(dict(self._alternatives(top)))
            offsets.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }
