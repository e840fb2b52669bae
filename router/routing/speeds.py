"""What the estimate takes from the fleet's reports as a whole (`Estimator.observe_fleet`).

Workers of one deployment run the same model on the same hardware, so their reports are
samples of one machine's speeds:
- The medians of the measured prefill speeds and decode steps stand in for a worker that has
  not measured itself yet. A fixed prior alone would make a fresh worker look faster or
  slower than its measured twins, and `cost` would pile every new prefix onto one of them.
  The prefill median is taken over the workers whose figure rests on `trust_tokens` of their
  own traffic, where any does.
- A worker's prefill speed over fewer than `trust_tokens` measured tokens that is more than
  `outlier` times off that median is taken for a measurement of a cold or crowded moment, not
  of the worker (`peer_checked`): a worker added live under load first prefills while its
  peers hold every core, and measured 855 tokens/s beside their 50,619; priced at that it got
  no request again and never corrected it. It is priced at the median instead until its own
  traffic, `trust_tokens` of it, says otherwise.
- The fit of the decode step on the decode context (the running requests' KV, which every
  step reads): a worker's step at the context booked on it now, fresh, where its own measured
  step is a report interval late (`EstimateConfig.step_from_context`).
"""

from __future__ import annotations

from collections.abc import Iterable
from statistics import median

from worker.protocol import WorkerStats


class FleetSpeeds:
    """The fleet's median speeds and its decode step's fit, from the latest reports."""

    def __init__(
        self, prefill_tokens_per_s: float, decode_step_s: float, fit_step: bool = True,
        trust_tokens: int = 0,
    ) -> None:
        self.fit_step = fit_step  # fit the decode step on context (`step_from_context`)
        self.trust_tokens = trust_tokens  # measured tokens that make a figure its worker's
        self.prior_prefill_tokens_per_s = prefill_tokens_per_s
        self.prior_decode_step_s = decode_step_s
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.decode_step_s = decode_step_s
        # (intercept s, slope s per context token) of the decode step, None when there is
        # nothing to fit: fewer than two workers, or all at one context
        self.step_fit: tuple[float, float] | None = None

    def observe(self, stats: Iterable[WorkerStats | None]) -> None:
        """Re-derive the medians (priors where none is measured) and, with `fit_step`, the
        step's fit."""
        measured = [s for s in stats if s is not None]
        speeds = [s.prefill_tokens_per_s for s in measured if s.prefill_tokens_per_s > 0
                  and s.prefill_tokens_measured >= self.trust_tokens]
        speeds = speeds or [s.prefill_tokens_per_s for s in measured if s.prefill_tokens_per_s > 0]
        steps = [s for s in measured if s.decode_step_s > 0]
        self.prefill_tokens_per_s = median(speeds) if speeds else self.prior_prefill_tokens_per_s
        self.decode_step_s = (
            median(s.decode_step_s for s in steps) if steps else self.prior_decode_step_s
        )
        self.step_fit = None
        if self.fit_step:
            self.step_fit = fit_line([(s.running_decode_tokens, s.decode_step_s) for s in steps])


def peer_checked(stats: WorkerStats, fleet: float, outlier: float, trust_tokens: int) -> float:
    """The worker's prefill speed, or the fleet's median where it is more than `outlier` times
    off it and rests on fewer than `trust_tokens` of the worker's own traffic."""
    measured = stats.prefill_tokens_per_s
    if stats.prefill_tokens_measured >= trust_tokens or fleet <= 0:
        return measured
    return fleet if measured * outlier < fleet or measured > outlier * fleet else measured


def denoise(measured: float, fleet: float, noise: float) -> float:
    """The fleet's median where the measurement is within `noise` (a fraction) of it."""
    return fleet if abs(measured - fleet) <= noise * fleet else measured


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares (intercept, slope) of y over x, the slope at least 0 (a step never gets
    shorter with more context to read; with the slope at 0 the intercept is the mean); None
    with fewer than two distinct x."""
    n = len(points)
    if n < 2:
        return None
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    if sxx <= 0:
        return None
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx)
    return mean_y - slope * mean_x, slope
