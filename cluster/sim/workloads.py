"""Synthetic workloads: SGLang's generated-shared-prefix and multi-turn chat with sessions.

Both produce `SimRequest`s whose `blocks` follow the trace convention: one key element per block
of `block_tokens` tokens, equal ids meaning equal token blocks at the same position. A block
that is only partly filled (a prompt's tail) gets an id of its own, because the next prompt that
extends it fills it with different tokens.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

from cluster.sim.trace import TRACE_BLOCK_TOKENS, SimRequest, load_trace


@dataclass(slots=True)
class Workload:
    """Requests in arrival order plus how many tokens one key element stands for."""

    name: str
    requests: list[SimRequest]
    block_tokens: int = TRACE_BLOCK_TOKENS


@dataclass(slots=True)
class SharedPrefixConfig:
    """SGLang bench_serving's `generated-shared-prefix` defaults (64 x 16, 2048 + 128 -> 256).

    `rate` is requests per second (Poisson); `inf` sends everything at t=0, as bench_serving does
    by default. `block_tokens` 128 makes the question exactly one block.
    """

    groups: int = 64
    prompts_per_group: int = 16
    system_prompt_len: int = 2048
    question_len: int = 128
    output_len: int = 256
    rate: float = math.inf
    block_tokens: int = 128


def _arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    if math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def _blocks(n_tokens: int, block_tokens: int) -> int:
    return max(1, math.ceil(n_tokens / block_tokens))


def generated_shared_prefix(cfg: SharedPrefixConfig, seed: int = 0) -> Workload:
    """`groups` system prompts, each shared by `prompts_per_group` distinct questions, shuffled."""
    rng = random.Random(seed)
    ids = itertools.count()
    sys_blocks = _blocks(cfg.system_prompt_len, cfg.block_tokens)
    q_blocks = _blocks(cfg.question_len, cfg.block_tokens)
    prompts = []
    for g in range(cfg.groups):
        system = [next(ids) for _ in range(sys_blocks)]
        for p in range(cfg.prompts_per_group):
            prompts.append((g, p, system + [next(ids) for _ in range(q_blocks)]))
    rng.shuffle(prompts)
    arrivals = _arrivals(len(prompts), cfg.rate, rng)
    requests = [
        SimRequest(
            request_id=f"g{g}p{p}",
            arrival_s=t,
            input_length=cfg.system_prompt_len + cfg.question_len,
            output_length=cfg.output_len,
            blocks=blocks,
            extra={"group": g},
        )
        for (g, p, blocks), t in zip(prompts, arrivals, strict=True)
    ]
    return Workload("generated-shared-prefix", requests, cfg.block_tokens)


@dataclass(slots=True)
class ChatConfig:
    """Multi-turn chat: sessions start at `session_rate` per second (Poisson), each has `turns`
    turns; a turn adds `user_len` tokens, its answer `output_len`; the next turn comes
    `think_s` (exponential mean) after the previous one arrived. All sessions share one
    `system_prompt_len`-token system prompt."""

    sessions: int = 200
    turns: int = 8
    system_prompt_len: int = 1024
    user_len: int = 256
    output_len: int = 256
    session_rate: float = 2.0
    think_s: float = 30.0
    block_tokens: int = 128


def multi_turn_chat(cfg: ChatConfig, seed: int = 0) -> Workload:
    """Chats whose turn k prompt is the system prompt plus every earlier turn and answer."""
    rng = random.Random(seed)
    ids = itertools.count()
    bt = cfg.block_tokens
    system = [next(ids) for _ in range(cfg.system_prompt_len // bt)]
    requests = []
    for s, start in enumerate(_arrivals(cfg.sessions, cfg.session_rate, rng)):
        full: list[int] = list(system)  # ids of the conversation's full blocks so far
        length = cfg.system_prompt_len
        t = start
        for k in range(cfg.turns):
            length += cfg.user_len
            while len(full) < length // bt:
                full.append(next(ids))
            tail = [next(ids)] if length % bt else []
            requests.append(
                SimRequest(f"s{s}t{k}", t, length, cfg.output_len, full + tail, f"s{s}")
            )
            length += cfg.output_len
            t += rng.expovariate(1.0 / cfg.think_s) if cfg.think_s > 0 else 0.0
    requests.sort(key=lambda r: r.arrival_s)
    return Workload("multi-turn-chat", requests, bt)


def trace_workload(path: str, speed: float = 1.0, seed: int = 0, limit: int | None = None):
    """A Mooncake-format trace file as a `Workload` (512-token blocks)."""
    return Workload(f"trace:{path}", load_trace(path, speed, seed, limit), TRACE_BLOCK_TOKENS)
