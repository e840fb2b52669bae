"""An external engine's speeds as the router observes them through its own streams.

An OpenAI-compatible server reports no prefill speed or decode step, yet the estimate
(`router.routing.estimate`) reads both from `WorkerStats` as it does for our own workers. The
router times each of its requests to the engine instead:

- prefill speed: over the recent requests sent while the router had nothing else in flight on
  that engine (so no queue of its own ahead of them), the least-squares line of time to first
  token on uncached prompt tokens (`prompt_tokens - cached_tokens`, the engine's own figures):
  its slope is the time per prompt token, 1 / speed; its intercept the fixed cost of a request
  (HTTP, scheduling, the first decode step), which is not prefill;
- decode step: the median over recent requests of the time between a request's first and
  last tokens per token generated in between, once `min_steps` requests have been timed (the
  first requests of a fresh engine carry its warm-up, which alone would take every later
  request away from it).

An engine that times its own prefills (vLLM's histograms, `external.metrics`) gives better
points for the line: `observe_engine` takes the mean request of each interval between two
scrapes, its computed tokens and its prefill phase's seconds. Those cover every request the
engine served (other routers', warm-up, and the router's own queued ones, which its stream
timings leave out), carry no queue or HTTP, and so give a line after a few requests, where
the router's own timings need many more on a busy engine (docs/benchmarks.md). From the
first such point the line is taken over the engine's points alone: the two kinds differ by
the fixed cost of HTTP and the first step, and one line cannot fit both.

The engine's timings are per request, and a request's prefill phase lasts as long as the steps
it shares with the other prompts scheduled beside it: on a busy engine a 100-token remainder
computed in the step of a long prompt takes that whole step. Such points do not lie on one
line: a line through a few of them can come out several times faster than a lone cold prompt's
prefill, and later slower (docs/benchmarks.md). But sharing a step only ever lengthens a
prefill: no interval's mean request is computed faster than the engine's speed, so the fastest
of them (`envelope_tokens` or more computed, where the fixed cost of a step weighs little) is a
floor under the speed, taken once `min_points` such means were seen (a fresh engine's first
request is slow, and a floor from it alone would price the engine below its peers, which would
then get every request). The engine's speed is the line clamped between that floor and
`max_over_envelope` times it, and the floor alone while there is no line.

Until the timings give a figure, a probe run when the router took the engine on stands in
(`calibrate`, `HttpBackend.calibrate`): its own prompts, timed on the idle engine. Without one,
the fleet's median or a fixed prior stands in, and a prior is far off on some engines: it
prices a cold prompt far below its real prefill, so copying a prefix to the engine looks nearly
free (docs/benchmarks.md). The probe's figures are the engine's, not its timings': they do not
age out, and they survive its restart (same address, same hardware).

Timings older than `max_age_s` are dropped. An engine that looked slow and got no requests
since would otherwise keep that figure forever, and `cost` would keep routing around it; with
its figures gone it is priced like its peers again and measured anew.

A line through a few noisy timings can come out nearly flat (a speed tens of times the real
one, which would draw every uncached prompt to that engine) or cross zero below the origin
(a negative fixed cost). The line is therefore taken only over `min_points` timings whose
uncached lengths span `min_spread` tokens, with no negative fixed cost and a slope at least
`min_slope_sigmas` standard errors above zero. Otherwise the speed stays unknown, and the
fleet's median or the prior stands in: the engine is priced as its peers are. Tokens over
seconds would not do as a fallback: it counts the fixed cost as prefill, so an engine that
holds the prefixes gets short uncached remainders, looks slow, and the cost moves its
prefixes to an engine that holds none.

"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from statistics import median

from router.routing.speeds import fit_line


@dataclass
class EngineSpeedConfig:
    """window: recent requests each figure is taken over.
    min_uncached: fewer uncached prompt tokens than this say nothing of the prefill speed
    (the fixed cost of a request dominates them).
    min_points / min_spread / min_slope_sigmas: timings needed for the prefill line, the span
    of their uncached lengths (tokens), and how many standard errors above zero its slope must
    be (see the module docstring).
    min_steps: timed decodes needed for the decode step.
    max_age_s: timings older than this (seconds) no longer count.
    envelope_tokens / max_over_envelope: the engine's own timings of at least this many
    computed tokens (`min_points` of them) set the floor under its speed, and its line may be
    at most this many times the floor (see the module docstring)."""

    window: int = 64
    min_uncached: int = 16
    min_points: int = 4
    min_spread: int = 256
    min_slope_sigmas: float = 2.0
    min_steps: int = 4
    max_age_s: float = 120.0
    envelope_tokens: int = 256
    max_over_envelope: float = 2.0


class EngineSpeed:
    """Recent request timings of one engine; see the module docstring."""

    def __init__(
        self,
        config: EngineSpeedConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or EngineSpeedConfig()
        self.clock = clock
        # (when, uncached tokens, ttft s) and (when, s per token), oldest first
        self._prefill: deque[tuple[float, float, float]] = deque(maxlen=self.config.window)
        self._steps: deque[tuple[float, float]] = deque(maxlen=self.config.window)
        self.engine_timed = False  # the engine times its own prefills: its points only
        # (prefill tokens/s, decode step s) a probe measured on the idle engine; 0: none
        self.probed: tuple[float, float] = (0.0, 0.0)

    def fresh(self) -> EngineSpeed:
        """A new record for a restarted engine: no timings, the probe's figures kept."""
        speed = EngineSpeed(self.config, self.clock)
        speed.probed = self.probed
        return speed

    def calibrate(self, prefill_tokens_per_s: float, decode_step_s: float) -> None:
        """A probe's figures (0: not measured), used until the timings give their own."""
        self.probed = (max(0.0, prefill_tokens_per_s), max(0.0, decode_step_s))

    def observe(
        self,
        uncached_tokens: int,
        ttft_s: float,
        decode_s: float,
        decode_tokens: int,
        queued_behind_own: bool,
    ) -> None:
        """One finished request: its uncached prompt tokens and time to first token (used only
        when it was not `queued_behind_own`, i.e. sent with nothing else of the router's in
        flight), and `decode_tokens` tokens generated in `decode_s` after the first."""
        now = self.clock()
        if (not self.engine_timed and not queued_behind_own
                and uncached_tokens >= self.config.min_uncached and ttft_s > 0):
            self._prefill.append((now, uncached_tokens, ttft_s))
        if decode_tokens > 0 and decode_s > 0:
            self._steps.append((now, decode_s / decode_tokens))

    def observe_engine(self, uncached_tokens: float, prefill_s: float) -> None:
        """The engine's own timing of the requests it prefilled since the last reading: their
        mean computed tokens and mean prefill seconds (see the module docstring). The first
        such point drops the router's own prefill timings."""
        if not self.engine_timed:
            self.engine_timed = True
            self._prefill.clear()
        if uncached_tokens >= self.config.min_uncached and prefill_s > 0:
            self._prefill.append((self.clock(), uncached_tokens, prefill_s))

    def _expire(self) -> None:
        oldest = self.clock() - self.config.max_age_s
        for timings in (self._prefill, self._steps):
            while timings and timings[0][0] < oldest:
                timings.popleft()

    @property
    def measured_tokens(self) -> int:
        """Uncached prompt tokens of the timings behind the speed (0: the probe's alone). An
        engine's own points are interval means: a lower bound of what it computed."""
        self._expire()
        return int(sum(n for _, n, _ in self._prefill)) if self._timed_speed() else 0

    @property
    def prefill_tokens_per_s(self) -> float:
        """Uncached prompt tokens per second: from the timings, else the probe's; 0.0 when
        unknown."""
        return self._timed_speed() or self.probed[0]

    def _timed_speed(self) -> float:
        self._expire()
        line = self._line()
        if not self.engine_timed:
            return line
        cfg = self.config
        long = [n / t for _, n, t in self._prefill if n >= cfg.envelope_tokens]
        if len(long) < cfg.min_points:  # one slow first request must not shun a fresh engine
            return line
        floor = max(long)
        return min(max(line, floor), cfg.max_over_envelope * floor)

    def _line(self) -> float:
        """1 / the slope of the timings' line, where it is clear (module docstring); else 0."""
        cfg, points = self.config, [(n, t) for _, n, t in self._prefill]
        if len(points) < cfg.min_points:
            return 0.0
        lengths = [n for n, _ in points]
        if max(lengths) - min(lengths) < cfg.min_spread:
            return 0.0
        fit = fit_line(points)
        if fit is None or fit[0] < 0 or fit[1] <= 0:
            return 0.0
        intercept, slope = fit
        mean = sum(lengths) / len(lengths)
        sxx = sum((n - mean) ** 2 for n in lengths)
        residual = sum((t - intercept - slope * n) ** 2 for n, t in points)
        standard_error = (residual / max(1, len(points) - 2) / sxx) ** 0.5
        return 1.0 / slope if slope >= cfg.min_slope_sigmas * standard_error else 0.0

    @property
    def decode_step_s(self) -> float:
        """Seconds per generated token after the first: from the timings, else the probe's;
        0.0 when unknown."""
        self._expire()
        if len(self._steps) < self.config.min_steps:
            return self.probed[1]
        return median(step for _, step in self._steps)
