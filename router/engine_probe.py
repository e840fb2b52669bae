"""A probe of an external engine's speeds, run once when the router takes the engine on.

The estimate prices every request with the engine's prefill speed and decode step
(`router.engine_speed`), which the router otherwise learns only from the traffic it routes,
a fixed prior standing in until then; and a prior fits no real engine: two vLLM-CPU engines
prefill ~300 tokens/s against a prior of 8,000, so without a probe the first 8-31 requests of
each live run priced a cold 870-token prompt at 0.11-0.14 s against its real 2.7 s, and
copying a prefix to the engine without it looked nearly free.

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

The fastest timing of each prompt stands for it, and a figure is settled once the two fastest
timings of each of its prompts agree within a tenth of its difference; rounds go on (up to
`max_rounds`, each sending only the prompts an unsettled figure needs) until both are. On a
fast engine the differences are a few milliseconds (the tests' tiny model on vLLM-CPU: ~8 ms
for 480 tokens) and a machine shared with other engines now and then delays a request by
hundreds: with two fixed rounds, 3 of 30 probes beside a busy core measured 0, and two
engines of the same model read 1,790 and 101,290 tokens/s. On a real model (two SmolLM2
engines on vLLM-CPU, probed at once, ~2.4 s for the long prompt) 12 probes sent 8-12
requests (median 9) and read 295-330 tokens/s and a 40-44 ms step.

A figure that does not come out positive is 0 (not measured): the prior stands in for it.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from operator import attrgetter

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
SETTLED = 0.1  # a figure is settled when its timings agree within this share (`_gap`)

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
    speed_settled = step_settled = False
    for round_ in range(max(3, max_rounds)):
        shorts.append(await timed(text(short_tokens), 1))
        if not speed_settled:
            longs.append(await timed(text(long_tokens), 1))
        if round_ > 0 and not step_settled:
            stepped.append(await timed(text(short_tokens), 1 + step_tokens))
        if round_ == 0:
            continue
        short = min(shorts, key=_SECONDS)
        tokens = min(longs, key=_SECONDS).uncached - short.uncached
        seconds, speed_settled = _gap(shorts, longs)
        speed = tokens / seconds if tokens > 0 and seconds > 0 else 0.0
        extra = min(stepped, key=_SECONDS).completion_tokens - short.completion_tokens
        seconds, step_settled = _gap(shorts, stepped)
        step = seconds / extra if extra > 0 and seconds > 0 else 0.0
        speed_settled = speed_settled and speed > 0
        step_settled = step_settled and step > 0
        if speed_settled and step_settled:
            break
    return ProbeResult(speed, step, sent)


def _gap(base: list[ProbeTiming], more: list[ProbeTiming]) -> tuple[float, bool]:
    """The seconds between the fastest timings of two prompts, and whether it is settled: the
    second-fastest timing of each is within `SETTLED` of the gap (summed)."""
    seconds = min(more, key=_SECONDS).seconds - min(base, key=_SECONDS).seconds
    return seconds, seconds > 0 and _spread(base) + _spread(more) <= SETTLED * seconds


def _spread(timings: list[ProbeTiming]) -> float:
    """The second-fastest timing less the fastest (infinite with one)."""
    fastest = sorted(t.seconds for t in timings)
    return fastest[1] - fastest[0] if len(fastest) > 1 else float("inf")
