"""The host KV tier behind the engine: evicted prefixes come back from host memory, exactly."""

from __future__ import annotations

import pytest
from engine_kit import prompt

from worker.engine import Engine, EngineConfig
from worker.offline import run_to_completion
from worker.protocol import GenerateRequest, SamplingParams

SP = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def run(engine: Engine, rid: str, ids: list[int]):
    out = run_to_completion(
        engine, [GenerateRequest(rid, ids, SP)], after_step=lambda e, s: e.check_integrity()
    )[rid]
    s = engine.stats()
    assert (s.running, s.kv_protected, s.kv_session) == (0, 0, 0)
    assert s.kv_free + s.kv_evictable == s.kv_total
    return out


@pytest.fixture(scope="module")
def reference() -> dict[int, list[int]]:
    engine = Engine(EngineConfig(kv_tokens=2048, enable_cache=False))
    return {seed: run(engine, f"ref{seed}", prompt(96, seed)).token_ids for seed in range(5)}


@pytest.mark.parametrize(
    ("policy", "page_size"),
    [
        ("write_through", 1),
        ("write_through", 16),
        ("write_through_selective", 1),
        ("write_back", 16),
    ],
)
def test_prefix_evicted_to_host_is_loaded_back_with_the_same_output(reference, policy, page_size):
    engine = Engine(
        EngineConfig(kv_tokens=256, page_size=page_size, host_kv_tokens=2048, host_policy=policy)
    )
    first = run(engine, "a0", prompt(96, 0))
    if policy == "write_through_selective":  # backed up on its second use
        run(engine, "a1", prompt(96, 0))
    for seed in range(1, 5):  # four other prompts push prompt 0 out of the 256 device slots
        assert run(engine, f"o{seed}", prompt(96, seed)).token_ids == reference[seed]
    s = engine.stats()
    assert s.kv_host_total == 2048 and s.kv_host_free < 2048
    again = run(engine, "b", prompt(96, 0))
    assert first.token_ids == again.token_ids == reference[0]
    assert again.cached_tokens >= 64  # came back from host, not recomputed


def test_without_a_host_tier_the_evicted_prefix_is_recomputed(reference):
    engine = Engine(EngineConfig(kv_tokens=256))
    run(engine, "a", prompt(96, 0))
    for seed in range(1, 5):
        run(engine, f"o{seed}", prompt(96, seed))
    again = run(engine, "b", prompt(96, 0))
    assert again.cached_tokens == 0 and again.token_ids == reference[0]
    assert engine.stats().kv_host_total == 0


def test_bad_host_policy_is_rejected():
    with pytest.raises(ValueError):
        Engine(EngineConfig(kv_tokens=256, host_kv_tokens=512, host_policy="sometimes"))
