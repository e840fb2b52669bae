"""How long one continuous-batching step takes on one worker: a linear roofline model.

One engine step runs `prefill_tokens` new prompt tokens (chunks of waiting requests, each chunk
attending to its cached prefix and to itself) together with one decode token for each of the
`decode_batch` running requests (each attending to its whole context). Its time is

    step_s = base_s                                # weights read once + launch overhead
           + token_s     * (prefill_tokens + decode_batch)     # GEMMs: 2 x params FLOPs/token
           + attn_pair_s * attended_pairs          # prefill attention: query x key pairs
           + kv_read_s   * decode_context          # decode attention reads every cached K/V

where `attended_pairs` sums, over the prefill chunks, `new * prefix + new * (new + 1) / 2`, and
`decode_context` sums the running requests' context lengths. Every term grows with its inputs, so
more tokens or more context never make a step faster.

`h100_llama3_8b()` derives the coefficients from public figures:
- Llama 3 8B (meta-llama/Meta-Llama-3-8B config.json, model card): 8.03e9 parameters, 32 layers,
  hidden 4096, 32 query heads, 8 KV heads, head dim 128, BF16 weights (16.06 GB).
- NVIDIA H100 SXM5 datasheet: 989 TFLOPS dense BF16 tensor core, 3.35 TB/s HBM3, 80 GB.
- Assumed efficiencies (stated, not measured): 50% of peak FLOPs in GEMMs and attention,
  80% of peak bandwidth, 1 ms per-step launch/scheduling overhead, 90% of memory usable.
- Host tier loads: PCIe Gen5 x16, 64 GB/s per direction (H100 SXM5 datasheet: 128 GB/s
  bidirectional), at 80%: 2.56 us per token of KV (128 KiB). Loads are added to the step that
  starts the request's prefill.
That gives ~7 ms per decode step at batch 1 (~140 tokens/s for one stream) and ~27k prefill
tokens/s for an 8k-token prompt, in line with public vLLM/SGLang figures for this pair.

`fit_profile` fits the same four coefficients (non-negative least squares) to measured steps, e.g.
from `cluster.sim.fit` against a live radixray worker.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True, slots=True)
class TimeProfile:
    """Coefficients of the step model (seconds) and the worker's KV capacity in tokens."""

    name: str = "h100-llama3-8b"
    base_s: float = 7.0e-3
    token_s: float = 3.25e-5
    attn_pair_s: float = 1.06e-9
    kv_read_s: float = 4.89e-8
    kv_tokens: int = 427_000
    prefill_budget: int = 8192  # tokens per step (chunked prefill)
    max_running: int = 256
    host_load_token_s: float = 2.56e-6  # host -> device copy of one token's KV

    def step_s(
        self, prefill_tokens: int, attended_pairs: float, decode_batch: int, decode_context: int
    ) -> float:
        """Seconds for one step; 0 for an empty step."""
        if prefill_tokens <= 0 and decode_batch <= 0:
            return 0.0
        return (
            self.base_s
            + self.token_s * (prefill_tokens + decode_batch)
            + self.attn_pair_s * attended_pairs
            + self.kv_read_s * decode_context
        )

    def prefill_s(self, new_tokens: int, prefix_tokens: int = 0) -> float:
        """Seconds to prefill `new_tokens` after a cached prefix, alone, in budget-sized chunks."""
        total, done = 0.0, 0
        while done < new_tokens:
            n = min(self.prefill_budget, new_tokens - done)
            total += self.step_s(n, attended_pairs(n, prefix_tokens + done), 0, 0)
            done += n
        return total

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> TimeProfile:
        return cls(**json.loads(Path(path).read_text()))


def attended_pairs(new_tokens: int, prefix_tokens: int) -> float:
    """Query x key pairs of a causal chunk of `new_tokens` after `prefix_tokens` cached ones."""
    return new_tokens * prefix_tokens + new_tokens * (new_tokens + 1) / 2


def h100_llama3_8b() -> TimeProfile:
    """The default profile, derived from the public figures in the module docstring."""
    params, layers, hidden, kv_heads, head_dim = 8.03e9, 32, 4096, 8, 128
    flops, bandwidth, memory = 989e12 * 0.5, 3.35e12 * 0.8, 80e9 * 0.9
    weight_bytes = 2 * params
    kv_bytes_per_token = 2 * layers * kv_heads * head_dim * 2  # K and V, BF16
    return TimeProfile(
        name="h100-llama3-8b",
        base_s=weight_bytes / bandwidth + 1e-3,
        token_s=2 * params / flops,
        attn_pair_s=4 * layers * hidden / flops,  # QK^T and PV: 2 FLOPs per MAC each
        kv_read_s=kv_bytes_per_token / bandwidth,
        kv_tokens=int((memory - weight_bytes) / kv_bytes_per_token),
        host_load_token_s=kv_bytes_per_token / (64e9 * 0.8),
    )


@dataclass(frozen=True, slots=True)
class StepSample:
    """A measured span of `steps` steps: their summed inputs and total seconds."""

    prefill_tokens: int
    attended_pairs: float
    decode_batch: int
    decode_context: int
    seconds: float
    steps: int = 1


def fit_profile(samples: list[StepSample], base: TimeProfile | None = None) -> TimeProfile:
    """Least-squares coefficients (all >= 0) for `samples`; other fields from `base`.

    Each sample's residual counts relative to its own seconds: a decode step of 50 ms and a
    prefill of 3 s are fit to the same few percent. (In absolute seconds the prefills decide
    alone, and a few percent of noise on them moves a step's fixed cost by a quarter: one
    vLLM-CPU engine's 46 ms came out as 0.)
    Needs samples that vary each input (prompt lengths and batch sizes), else the coefficients
    of the inputs that never vary come out 0.
    """
    if len(samples) < 2:
        raise ValueError("need at least two samples to fit a profile")
    x = np.array(
        [[s.steps, s.prefill_tokens + s.decode_batch, s.attended_pairs, s.decode_context]
         for s in samples]
    )
    y = np.array([s.seconds for s in samples])
    if (y <= 0).any():
        raise ValueError("every sample needs a positive duration")
    coef = _nnls(x / y[:, None], np.ones_like(y))
    base = base or TimeProfile()
    values = asdict(base) | {
        "name": f"fitted-{base.name}",
        "base_s": float(coef[0]),
        "token_s": float(coef[1]),
        "attn_pair_s": float(coef[2]),
        "kv_read_s": float(coef[3]),
    }
    return TimeProfile(**values)


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares by dropping the most negative column until none is left.

    Columns are scaled to unit norm first so that tiny coefficients (ns per pair) and large ones
    (ms per step) are solved with the same precision.
    """
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(xs[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef / scale
