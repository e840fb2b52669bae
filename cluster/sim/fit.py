"""Fit a time profile to a live OpenAI-compatible worker (a radixray worker, vLLM, SGLang).

Two kinds of measurement, each repeated `repeats` times, median kept:
- prefill: one request at a time with a fresh prompt of L tokens and `max_tokens=1`; its
  end-to-end latency is the prefill of L tokens in ceil(L / budget) chunked steps;
- decode: B requests at once with prompts of `--decode-words` words and `max_tokens=M`; their
  median gap between tokens is one decode step of batch B over contexts of about prompt + M / 2
  (short prompts only leave a step's fixed cost and its context reads indistinguishable).
`fit_profile` then solves for the four step coefficients (non-negative least squares). Point it
at a worker, not a router, so that routing adds no time.

    python -m cluster.sim.fit --url http://127.0.0.1:8001 --out my-gpu.json
    radixray simulate --profile my-gpu.json ...
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
from dataclasses import replace

import aiohttp

from cluster.loadgen.client import Outcome, Target, send
from cluster.loadgen.prompts import BenchRequest
from cluster.sim.time_model import StepSample, TimeProfile, attended_pairs, fit_profile


def _prompt(words: int, rng: random.Random) -> str:
    return " ".join(f"q{rng.randrange(10**9)}" for _ in range(words))


DECODE_WORDS = (16, 128)  # prompt words of the decode probes (see the module docstring)


async def _prefill_samples(http, target, lengths, repeats, budget, rng) -> list[StepSample]:
    samples = []
    for words in lengths:
        runs: list[Outcome] = []
        for _ in range(repeats):
            req = BenchRequest(f"fit-p{words}", _prompt(words, rng), 1, 0.0)
            runs.append(await send(http, target, req))
        ok = [o for o in runs if o.error is None]
        if not ok:
            raise RuntimeError(f"prefill probe failed: {runs[0].error}")
        n = ok[0].prompt_tokens or words
        steps = -(-n // budget)
        pairs = sum(attended_pairs(min(budget, n - i), i) for i in range(0, n, budget))
        samples.append(StepSample(n, pairs, 0, 0, statistics.median(o.e2e_s for o in ok), steps))
    return samples


async def _decode_samples(http, target, batches, prompt_words, max_tokens, rng
                         ) -> list[StepSample]:
    samples = []
    for batch, words in ((b, w) for w in prompt_words for b in batches):
        reqs = [BenchRequest(f"fit-d{batch}-{i}", _prompt(words, rng), max_tokens, 0.0)
                for i in range(batch)]
        runs = await asyncio.gather(*(send(http, target, r) for r in reqs))
        gaps = [g for o in runs if o.error is None for g in o.itl_s]
        if not gaps:
            raise RuntimeError(f"decode probe failed: {runs[0].error}")
        prompt = max(o.prompt_tokens for o in runs)
        context = batch * (prompt + max_tokens // 2)
        samples.append(StepSample(0, 0, batch, context, statistics.median(gaps)))
    return samples


async def measure(target: Target, base: TimeProfile, lengths: list[int], batches: list[int],
                  repeats: int = 3, max_tokens: int = 64, seed: int = 0,
                  decode_words: tuple[int, ...] = DECODE_WORDS) -> list[StepSample]:
    """Prefill and decode samples from the live endpoint `target` (streaming); the decode
    batches run once per prompt length in `decode_words`."""
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await send(http, target, BenchRequest("fit-warmup", "warm up", 2, 0.0))
        samples = await _prefill_samples(http, target, lengths, repeats, base.prefill_budget,
                                         rng)
        samples += await _decode_samples(http, target, batches, decode_words, max_tokens, rng)
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.sim.fit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", required=True, help="profile JSON to write")
    parser.add_argument("--lengths", default="64,256,1024,2048", help="prompt words")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--decode-words", default=",".join(map(str, DECODE_WORDS)),
                        help="prompt words of the decode probes, each with every batch: two or "
                             "more lengths tell a step's context reads from its fixed cost")
    parser.add_argument("--kv-tokens", type=int, default=None)
    parser.add_argument("--prefill-budget", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from cluster.loadgen.cli import first_model

    base = TimeProfile()
    if args.prefill_budget:
        base = replace(base, prefill_budget=args.prefill_budget)
    model = args.model or asyncio.run(first_model(args.url, None))
    target = Target(args.url, model)
    lengths = [int(x) for x in args.lengths.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    try:
        decode_words = tuple(int(x) for x in args.decode_words.split(","))
        samples = asyncio.run(measure(target, base, lengths, batches, args.repeats,
                                      decode_words=decode_words))
    except (RuntimeError, OSError, aiohttp.ClientError) as exc:
        print(f"fit: {exc}", file=sys.stderr)
        return 2
    profile = replace(fit_profile(samples, base), name=f"fitted:{args.url}")
    if args.kv_tokens:
        profile = replace(profile, kv_tokens=args.kv_tokens)
    profile.save(args.out)
    print(profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
