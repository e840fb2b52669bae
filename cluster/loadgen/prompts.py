"""Turn simulator workloads into prompts for a live endpoint.

Every block id becomes a deterministic run of pseudo-words (the same id always gives the same
words), and a prompt is its blocks' runs joined by spaces. Requests that share their first k
block ids therefore share a text prefix, which any tokenizer turns into a shared token prefix
(up to the one token that straddles the boundary), so a cache-aware server sees the same reuse
the trace describes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from cluster.sim.workloads import Workload

_SYLLABLES = ("ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "de", "va", "zu", "ho", "be", "fi")


@dataclass(slots=True)
class BenchRequest:
    """One request to send: text prompt, output length, arrival offset (s), optional session."""

    request_id: str
    prompt: str
    max_tokens: int
    arrival_s: float
    session_id: str | None = None


@lru_cache(maxsize=200_000)
def block_text(block_id: int, words: int) -> str:
    """`words` pseudo-words determined by `block_id` alone."""
    rng = random.Random(block_id * 1_000_003 + 17)
    return " ".join(
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(words)
    )


def bench_requests(
    workload: Workload, words_per_block: int = 32, max_tokens_cap: int | None = None
) -> list[BenchRequest]:
    """One `BenchRequest` per workload request, in arrival order."""
    out = []
    for r in workload.requests:
        text = " ".join(block_text(b, words_per_block) for b in r.blocks)
        out_len = min(r.output_length, max_tokens_cap) if max_tokens_cap else r.output_length
        out.append(BenchRequest(r.request_id, text, max(1, out_len), r.arrival_s, r.session_id))
    return out
