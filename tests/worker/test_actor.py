"""WorkerActor on a real local Ray: streams, aborts, stats, KV events, sessions."""

from __future__ import annotations

import asyncio
import random

import pytest
import ray

from mem_cache.events import AllCleared, BlockStored, decode_batch
from worker.actor import WorkerActor
from worker.engine import Engine, EngineConfig
from worker.offline import run_to_completion
from worker.protocol import GenerateRequest, SamplingParams, TokenChunk

pytestmark = pytest.mark.ray
CONFIG = EngineConfig(kv_tokens=4096, prefill_budget=64)


@pytest.fixture(scope="module")
def actor():
    """The worker actor (the tests compare its streams with an in-process engine's)."""
    ray.init(include_dashboard=False, num_cpus=2, address="local")
    try:
        handle = WorkerActor.remote(CONFIG, "w-test")
        ray.get(handle.ready.remote(), timeout=120)
        yield handle
    finally:
        ray.shutdown()


def prompt(seed: int, length: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(length)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def stream(actor, req: GenerateRequest) -> list[TokenChunk]:
    gen = actor.generate.options(num_returns="streaming").remote(req)
    return [ray.get(ref, timeout=60) for ref in gen]


def test_ready_describes_the_worker(actor):
    info = ray.get(actor.ready.remote())
    assert info["model"] == "tiny" and info["kv_tokens"] == 4096 and info["page_size"] == 1
    assert info["max_context"] > 0 and info["worker_id"] == "w-test"


def test_generate_streams_what_the_engine_computes(actor):
    p = prompt(1)
    expected = run_to_completion(Engine(CONFIG), [GenerateRequest("x", p, greedy(20))])["x"]
    chunks = stream(actor, GenerateRequest("g1", p, greedy(20)))
    assert [t for c in chunks for t in c.token_ids] == expected.token_ids
    assert chunks[-1].finish_reason == "length" and all(
        c.finish_reason is None for c in chunks[:-1]
    )
    assert chunks[-1].prompt_tokens == len(p)
    again = stream(actor, GenerateRequest("g2", p, greedy(20)))
    assert again[-1].cached_tokens == len(p) - 1


def test_bad_request_raises_value_error(actor):
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        stream(actor, GenerateRequest("bad", [], greedy(4)))
    assert isinstance(info.value.cause, ValueError)
    ray.get(actor.check_integrity.remote())


def test_abort_ends_the_stream(actor):
    gen = actor.generate.options(num_returns="streaming").remote(
        GenerateRequest("ab", prompt(2), greedy(2000))
    )
    first = ray.get(next(gen), timeout=60)
    assert first.finish_reason is None
    ray.get(actor.abort.remote("ab"))
    rest = [ray.get(ref, timeout=60) for ref in gen]
    assert rest[-1].finish_reason == "abort"
    wait_idle(actor)


def test_cancelled_stream_aborts_its_request(actor):
    wait_idle(actor)
    before = ray.get(actor.stats.remote()).kv_evictable
    gen = actor.generate.options(num_returns="streaming").remote(
        GenerateRequest("cx", prompt(3), greedy(4000))
    )
    ray.get(next(gen), timeout=60)
    ray.cancel(gen)
    wait_idle(actor)
    # run to the end, it would have cached ~4000 tokens; cancelled, it cached what it had
    assert ray.get(actor.stats.remote()).kv_evictable - before < 2000


def wait_idle(actor, timeout_s: float = 30.0) -> None:
    """Until the actor reports nothing running; then the idle conservation check holds."""

    async def poll() -> None:
        while True:
            s = await actor.stats.remote()
            if s.running == 0 and s.waiting == 0:
                return
            await asyncio.sleep(0.05)

    asyncio.run(asyncio.wait_for(poll(), timeout_s))
    ray.get(actor.check_integrity.remote())
    s = ray.get(actor.stats.remote())
    assert s.kv_free + s.kv_evictable + s.kv_session + s.kv_protected == s.kv_total


def test_concurrent_streams_and_stats(actor):
    reqs = [GenerateRequest(f"c{i}", prompt(10 + i), greedy(15)) for i in range(4)]
    gens = [actor.generate.options(num_returns="streaming").remote(r) for r in reqs]
    outs = [[ray.get(ref, timeout=60) for ref in g] for g in gens]
    assert all(sum(len(c.token_ids) for c in out) == 15 for out in outs)
    wait_idle(actor)
    s = ray.get(actor.stats.remote())
    assert s.worker_id == "w-test" and s.kv_total == 4096 and s.kv_evictable > 0
    assert s.prefill_tokens_per_s > 0 and s.decode_step_s > 0


def test_kv_events_incremental_then_snapshot(actor):
    snap = [decode_batch(b) for b in ray.get(actor.kv_events.remote(-1, -1))]
    assert len(snap) == 1 and isinstance(snap[0].events[0], AllCleared)
    epoch, seq = snap[0].epoch, snap[0].seq
    stream(actor, GenerateRequest("ev", prompt(99, 64), greedy(4)))
    new = [decode_batch(b) for b in ray.get(actor.kv_events.remote(epoch, seq))]
    assert [b.seq for b in new] == list(range(seq + 1, seq + 1 + len(new)))
    assert any(isinstance(e, BlockStored) for b in new for e in b.events)


def test_sessions_park_and_close(actor):
    p = prompt(7)
    first = stream(actor, GenerateRequest("s1", p, greedy(6), session_id="sess"))
    out = [t for c in first for t in c.token_ids]
    assert ray.get(actor.stats.remote()).sessions == 1
    second = stream(actor, GenerateRequest("s2", p + out + [5], greedy(6), session_id="sess"))
    assert second[-1].cached_tokens == len(p) + len(out) - 1
    assert ray.get(actor.close_session.remote("sess")) is True
    assert ray.get(actor.close_session.remote("sess")) is False
    wait_idle(actor)
    assert ray.get(actor.stats.remote()).kv_session == 0


def test_merge_chunks_joins_tokens_and_logprobs_in_order():
    from worker.actor import merge_chunks

    a = TokenChunk("m", [1, 2], None, 5, 3, [-0.1, -0.2], [[(1, -0.1)], [(2, -0.2)]])
    b = TokenChunk("m", [3], "stop", 5, 3, [-0.3], [[(3, -0.3)]])
    merged = merge_chunks([a, b])
    assert merged.token_ids == [1, 2, 3] and merged.finish_reason == "stop"
    assert merged.logprobs == [-0.1, -0.2, -0.3] and len(merged.top_logprobs) == 3
    assert (merged.prompt_tokens, merged.cached_tokens) == (5, 3)
    assert merge_chunks([a]) is a
