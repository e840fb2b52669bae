"""Engine outputs are exactly what the model computes, however the work is cached or batched."""

from __future__ import annotations

import random

import pytest
import torch
from engine_kit import assert_idle_clean, checked, greedy, make

from mem_cache.events import AllCleared, BlockStored, block_hashes, decode_batch
from worker.engine import Engine
from worker.offline import run_to_completion
from worker.protocol import GenerateRequest, SamplingParams


def prompts(n: int, length: int, shared: int = 0, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` tokens whose first `shared` tokens are the same."""
    rng = random.Random(seed)
    head = [rng.randrange(3, 1000) for _ in range(shared)]
    return [head + [rng.randrange(3, 1000) for _ in range(length - shared)] for _ in range(n)]


def run(engine: Engine, ps: list[list[int]], sp: SamplingParams, tag: str = "r") -> list:
    reqs = [GenerateRequest(f"{tag}{i}", p, sp) for i, p in enumerate(ps)]
    out = run_to_completion(engine, reqs, after_step=checked)
    assert_idle_clean(engine)
    return [out[r.request_id] for r in reqs]


@pytest.fixture(scope="module")
def reference() -> dict[tuple, list[int]]:
    """Greedy outputs of each prompt run alone, cache off, unchunked: the ground truth."""
    engine = make(enable_cache=False, prefill_budget=8192)
    ps = prompts(4, 70, shared=40) + prompts(2, 33, seed=1)
    return {tuple(p): run(engine, [p], greedy())[0].token_ids for p in ps}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("budget", [16, 8192])
def test_cache_chunking_and_pages_do_not_change_greedy_output(reference, page_size, budget):
    engine = make(page_size=page_size, prefill_budget=budget)
    ps = [list(p) for p in reference]
    first = run(engine, ps, greedy(), "a")  # concurrent: they share a 40-token prefix
    again = run(engine, ps, greedy(), "b")  # every prompt now fully cached
    for p, a, b in zip(ps, first, again, strict=True):
        assert a.token_ids == reference[tuple(p)]
        assert b.token_ids == reference[tuple(p)]
        assert b.finish_reason == "length"


@pytest.mark.parametrize("page_size", [1, 16])
def test_repeat_reports_the_real_reuse(page_size):
    engine = make(page_size=page_size)
    p = prompts(1, 75)[0]
    miss = run(engine, [p], greedy(8))[0]
    computed = engine.num_computed_tokens
    hit = run(engine, [p], greedy(8))[0]
    assert miss.cached_tokens == 0
    assert hit.cached_tokens == (len(p) - 1) // page_size * page_size
    # prefill of the hit ran only the uncached tokens, then 7 decode steps
    assert engine.num_computed_tokens - computed == len(p) - hit.cached_tokens + 7
    assert hit.token_ids == miss.token_ids
    assert hit.prompt_tokens == len(p)


@pytest.mark.parametrize("host_kv_tokens", [0, 2048])
def test_warm_up_leaves_no_trace(reference, host_kv_tokens):
    """After `warm_up` (what a worker actor runs before it serves) the engine is as new: every
    slot free in both tiers, no KV event, no measured speed, and requests get what a fresh
    engine gives them, nothing cached."""
    engine = make(host_kv_tokens=host_kv_tokens)
    engine.warm_up()
    s = engine.stats()
    assert (s.kv_free, s.kv_evictable, s.kv_host_free) == (s.kv_total, 0, s.kv_host_total)
    assert (s.prefill_tokens_per_s, s.decode_step_s, engine.num_steps) == (0.0, 0.0, 0)
    assert s.prefill_tokens_measured == 0
    assert engine.take_event_batch() is None
    snapshot = decode_batch(engine.snapshot_batch())
    assert [type(e) for e in snapshot.events] == [AllCleared]
    ps = [list(p) for p in reference]
    out = run(engine, ps, greedy())
    assert [o.token_ids for o in out] == [reference[tuple(p)] for p in ps]
    assert out[0].cached_tokens == 0


def test_full_hit_still_recomputes_the_last_token():
    engine = make()
    p = prompts(1, 40)[0]
    out = run(engine, [p + [5]], greedy(4))  # caches p + [5] + 3 outputs
    again = run(engine, [p + [5]], greedy(4))
    assert again[0].cached_tokens == len(p)
    assert again[0].token_ids == out[0].token_ids


def test_alone_equals_inside_a_mixed_batch(reference):
    engine = make(prefill_budget=48)
    ps = [list(p) for p in reference]
    others = [GenerateRequest(f"o{i}", p, greedy(20)) for i, p in enumerate(prompts(5, 50, seed=7))]
    for r in others[:3]:
        engine.add_request(r)
    for _ in range(3):  # the first three are part-way through prefill or decoding
        engine.step()
    reqs = [GenerateRequest(f"x{i}", p, greedy()) for i, p in enumerate(ps)] + others[3:]
    out = run_to_completion(engine, reqs, after_step=checked)
    for i, p in enumerate(ps):
        assert out[f"x{i}"].token_ids == reference[tuple(p)]
    assert_idle_clean(engine)


def test_new_requests_join_a_running_decode_batch():
    engine = make(prefill_budget=32)
    engine.add_request(GenerateRequest("a", prompts(1, 20)[0], greedy(30)))
    for _ in range(3):
        engine.step()
    engine.add_request(GenerateRequest("b", prompts(1, 90, seed=3)[0], greedy(5)))
    for _ in range(3):  # b prefills in chunks of <= 31 tokens while a keeps decoding
        chunks = {c.request_id: c for c in engine.step()}
        assert len(chunks["a"].token_ids) == 1
        assert engine.stats().running == 2
    run_to_completion(engine, after_step=checked)
    assert_idle_clean(engine)


def test_concurrent_requests_share_finished_chunks():
    engine = make(prefill_budget=32)
    p = prompts(1, 120)[0]
    engine.add_request(GenerateRequest("a", p, greedy(4)))
    engine.step()
    engine.step()  # two chunks of a are computed and cached
    out = run_to_completion(engine, [GenerateRequest("b", p, greedy(4))], after_step=checked)
    assert out["b"].cached_tokens >= 64
    assert_idle_clean(engine)


def test_stop_token_ids_min_tokens_and_ignore_eos():
    engine = make()
    p = prompts(1, 30)[0]
    free = run(engine, [p], greedy(10))[0].token_ids
    stop = run(engine, [p], greedy(10, stop_token_ids=[free[2]]))[0]
    assert stop.finish_reason == "stop" and stop.token_ids == free[: free.index(free[2]) + 1]
    late = run(engine, [p], greedy(10, stop_token_ids=[free[0]], min_tokens=3))[0]
    assert free[0] not in late.token_ids[:3]
    engine.eos_token_ids = [free[0]]
    assert run(engine, [p], SamplingParams(max_tokens=10, temperature=0))[0].finish_reason == "stop"
    ignored = run(engine, [p], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert ignored.token_ids == free and ignored.finish_reason == "length"


def test_resume_ids_continue_where_the_stream_stopped():
    engine = make()
    p = prompts(1, 30)[0]
    full = run(engine, [p], greedy(10))[0].token_ids
    resumed = run_to_completion(
        engine, [GenerateRequest("r", p, greedy(10), resume_ids=full[:4])], after_step=checked
    )["r"]
    assert resumed.token_ids == full[4:] and resumed.finish_reason == "length"
    assert resumed.prompt_tokens == len(p)


@pytest.mark.parametrize(
    "request_",
    [
        GenerateRequest("e", [], SamplingParams()),
        GenerateRequest("e", [1, 2], SamplingParams(max_tokens=0)),
        GenerateRequest("e", [1, 2], SamplingParams(max_tokens=5000)),  # over the KV pool
        GenerateRequest("e", [5000], SamplingParams()),  # outside the vocabulary
        GenerateRequest("e", [1, -1], SamplingParams()),
        GenerateRequest("e", [1, 2.0], SamplingParams()),  # not integers
        GenerateRequest("e", [1, "2"], SamplingParams()),
        GenerateRequest("e", [True, False], SamplingParams()),
        GenerateRequest("e", [1, 2**70], SamplingParams()),
        GenerateRequest("e", [[1, 2], [3, 4]], SamplingParams()),  # not flat
        GenerateRequest("e", [[1, 2], [3]], SamplingParams()),
        GenerateRequest("e", [1, 2], SamplingParams(), resume_ids=[-3]),
        GenerateRequest("e", [1, 2], SamplingParams(temperature=-1)),
        GenerateRequest("e", [1, 2], SamplingParams(top_p=0)),
        GenerateRequest("e", [1, 2], SamplingParams(logprobs=21)),
        GenerateRequest("e", [1, 2], SamplingParams(max_tokens=2), resume_ids=[3, 4]),
    ],
)
def test_bad_requests_raise_value_error_and_leave_nothing(engine_4k, request_):
    with pytest.raises(ValueError):
        engine_4k.add_request(request_)
    assert not engine_4k.has_work()
    assert_idle_clean(engine_4k)


def test_context_limit_and_duplicate_ids():
    engine = make(max_context=64)
    with pytest.raises(ValueError, match="context"):
        engine.add_request(GenerateRequest("a", list(range(3, 60)), SamplingParams(max_tokens=8)))
    engine.add_request(GenerateRequest("a", [3, 4], greedy(4)))
    with pytest.raises(ValueError, match="already"):
        engine.add_request(GenerateRequest("a", [3, 4], greedy(4)))
    run_to_completion(engine)
    assert_idle_clean(engine)


@pytest.fixture(scope="module")
def engine_4k() -> Engine:
    return make()


def test_events_number_batches_and_snapshot_lists_every_cached_block():
    engine = make(block_size=16)
    p = prompts(1, 50)[0]
    run(engine, [p], greedy(6))
    snap = decode_batch(engine.snapshot_batch())
    assert snap.epoch == engine.events.epoch and isinstance(snap.events[0], AllCleared)
    stored = [h for e in snap.events[1:] if isinstance(e, BlockStored) for h in e.hashes]
    cached = (p + run(engine, [p], greedy(6))[0].token_ids)[:55]  # prompt + 5 outputs have KV
    assert block_hashes(cached, None, 16)[:3] == stored[:3]
    batches = [decode_batch(b) for b in engine.events_since(engine.events.epoch, 0)]
    assert [b.seq for b in batches] == list(range(1, len(batches) + 1))
    assert [h for b in batches for e in b.events if isinstance(e, BlockStored) for h in e.hashes]
    stale = engine.events_since(engine.events.epoch - 1, 0)
    assert len(stale) == 1 and isinstance(decode_batch(stale[0]).events[0], AllCleared)


def test_going_idle_settles_in_step_or_when_the_caller_says(monkeypatch):
    """The worker actor steps with settle=False and settles once the chunks are handed on, so
    the O(pool) integrity check never delays a last token; step() alone still settles."""
    engine = make()
    checks = []
    monkeypatch.setattr(engine, "check_integrity", lambda: checks.append(engine.has_work()))
    engine.add_request(GenerateRequest("a", [1, 2, 3, 4], greedy(2)))
    chunks = []
    while engine.has_work():
        chunks += engine.step(settle=False)
        assert checks == []
    assert chunks[-1].finish_reason == "length"
    engine.settle_if_idle()
    assert checks == [False]  # checked once, idle
    engine.add_request(GenerateRequest("b", [1, 2, 3, 4], greedy(2)))
    engine.settle_if_idle()  # work queued: nothing to settle
    assert checks == [False]
    while engine.has_work():
        engine.step()
    assert checks == [False, False]


def test_stats_report_load_and_kv_accounting():
    engine = make(prefill_budget=16)
    for i, p in enumerate(prompts(3, 40)):
        engine.add_request(GenerateRequest(f"s{i}", p, greedy(8)))
    s = engine.stats()
    assert (s.waiting, s.running, s.waiting_prefill_tokens) == (3, 0, 120)
    engine.step()
    s = engine.stats()
    assert s.running == 1 and s.waiting == 2 and s.running_decode_tokens == 16
    assert s.kv_total == 4096 and s.kv_free < 4096 and s.model == "tiny"
    run_to_completion(engine, after_step=checked)
    s = engine.stats()
    assert s.prefill_tokens_per_s > 0 and s.decode_step_s > 0
    assert s.prefill_tokens_measured == 120  # every prompt token, measured once
    assert_idle_clean(engine)


@pytest.mark.parametrize(
    "bad", [{"page_size": 0}, {"prefill_budget": 0}, {"kv_tokens": 0}, {"host_kv_tokens": -1}]
)
def test_bad_engine_config_is_rejected(bad):
    with pytest.raises(ValueError):
        make(**bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_engine_cache_and_chunking_do_not_change_greedy_output(page_size):
    ps = prompts(4, 70, shared=40)
    plain = run(make(device="cuda", enable_cache=False, prefill_budget=8192), ps, greedy())
    engine = make(device="cuda", page_size=page_size, prefill_budget=16, host_kv_tokens=4096)
    for tag in ("a", "b"):
        out = run(engine, ps, greedy(), tag)
        assert [o.token_ids for o in out] == [o.token_ids for o in plain]


def test_a_short_first_prefill_does_not_set_the_speed():
    """The prefill speed is a weighted mean of steps weighted by their size: a first step of 10
    tokens (mostly fixed overhead: 833 tokens/s) gives way to the first full step (50,000)."""
    engine = make()
    engine._measure(0.012, 10)
    assert engine.stats().prefill_tokens_per_s == pytest.approx(10 / 0.012)
    engine._measure(0.01, 500)
    s = engine.stats()
    assert s.prefill_tokens_per_s > 0.95 * 50_000
    assert s.prefill_tokens_measured == 510
