"""The step time model: monotone in every input, and a fit recovers known coefficients."""

import json
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.sim.time_model import (
    StepSample,
    TimeProfile,
    attended_pairs,
    fit_profile,
    h100_llama3_8b,
)

PROFILE = h100_llama3_8b()
small = st.integers(min_value=0, max_value=20_000)


@given(small, small, st.integers(0, 256), small, st.integers(1, 5000))
def test_step_time_grows_with_every_input(prefill, prefix, batch, context, more):
    base = PROFILE.step_s(prefill, attended_pairs(prefill, prefix), batch, context)
    assert PROFILE.step_s(prefill + more, attended_pairs(prefill + more, prefix), batch,
                          context) >= base
    assert PROFILE.step_s(prefill, attended_pairs(prefill, prefix + more), batch, context) >= base
    assert PROFILE.step_s(prefill, attended_pairs(prefill, prefix), batch + 1, context) >= base
    assert PROFILE.step_s(prefill, attended_pairs(prefill, prefix), batch, context + more) >= base


def test_prefill_time_grows_with_prompt_and_prefix():
    times = [PROFILE.prefill_s(n) for n in (1, 512, 2048, 8192, 20_000)]
    assert times == sorted(times) and times[0] > 0
    assert PROFILE.prefill_s(2048, prefix_tokens=8192) > PROFILE.prefill_s(2048)


def test_default_profile_is_in_the_published_range():
    decode = PROFILE.step_s(0, 0, 1, 1000)
    assert 0.005 < decode < 0.012  # ~100-200 tokens/s for one stream of an 8B model on H100
    speed = 8192 / PROFILE.prefill_s(8192)
    assert 10_000 < speed < 50_000
    assert 200_000 < PROFILE.kv_tokens < 800_000


def test_fit_recovers_a_known_profile():
    truth = TimeProfile(base_s=0.01, token_s=5e-5, attn_pair_s=2e-9, kv_read_s=1e-7)
    samples = []
    for n in (128, 512, 2048, 4096):
        for prefix in (0, 4096):
            pairs = attended_pairs(n, prefix)
            samples.append(StepSample(n, pairs, 0, 0, truth.step_s(n, pairs, 0, 0)))
    for batch in (1, 8, 32):
        for ctx in (1000, 20_000):
            samples.append(StepSample(0, 0, batch, ctx, truth.step_s(0, 0, batch, ctx)))
    fitted = fit_profile(samples)
    for key in ("base_s", "token_s", "attn_pair_s", "kv_read_s"):
        assert abs(getattr(fitted, key) - getattr(truth, key)) <= 1e-3 * getattr(truth, key)


@pytest.mark.parametrize("seed", range(5))
def test_fit_keeps_a_short_step_under_noisy_long_prefills(seed):
    """A CPU engine's probes: prefills of 0.5-4 s (one step each) and decode steps of ~50-110
    ms, each off by up to 3%. The decode step comes back within 6% and its fixed cost within
    10%; fit in absolute seconds, the prefills' noise moved the fixed cost by up to 28%."""
    truth = TimeProfile(base_s=0.0465, token_s=2.75e-3, attn_pair_s=7.6e-7, kv_read_s=1e-5,
                        prefill_budget=2048)
    rng = random.Random(seed)
    samples = []
    for n in (160, 320, 640, 1280):
        pairs = attended_pairs(n, 0)
        seconds = truth.step_s(n, pairs, 0, 0) * rng.uniform(0.97, 1.03)
        samples.append(StepSample(n, pairs, 0, 0, seconds))
    for words in (80, 400):
        for batch in (1, 4, 8):
            ctx = batch * (words + 32)
            samples.append(StepSample(0, 0, batch, ctx,
                                      truth.step_s(0, 0, batch, ctx) * rng.uniform(0.97, 1.03)))
    fitted = fit_profile(samples)
    assert fitted.base_s == pytest.approx(truth.base_s, rel=0.10)
    for batch, ctx in ((1, 112), (8, 8 * 432)):
        assert fitted.step_s(0, 0, batch, ctx) == pytest.approx(
            truth.step_s(0, 0, batch, ctx), rel=0.06)


def test_fit_refuses_a_sample_without_duration():
    good = StepSample(128, attended_pairs(128, 0), 0, 0, 0.1)
    with pytest.raises(ValueError, match="positive duration"):
        fit_profile([good, StepSample(0, 0, 1, 100, 0.0)])


def test_profile_round_trips_through_json(tmp_path):
    path = tmp_path / "p.json"
    PROFILE.save(path)
    assert TimeProfile.load(path) == PROFILE
    assert json.loads(path.read_text())["name"] == "h100-llama3-8b"
