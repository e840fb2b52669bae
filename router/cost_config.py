"""CostConfig: the cost model's priors, the engine's step shape, and the weights of the harms
the `cost` policy adds to a request's predicted TTFT (`router.cost_model`, `CostModel.scores`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CostConfig:
    """Priors used until a worker reports its own speeds, and the engine's step shape."""

    prefill_tokens_per_s: float = 8000.0  # prompt tokens/s of one worker, prior
    decode_step_s: float = 0.015  # time of one decode step with a small batch, prior
    decode_step_per_request_s: float = 0.0002  # prior growth of the step time per running request
    host_load_tokens_per_s: float = 100_000.0  # KV loaded back from the host tier, tokens/s
    # prefill time per token grows with the context it attends to: at this context, attention
    # costs as much as the rest (~ 6 x hidden size; 30k for Llama 3 8B: 2 x 32 layers x 4096
    # x context FLOPs of attention vs 2 x 8e9 of weights per token); 0: linear prefill
    attention_knee_tokens: float = 30_000.0
    # measured speeds within this fraction of the fleet's median count as the median: workers
    # of one deployment differ by measurement noise, which must not decide where prefixes go
    speed_noise: float = 0.25
    # the same for the decode step. It also differs with each worker's batch (size, context),
    # and a narrower band (0.1) lets a worker decoding long contexts be seen to prefill slower
    # (Mooncake matrix: better), but then stale reports stack chat sessions (docs/benchmarks.md)
    step_noise: float = 0.25
    # True: a worker's step is the fleet's fit of step on decode context (its reports), read
    # at the context booked on the worker now: fresh, where its own measured step is a report
    # late (Mooncake matrix: better; False: the measured step and its band, above)
    step_from_context: bool = True
    # `scores` (see there), seconds of score per second of:
    compute_weight: float = 24.0  # prefill the request adds (recompute of a prefix held elsewhere)
    long_ttft_s: float = 0.75  # ... x (long_ttft_s / best TTFT) ** long_power past it (0: off)
    long_power: float = 1.0
    busy_weight: float = 4.0  # ... x (1 + busy_weight x busy share ** busy_power)
    busy_power: float = 4.0
    backlog_weight: float = 4.0  # growth of the compute weight with the backlog
    # tail and guard apply only while some worker would start the request before tail_ttft_s
    tail_ttft_s: float = 4.0  # predicted TTFT past this (the tail) counts `tail_weight` more
    tail_weight: float = 8.0
    tail_guard_s: float = 5.0  # no worker whose TTFT is in the tail and this much past the best
    # ... plus this x busy share ** busy_power; 4 (with tail_guard_s 4) pays only together with
    # step_noise 0.1 (docs/benchmarks.md)
    tail_guard_busy_s: float = 0.0
    affinity_weight: float = 4.0  # delay its prefill imposes on arrivals that want the worker
    affinity_window_s: float = 30.0  # time constant of those arrivals' rate (`router.affinity`)
    demand_weight: float = 2.0  # recompute or wait it imposes on the next turns routed there
    decode_weight: float = 0.25  # its own decode time there
    idle_weight: float = 2.0  # the compute weight on an idle worker (nothing booked, reported)
    # True: a worker with no prefill queued counts as idle even while it decodes. Latency
    # first: lower TTFT, fewer hits (Mooncake matrix: 0.74-0.89 of pooled); under KV pressure
    # it can queue badly (chat, load 0.8, 200k KV: 11x the mean TTFT; docs/benchmarks.md)
    idle_while_decoding: bool = False
