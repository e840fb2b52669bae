"""The probe of an external engine's speeds at join (`router.backends.external.probe`,
`HttpBackend.calibrate`), and `EngineSpeed` reporting its figures until timings replace them.

The HTTP tests run against a small aiohttp server that answers completions at a known prefill
speed and decode step: a stand-in for an engine, whose timings a real one never gives exactly
(tests/vllm/test_vllm_route.py probes a real vLLM)."""

from __future__ import annotations

import asyncio
import random

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from router.backends.external.probe import ProbeTiming, probe_engine, probe_text
from router.backends.external.speed import EngineSpeed
from router.backends.http import HttpBackend
from router.backends.sync import WorkerSync


class Engine:
    """An engine's timings: a fixed cost per request, a prefill speed, a decode step, and a
    first request `first_extra_s` slower (a fresh engine's one-off costs). One token per
    word, as the fake server below counts them."""

    def __init__(self, speed: float = 2000.0, step_s: float = 0.02, fixed_s: float = 0.01,
                 first_extra_s: float = 0.0, context: int = 0) -> None:
        self.speed, self.step_s, self.fixed_s = speed, step_s, fixed_s
        self.first_extra_s, self.context = first_extra_s, context
        self.prompts: list[str] = []

    def seconds(self, tokens: int, max_tokens: int) -> float:
        extra = self.first_extra_s if not self.prompts else 0.0
        return extra + self.fixed_s + tokens / self.speed + (max_tokens - 1) * self.step_s

    async def complete(self, prompt: str, max_tokens: int) -> ProbeTiming:
        """`probe_engine`'s view of the engine, with no HTTP between."""
        tokens = len(prompt.split())
        if self.context and tokens + max_tokens > self.context:
            raise ValueError(f"{tokens} tokens: over the context")
        seconds = self.seconds(tokens, max_tokens)
        self.prompts.append(prompt)
        return ProbeTiming(seconds, tokens, 0, max_tokens)


def test_the_probe_recovers_the_engines_speeds():
    engine = Engine(speed=300.0, step_s=0.05, fixed_s=0.04, first_extra_s=9.0)
    result = asyncio.run(probe_engine(engine.complete, random.Random(0), 1024))
    # the fixed cost cancels out, and the slow first request is only the warm-up
    assert result.prefill_tokens_per_s == pytest.approx(300.0, rel=0.02)
    assert result.decode_step_s == pytest.approx(0.05, rel=0.02)
    # warm-up, short + long, then short + long + stepped: both figures measured, no more rounds
    assert result.requests == 1 + 2 + 3
    lengths = sorted(len(p.split()) for p in engine.prompts)
    assert 1000 <= lengths[-1] <= 1100  # the long prompt sized in the engine's tokens
    starts = {p.split()[0] for p in engine.prompts}
    assert len(starts) == len(engine.prompts)  # each prompt starts afresh: nothing cached


def test_one_slow_timing_of_the_long_prompt_is_outvoted():
    """A fast engine on a shared machine: the first long prompt waits 20 ms for the core, about
    as long as its whole prefill; the faster of the two long timings stands."""
    engine = Engine(speed=50_000.0, step_s=0.003, fixed_s=0.01)
    shared = _with_delays(engine, {2: 0.02})  # warm-up, short, long (slow), short, ...
    result = asyncio.run(probe_engine(shared, random.Random(2), 1024))
    assert result.prefill_tokens_per_s == pytest.approx(50_000.0, rel=0.02)
    assert result.requests == 1 + 2 + 3


def _with_delays(engine: Engine, delays: dict[int, float]):
    """`engine.complete` with request i (0: the warm-up) `delays[i]` seconds slower: a core
    taken by another engine now and then."""

    async def complete(prompt: str, max_tokens: int) -> ProbeTiming:
        timing = await engine.complete(prompt, max_tokens)
        slow = delays.get(len(engine.prompts) - 1, 0.0)
        return ProbeTiming(timing.seconds + slow, timing.prompt_tokens, 0, max_tokens)

    return complete


def test_rounds_go_on_until_both_figures_are_measured():
    """Requests: warm-up, short, long, then rounds of short, long, stepped. Here the short
    prompts of the first two rounds are slowed by more than the long prefill and more than the
    stepped prompt's 16 steps: two rounds measure nothing, a third measures both."""
    engine = Engine(speed=50_000.0, step_s=0.003, fixed_s=0.01)
    slow = {1: 0.05, 3: 0.05}  # the shorts: > 20 ms of long prefill, > 48 ms of 16 steps
    result = asyncio.run(probe_engine(_with_delays(engine, slow), random.Random(3), 1024))
    assert result.prefill_tokens_per_s == pytest.approx(50_000.0, rel=0.02)
    assert result.decode_step_s == pytest.approx(0.003, rel=0.02)
    assert result.requests == 1 + 2 + 3 + 3 == len(engine.prompts)


def test_a_probe_that_never_measures_stops_after_its_rounds():
    """Every short prompt slower than everything else (a figure that never comes out
    positive): the probe gives up after `max_rounds`, the speeds left to traffic."""
    engine = Engine(speed=50_000.0, step_s=0.003, fixed_s=0.01)
    shorts = {i: 1.0 for i in (1, 3, 6, 9, 12)}  # each round's short prompt
    result = asyncio.run(probe_engine(_with_delays(engine, shorts), random.Random(4), 1024,
                                      max_rounds=5))
    assert (result.prefill_tokens_per_s, result.decode_step_s) == (0.0, 0.0)
    assert result.requests == 1 + 2 + 3 * 4 == len(engine.prompts)


