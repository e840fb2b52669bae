"""A probe of an external engine's speeds, run once when the router takes the engine on.

The estimate prices every request with the engine's prefill speed and decode step
(`external.speed`), which the router otherwise learns only from the traffic it routes, a fixed
prior standing in until then; and a prior fits no real engine: until its first requests are
timed, a cold prompt is priced far below its real prefill, and copying a prefix to the engine
looks nearly free (figures in docs/benchmarks.md).

So the router times a few prompts of its own on the idle engine, each with a fresh random
start (nothing of it cached) and one output token unless said otherwise:

1. a warm-up (a fresh engine's first request carries one-off costs) that also gives the
   tokenizer's characters per token, so the next prompts can be sized in tokens from text
   (any OpenAI server takes text; token ids would need the engine's vocabulary);
2. rounds of a short prompt and a long one (`target_tokens`, at most half the engine's
   context): the prefill speed is the difference in uncached tokens over the difference in
   seconds, so the fixed cost of a request (HTTP, scheduling, the first step) cancels out;
3. from the second round on, the short prompt with `step_tokens` more output tokens: their
   extra seconds over the short timing, per token, are the decode step of one request.

The fastest timing of each prompt stands for it. Two rounds are enough where both figures
come out positive, and rounds go on (up to `max_rounds`, each sending only the prompts a
figure still 0 needs) until they do: on a fast engine the differences are a few milliseconds,
and a machine shared with other engines now and then delays a request by far more.

A figure that does not come out positive is 0 (not measured): the prior stands in for it.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from operator import attrgetter

PROBE_TOKENS = 1024  # the long prompt of an external engine's probe
PROBE_TIMEOUT_S = 120.0  # a probe that takes longer is given up: the prior stands in

# plain words a tokenizer splits into a token or two each
_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea"
).split()


@dataclass(frozen=True)
class ProbeTiming:
    """One probe request as the engine answered it."""

    seconds: float  # from sending it to its whole answer
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @property
    def uncached(self) -> int:
        return self.prompt_tokens - self.cached_tokens


_SECONDS = attrgetter("seconds")

# (prompt text, max output tokens) -> the timing; raises when the engine refuses or fails
Complete = Callable[[str, int], Awaitable[ProbeTiming]]


@dataclass(frozen=True)
class ProbeResult:
    prefill_tokens_per_s: float  # 0: not measured
    decode_step_s: float  # 0: not measured
    requests: int  # probe requests sent


def probe_text(rng: random.Random, chars: int) -> str:
    """At least `chars` characters of words, starting with a random nonce: a prompt no cache
    holds any block of."""
    words = [f"{rng.getrandbits(48):012x}"]
    length = len(words[0])
    while length < chars:
        word = rng.choice(_WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)


async def probe_engine(
    complete: Complete,
    rng: random.Random,
    target_tokens: int,
    max_context: int = 0,
    short_tokens: int = 32,
    step_tokens: int = 16,
    max_rounds: int = 5,
) -> ProbeResult:
    """The engine's prefill speed and decode step from a few timed prompts (module docstring).
    `max_context` 0: unknown."""
    sent = 0

    async def timed(prompt: str, max_tokens: int) -> ProbeTiming:
        nonlocal sent
        sent += 1
        return await complete(prompt, max_tokens)

    warm_text = probe_text(rng, 4 * short_tokens)
    warm = await timed(warm_text, 1)
    chars_per_token = len(warm_text) / max(1, warm.prompt_tokens)
    long_tokens = target_tokens if max_context <= 0 else min(target_tokens, max_context // 2)
    if long_tokens < 4 * short_tokens:
        return ProbeResult(0.0, 0.0, sent)

    def text(tokens: int) -> str:
        return probe_text(rng, int(tokens * chars_per_token))

    shorts: list[ProbeTiming] = []
    longs: list[ProbeTiming] = []
    stepped: list[ProbeTiming] = []
    speed = step = 0.0
    for round_ in range(max(2, max_rounds)):
        shorts.append(await timed(text(short_tokens), 1))
        if speed <= 0:
            longs.append(await timed(text(long_tokens), 1))
        if round_ > 0 and step <= 0:
            stepped.append(await timed(text(short_tokens), 1 + step_tokens))
        if round_ == 0:
            continue
        short = min(shorts, key=_SECONDS)
        long, slow = min(longs, key=_SECONDS), min(stepped, key=_SECONDS)
        tokens, seconds = long.uncached - short.uncached, long.seconds - short.seconds
        speed = tokens / seconds if tokens > 0 and seconds > 0 else 0.0
        extra = slow.completion_tokens - short.completion_tokens
        seconds = slow.seconds - short.seconds
        step = seconds / extra if extra > 0 and seconds > 0 else 0.0
        if speed > 0 and step > 0:
            break
    return ProbeResult(speed, step, sent)
