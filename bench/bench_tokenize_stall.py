"""How long tokenizing one long prompt stalls the router's event loop.

A heartbeat task on the loop wakes every 1 ms and records its longest gap while a prompt is
tokenized three ways: inline on the loop (the router before commit "router: tokenize long
prompts off the event loop"), on a worker thread with `encode` (holds the GIL: the loop still
stalls), and as the router does now (`Tokenizer.encode`, i.e. `encode_batch`, which releases
the GIL, on a worker thread). Every other stream the router serves waits that long.

    python bench/bench_tokenize_stall.py [--runs 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router.tokenizer import Tokenizer  # noqa: E402
from worker.loader.builtin import builtin_model_path  # noqa: E402


async def stall_ms(encode: Callable[[str], list[int]], text: str, offload: bool) -> float:
    gaps: list[float] = []
    done = asyncio.Event()

    async def heartbeat() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    beat = asyncio.create_task(heartbeat())
    await asyncio.sleep(0.01)
    gaps.clear()
    if offload:
        await asyncio.to_thread(encode, text)
    else:
        encode(text)
    await asyncio.sleep(0.005)
    done.set()
    await beat
    return max(gaps) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    tok = Tokenizer(builtin_model_path("tiny"))
    ways = {
        "inline": (tok.encode, False),
        "thread, encode": (lambda t: tok.fast.encode(t).ids, True),
        "thread, router": (tok.encode, True),
    }
    print(f"{'tokens':>8} {'encode ms':>10}  " + "  ".join(f"{w + ' stall':>22}" for w in ways))
    for words in (500, 2_000, 8_000, 32_000):
        text = " ".join(f"w{(i * 7919) % 5003}" for i in range(words))
        started = time.perf_counter()
        n = len(tok.encode(text))
        took = (time.perf_counter() - started) * 1000
        stalls = [
            statistics.median(asyncio.run(stall_ms(fn, text, off)) for _ in range(args.runs))
            for fn, off in ways.values()
        ]
        print(f"{n:>8} {took:>10.1f}  " + "  ".join(f"{s:>19.1f} ms" for s in stalls))


if __name__ == "__main__":
    main()