def test_the_long_prompt_fits_the_engines_context():
    engine = Engine(context=600)
    result = asyncio.run(probe_engine(engine.complete, random.Random(1), 1024, max_context=600))
    assert max(len(p.split()) for p in engine.prompts) <= 360  # about half of it
    assert result.prefill_tokens_per_s == pytest.approx(2000.0, rel=0.05)
    tiny = Engine(context=100)  # too short a context to tell prefill from the fixed cost
    result = asyncio.run(probe_engine(tiny.complete, random.Random(1), 1024, max_context=100))
    assert result.prefill_tokens_per_s == 0.0


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 3000))
def test_probe_prompts_are_long_enough_and_never_repeat(seed: int, chars: int):
    rng = random.Random(seed)
    first, second = probe_text(rng, chars), probe_text(rng, chars)
    assert len(first) >= chars and len(second) >= chars
    assert first.split()[0] != second.split()[0]  # a random first word: no cached block


def test_speed_reports_the_probe_until_timings_replace_it():
    speed = EngineSpeed()
    speed.calibrate(300.0, 0.05)
    assert (speed.prefill_tokens_per_s, speed.decode_step_s) == (300.0, 0.05)
    for n in (100, 400, 700, 1000):  # a clear line: the timings' own figure
        speed.observe(n, 0.05 + n / 450, 0.3, 10, queued_behind_own=False)
    assert speed.prefill_tokens_per_s == pytest.approx(450.0)
    assert speed.decode_step_s == pytest.approx(0.03)
    restarted = speed.fresh()  # timings gone, the probe kept
    assert (restarted.prefill_tokens_per_s, restarted.decode_step_s) == (300.0, 0.05)


class FakeServer:
    """An OpenAI completions endpoint over `Engine` (sleeping its seconds), with `/metrics`
    saying how many requests run and how many prefills it timed (as vLLM's histograms do:
    its own, plus `others` served beside the first one), and `/v1/models` its context."""

    def __init__(self, engine: Engine, running: int = 0, refuse: bool = False,
                 others: int = 0) -> None:
        self.engine, self.running, self.refuse, self.others = engine, running, refuse, others
        self.url = ""

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.refuse:
            return web.json_response({"error": {"message": "no"}}, status=400)
        tokens, max_tokens = len(body["prompt"].split()), body["max_tokens"]
        await asyncio.sleep(self.engine.seconds(tokens, max_tokens))
        self.engine.prompts.append(body["prompt"])
        return web.json_response({"choices": [{"text": "x", "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": tokens,
                                            "completion_tokens": max_tokens}})

    async def metrics(self, _request: web.Request) -> web.Response:
        served = len(self.engine.prompts)
        prefills = served + (self.others if served else 0)
        return web.Response(text=f'process_start_time_seconds 1.0\n'
                            f'vllm:num_requests_running{{engine="0"}} {self.running}\n'
                            f'vllm:num_requests_waiting{{engine="0"}} 0\n'
                            f'vllm:request_prefill_time_seconds_count{{engine="0"}} {prefills}\n'
                            f'vllm:request_prefill_time_seconds_sum{{engine="0"}} {prefills}\n'
                            f'vllm:request_prefill_kv_computed_tokens_sum{{engine="0"}} '
                            f'{100 * prefills}\n')

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 4096}]})

    async def serve(self, test) -> object:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            return await test(self)
        finally:
            await runner.cleanup()


def test_an_idle_engine_is_probed_before_it_takes_requests():
    """Joined through `WorkerSync.add`, as `radixray route` joins its engines: the stats the
    router prices with carry the probed speeds before any request was routed."""

    async def test(server: FakeServer):
        from router.config import RouterConfig
        from router.metrics import RouterMetrics
        from router.routing.core import RoutingCore

        core = RoutingCore()
        sync = WorkerSync(RouterConfig(model="m"), core, RouterMetrics())
        backend = HttpBackend("h", server.url, block_size=16, probe_tokens=512)
        try:
            await sync.add(backend)
            return (await backend.stats()), core.estimator.fleet.prefill_tokens_per_s
        finally:
            await backend.close()

    stats, fleet_speed = asyncio.run(FakeServer(Engine(speed=2000.0, step_s=0.02)).serve(test))
    assert stats.prefill_tokens_per_s == pytest.approx(2000.0, rel=0.25)
    assert stats.decode_step_s == pytest.approx(0.02, rel=0.25)
    assert fleet_speed == stats.prefill_tokens_per_s  # what `cost` prices new workers at


@pytest.mark.parametrize("case", ["busy", "refuses", "off", "shared"])
def test_no_probe_or_a_failed_one_leaves_the_speeds_to_traffic(case: str, caplog):
    """A busy engine is not probed (its queue would be in the timings), one that refuses the
    probe still joins (logged), `probe_tokens` 0 sends nothing, and a probe the engine served
    other requests beside (its prefill count says so) is not used."""
    engine = Engine()
    server = FakeServer(engine, running=1 if case == "busy" else 0, refuse=case == "refuses",
                        others=2 if case == "shared" else 0)

    async def test(server: FakeServer):
        backend = HttpBackend("h", server.url, block_size=16,
                              probe_tokens=0 if case == "off" else 512)
        try:
            await backend.ready()
            await backend.calibrate()
            return await backend.stats()
        finally:
            await backend.close()

    with caplog.at_level("WARNING", logger="radixray.router"):
        stats = asyncio.run(server.serve(test))
    assert stats.prefill_tokens_per_s == 0.0 and stats.decode_step_s == 0.0
    assert bool(engine.prompts) == (case == "shared")
    assert ("probing engine h failed" in caplog.text) == (case == "refuses")
    assert ("2 other requests during its probe" in caplog.text) == (case == "shared")
