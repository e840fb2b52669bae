"""The model's own HF tokenizer and chat template, and incremental detokenization with stop strings.

The router tokenizes once; workers get token ids. Output goes the other way: `TextStream` turns
token ids into text as they arrive, never emitting half of a multi-byte character, and holds back
any tail that could still become a stop string, so a client never sees part of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream

_REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


class Tokenizer:
    """Wraps `transformers.AutoTokenizer.from_pretrained(path)` (a model directory)."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer  # heavy import: only when a router is built

        self.path = str(path)
        self.hf = AutoTokenizer.from_pretrained(self.path)
        self.vocab_size: int = len(self.hf)
        eos = self.hf.eos_token_id
        self.eos_token_ids: list[int] = [] if eos is None else [int(eos)]
        # The Rust tokenizer underneath, called directly: the same ids and text without
        # transformers' per-call Python overhead (several times the encoding itself).
        self.fast = getattr(self.hf, "backend_tokenizer", None) if self.hf.is_fast else None
        if getattr(self.hf, "clean_up_tokenization_spaces", False):
            self.fast = None  # decode post-processing only transformers does
        self._single: dict[tuple[int, bool], str] = {}  # at most 2 x vocab entries
        limit = getattr(self.hf, "model_max_length", None)
        sane = isinstance(limit, int) and limit < 1 << 30  # HF uses a huge int for "unknown"
        self.model_max_length: int | None = limit if sane else None

    def encode(self, text: str) -> list[int]:
        """Token ids of a completion prompt (with the model's BOS if it uses one)."""
        return self._encode(text, True)

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of a piece of text alone (no BOS): for re-tokenizing generated text."""
        return self._encode(text, False)

    def _encode(self, text: str, special: bool) -> list[int]:
        if self.fast is None:
            return list(self.hf.encode(text, add_special_tokens=special))
        # `encode` would give the same ids, but holds the GIL; `encode_batch` releases it while
        # it works (about 1 us more per call), so the router's tokenize threads (`Router.off_loop`)
        # run on other cores than the event loop.
        return self.fast.encode_batch([text], add_special_tokens=special)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if len(ids) == 1:  # streaming decodes single tokens all the time: remember them
            key = (ids[0], skip_special_tokens)
            text = self._single.get(key)
            if text is None:
                text = self._single[key] = self._decode(ids, skip_special_tokens)
            return text
        return self._decode(ids, skip_special_tokens)

    def _decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        if self.fast is not None:
            return self.fast.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token alone (for logprobs); partial characters stay as U+FFFD."""
        return self.hf.decode([token_id], skip_special_tokens=False)

    def apply_chat(self, messages: list[dict[str, Any]], tools: list | None = None) -> list[int]:
        """Token ids of `messages` under the chat template, ending with the assistant's turn.

        Raises ValueError when the template rejects the conversation (or there is none).
        """
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("the model has no chat template; use /v1/completions")
        try:
            text = self.hf.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # jinja raises its own types for bad conversations
            raise ValueError(f"chat template rejected the messages: {exc}") from exc
        return self.encode_plain(text)


class TextStream:
    """Token ids in, text out, for one choice of one request.

    `push(ids)` returns the text that is now safe to send: complete characters, with any tail
    that could be the start of a stop string held back. Once a stop string is seen, `stopped` is
    True, the text before it was returned and everything after is dropped. `finish()` returns
    what was held back when the generation ends without a stop string.

    The characters come from the tokenizer's own incremental decoder (`tokenizers`'
    `DecodeStream`, as vLLM uses), which waits while the ids end inside a character. A
    tokenizer without one (no Rust backend, or transformers' clean-up of spaces) decodes the ids
    since the last text with the step before them as left context, so a push costs a few ids
    whatever the length. Either way the text is the decode of all ids, pushed in any pieces.
    """

    def __init__(
        self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] gave the last text: the left context of the next
        self.read = 0  # ids before this have been turned into text
        self.held = ""  # decoded text not yet sent: it may begin a stop string
        self.stopped = False
        self.text = ""  # everything sent so far
        self.decoder: DecodeStream | None = None
        if tokenizer.fast is not None:
            self.decoder = DecodeStream(skip_special_tokens=skip_special_tokens)

    def push(self, ids: Sequence[int]) -> str:
        if self.stopped or not ids:
            return ""
        start = len(self.ids)
        self.ids.extend(ids)
        if self.decoder is None:
            return self._release(self._decode_window())
        pieces = []
        for end, i in enumerate(ids, start + 1):
            piece = self.decoder.step(self.tokenizer.fast, i)
            if piece is not None:  # None: the ids so far end inside a character
                pieces.append(piece)
                self.prefix, self.read = self.read, end
        return self._release("".join(pieces))

    def _decode_window(self) -> str:
        before = self._decode(self.ids[self.prefix : self.read])
        now = self._decode(self.ids[self.prefix :])
        if now.endswith(_REPLACEMENT) or len(now) <= len(before):
            return ""  # an incomplete character (or nothing visible yet): wait for more ids
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before) :]

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def finish(self) -> str:
        """Flush at end of generation: held text plus any trailing partial character."""
        if self.stopped:
            return ""
        tail = ""
        if self.read < len(self.ids):  # ids end inside a character: U+FFFD, as in one go
            before = self._decode(self.ids[self.prefix : self.read])
            tail = self._decode(self.ids[self.prefix :])[len(before) :]
            self.read = len(self.ids)
        out = self._release(tail)
        if not self.stopped:
            out += self.held
            self.text += self.held
            self.held = ""
        return out

    def _release(self, new_text: str) -> str:
        buf = self.held + new_text
        if not self.stop:
            self.held = ""
            self.text += buf
            return buf
        cut = _first_stop(buf, self.stop)
        if cut is not None:
            self.stopped = True
            self.held = ""
            self.text += buf[:cut]
            return buf[:cut]
        keep = _stop_prefix_len(buf, self.stop)
        out, self.held = buf[: len(buf) - keep], buf[len(buf) - keep :]
        self.text += out
        return out


def _first_stop(text: str, stop: list[str]) -> int | None:
    """Index of the earliest stop string in `text`, or None."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits) if hits else None


def _stop_prefix_len(text: str, stop: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
