"""One request's state inside the engine: its tokens, where their KV lives, how far it got.

A request is one growing token sequence, `tokens = input_ids + resume_ids + generated`. The
engine runs the model over `tokens[num_computed:]` (a prefill chunk, or the one last sampled
token when decoding); once `num_computed == len(tokens)` the logits of the last position give
the next token. A retracted (preempted) request simply goes back to `num_computed == 0` and
prefills its prompt and output so far again, mostly from the radix cache.

KV regions of a running request (slots in its `req_to_token` row, by token position):

    [0, prefix_len)            owned by the radix tree, protected by the lock on `node`
    [prefix_len, alloc_len)    owned by the request ("tail"): whole pages from the allocator
    [num_computed, alloc_len)  allocated but not yet written (the current step fills them)

`prefix_len` and `alloc_len` are multiples of the page size; `prefix_len <= num_computed <=
alloc_len`. A waiting request holds no KV at all (no row, no lock, no tail).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from worker.protocol import GenerateRequest, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Engine-side state of one `GenerateRequest` (see the module docstring for KV regions)."""

    request_id: str
    tokens: list[int]
    num_input: int  # len(input_ids): the prompt the client sent
    num_resumed: int  # len(resume_ids): outputs streamed by a previous worker
    sampling: SamplingParams
    namespace: str | None = None
    session_id: str | None = None
    session_ttl_s: float | None = None
    status: Status = Status.WAITING
    arrival: float = field(default_factory=time.monotonic)
    waited_steps: int = 0  # scheduler steps spent waiting since arrival or retraction
    cached_hint: int = 0  # cached prefix length when the waiting queue was last ordered
    # KV (module docstring)
    row: int | None = None
    num_computed: int = 0
    prefix_len: int = 0
    alloc_len: int = 0
    window_start: int = 0  # sliding-window models: positions below hold no window KV
    state_slot: int | None = None  # recurrent models: the state after num_computed tokens
    node: Any = None
    # results
    cached_tokens: int | None = None  # prefix reuse at first admission (reported to client)
    num_streamed: int = 0  # generated tokens already handed out in chunks
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @classmethod
    def from_protocol(cls, req: GenerateRequest, device: torch.device) -> Request:
        generator = None
        if req.sampling.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(req.sampling.seed)
        return cls(
            request_id=req.request_id,
            tokens=list(req.input_ids) + list(req.resume_ids),
            num_input=len(req.input_ids),
            num_resumed=len(req.resume_ids),
            sampling=req.sampling,
            namespace=req.namespace,
            session_id=req.session_id,
            session_ttl_s=req.session_ttl_s,
            generator=generator,
        )

    @property
    def num_output(self) -> int:
        """Output tokens so far, resumed ones included (they count against max_tokens)."""
        return len(self.tokens) - self.num_input

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_input :]

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return len(self.tokens) - self.num_computed

    @property
    def tail_len(self) -> int:
        """Slots this request owns itself (not through the tree)."""
        return self.alloc_len - self.prefix_len

    def new_output(self) -> list[int]:
        """Generated tokens not yet streamed (resumed tokens are never streamed again)."""
        start = self.num_input + self.num_resumed + self.num_streamed
        return self.tokens[start:]


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if len(diff) else n
