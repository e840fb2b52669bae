"""Figures of a load-generator run: latency percentiles, throughput, hit rate, worker spread.

Latencies in seconds. `itl` pools every inter-chunk gap of every request. `hit_rate` is
cached_tokens / prompt_tokens summed over successful requests, as the server reported them in
`usage.prompt_tokens_details.cached_tokens`. `requests_per_worker` counts the
`X-Radixray-Worker` header values (absent header: "unknown").
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from cluster.loadgen.client import Outcome


def _pcts(values: list[float]) -> dict:
    arr = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    if not len(arr):
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"mean": float(arr.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(outcomes: list[Outcome], wall_s: float) -> dict:
    ok = [o for o in outcomes if o.error is None]
    prompt = sum(o.prompt_tokens for o in ok)
    output = sum(o.output_tokens for o in ok)
    errors = Counter(o.error.split(":")[0] for o in outcomes if o.error is not None)
    return {
        "requests": len(outcomes),
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "errors": dict(errors),
        "error_examples": sorted({o.error for o in outcomes if o.error is not None})[:3],
        "wall_s": wall_s,
        "throughput_rps": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_tokens_per_s": output / wall_s if wall_s > 0 else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": sum(o.cached_tokens for o in ok),
        "hit_rate": sum(o.cached_tokens for o in ok) / prompt if prompt else 0.0,
        "ttft": _pcts([o.ttft_s for o in ok]),
        "itl": _pcts([g for o in ok for g in o.itl_s]),
        "e2e": _pcts([o.e2e_s for o in ok]),
        "requests_per_worker": dict(sorted(Counter(o.worker or "unknown" for o in ok).items())),
    }


def format_summary(s: dict) -> str:
    def ms(d: dict, key: str) -> str:
        return "-" if d[key] is None else f"{d[key] * 1000:.1f}"

    lines = [
        f"requests {s['completed']}/{s['requests']} ok, {s['failed']} failed {s['errors'] or ''}",
        f"throughput {s['throughput_rps']:.2f} req/s, {s['output_tokens_per_s']:.1f} output tok/s"
        f" over {s['wall_s']:.1f} s",
        f"hit rate {s['hit_rate']:.1%} ({s['cached_tokens']}/{s['prompt_tokens']} prompt tokens)",
        f"{'ms':<6}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}",
    ]
    for name in ("ttft", "itl", "e2e"):
        d = s[name]
        cells = "".join(f"{ms(d, k):>9}" for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"{name:<6}{cells}")
    spread = ", ".join(f"{w}: {n}" for w, n in s["requests_per_worker"].items())
    lines.append(f"requests per worker: {spread}")
    return "\n".join(lines)
