"""Gemma 3 270M (real weights) on the engine: greedy output identical to transformers'.

Prompts shorter and longer than the sliding window (512), prefilled in chunks that cross it,
page sizes 1 and 16, cached prefixes from the component cache (with a window pool small enough
that the tree tombstones window KV, so that a match past a tombstone is cut back and the rest
recomputed), a session's second turn, an abort and a retraction mid-prefill; after every step
the engine's integrity check runs, which holds each request's window KV to its window
(`KVMemory._check_window`), balances both pools (`WindowKV.check`) and checks the cache's
invariants per component; the idle engine's slots are all free or the tree's, per component.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mem_cache.events import SLIDING_WINDOW, BlockStored, KVGroup, decode_batch
from tests.gemma3_env import require_gemma3_dir
from worker.engine import Engine, EngineConfig
from worker.offline import run_to_completion
from worker.protocol import GenerateRequest, SamplingParams

transformers = pytest.importorskip("transformers")

MAX_NEW = 6
WINDOW = 512


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return require_gemma3_dir()


@pytest.fixture(scope="module")
def prompts(model_dir) -> dict[str, list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = (Path(__file__).parents[2] / "docs" / "engine.md").read_text()
    ids = tok(text)["input_ids"]
    assert len(ids) > 800
    return {"short": ids[:40], "long": ids[:700], "other": ids[:3] + ids[300:830]}


@pytest.fixture(scope="module")
def hf(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


_refs: dict[tuple[int, ...], list[int]] = {}


def hf_greedy(hf, prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
    key = (*prompt, -max_new)
    if key not in _refs:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0)
        _refs[key] = out[0, len(prompt) :].tolist()
    return _refs[key]


def make_engine(model_dir, page_size: int, **kw) -> Engine:
    cfg = dict(model=str(model_dir), page_size=page_size, prefill_budget=192, kv_tokens=2048,
               max_running=4, pack_weights=False)
    cfg.update(kw)
    return Engine(EngineConfig(**cfg))


@pytest.fixture(scope="module")
def engine16(model_dir):
    return make_engine(model_dir, 16)


def sp(max_new: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=max_new, min_tokens=max_new, temperature=0.0)


def run(engine: Engine, reqs: list[GenerateRequest], after=None) -> dict[str, list[int]]:
    def each_step(e: Engine, step: int) -> None:
        e.check_integrity()
        if after is not None:
            after(e, step)

    out = run_to_completion(engine, reqs, after_step=each_step)
    assert_idle(engine)
    return {rid: c.token_ids for rid, c in out.items()}


def assert_idle(engine: Engine) -> None:
    """Nothing running: each pool's slots are free or the tree's (no session parked)."""
    engine.check_integrity()
    mem = engine.memory
    if not engine.sessions:
        tree = mem.radix.total_size(0) if mem.radix is not None else 0
        assert mem.allocator.available_size() + tree == mem.allocator.size
        tree = mem.radix.total_size(1) if mem.radix is not None else 0
        assert mem.window.allocator.available_size() + tree == mem.window.size


def test_greedy_matches_transformers_short_and_past_the_window(model_dir, hf, prompts):
    reqs = [GenerateRequest(name, prompts[name], sp()) for name in ("short", "long", "other")]
    held: list[int] = []

    def window_held(e: Engine, step: int) -> None:
        held.append(e.memory.window.attached())

    engine = make_engine(model_dir, 16, enable_cache=False)
    out = run(engine, reqs, window_held)
    for name in ("short", "long", "other"):
        assert out[name] == hf_greedy(hf, prompts[name]), name
    # three requests, each with its window, a page either side and this step's chunk at most
    assert max(held) <= 3 * (WINDOW + 2 * 16) + 192
    assert max(held) < sum(len(p) for p in prompts.values())  # the long ones did let go


def test_cached_prefixes_and_a_hit_past_a_tombstone(model_dir, hf, prompts):
    # a window pool of 800 slots: the tree must tombstone window KV to serve the next prompts
    engine = make_engine(model_dir, 16, window_kv_tokens=800)
    radix = engine.memory.radix
    long, short = prompts["long"], prompts["short"]

    def serve(name: str, prompt: list[int]) -> int:
        done = run_to_completion(engine, [GenerateRequest(name, prompt, sp())],
                                 after_step=lambda e, s: e.check_integrity())[name]  # fmt: skip
        assert_idle(engine)
        assert done.token_ids == hf_greedy(hf, prompt), name
        return done.cached_tokens

    assert serve("a", long) == 0
    assert serve("b", long[:650] + short[5:35]) == 640  # the window behind 640 is intact
    assert serve("c", long[:300] + prompts["other"][400:500]) == 288  # it needs room: tombstones
    # (least recently used first, more if need be) until the full KV of "a" matches further
    # than where every layer can resume: the hit is cut back to before the tombstone
    m = radix.match_prefix(long[:-1])
    while m.full_length == m.length and radix.evict_window(1, 16):
        m = radix.match_prefix(long[:-1])
    assert m.length < m.full_length
    stored = stored_blocks(engine)  # tombstoned blocks: stored in group 0 only
    assert 0 < stored[1] < stored[0]
    assert serve("d", long) == m.length  # and the rest is recomputed, the same text
    stored = stored_blocks(engine)  # "d" refilled the tombstones on its path
    assert stored[1] == stored[0]


def stored_blocks(engine: Engine) -> dict[int, int]:
    """Blocks stored per KV group in the engine's event snapshot (each event names its group),
    checked against the cache's sizes."""
    stored = {0: 0, 1: 0}
    for event in decode_batch(engine.snapshot_batch()).events:
        if isinstance(event, BlockStored):
            assert event.group in (KVGroup(0), KVGroup(1, SLIDING_WINDOW, WINDOW))
            stored[event.group.index] += len(event.hashes)
    radix = engine.memory.radix
    assert stored == {0: radix.total_size(0) // 16, 1: radix.total_size(1) // 16}
    return stored


@pytest.mark.parametrize("attention", ["torch", "native"])
def test_page_size_one(model_dir, hf, prompts, attention):
    engine = make_engine(model_dir, 1, attention=attention, prefill_budget=256)
    out = run(engine, [GenerateRequest("long", prompts["long"], sp())])
    assert out["long"] == hf_greedy(hf, prompts["long"])


def test_session_turns_continue_past_the_window(engine16, hf, prompts):
    first = prompts["long"]
    sess = dict(session_id="s1", session_ttl_s=60.0)
    out1 = run(engine16, [GenerateRequest("t1", first, sp(), **sess)])["t1"]
    assert out1 == hf_greedy(hf, first)
    assert engine16.sessions  # parked: it keeps its KV, the window's only for window layers
    second = first + out1 + prompts["short"][1:20]
    out2 = run_to_completion(engine16, [GenerateRequest("t2", second, sp(), **sess)],
                             after_step=lambda e, s: e.check_integrity())["t2"]  # fmt: skip
    assert out2.cached_tokens >= len(first) // 16 * 16
    assert out2.token_ids == hf_greedy(hf, second)
    assert engine16.close_session("s1")
    assert_idle(engine16)


def test_abort_mid_prefill_frees_both_pools(engine16, hf, prompts):
    def abort_after_first_chunk(e: Engine, step: int) -> None:
        if step == 1:
            e.abort("victim")

    reqs = [GenerateRequest("victim", prompts["other"], sp()),
            GenerateRequest("kept", prompts["long"], sp())]  # fmt: skip
    out = run(engine16, reqs, abort_after_first_chunk)
    assert len(out["victim"]) < MAX_NEW
    assert out["kept"] == hf_greedy(hf, prompts["long"])


def test_retraction_mid_prefill_recomputes_the_same_text(model_dir, hf, prompts):
    # room for one long prompt and a bit: the second one is retracted mid-prefill
    engine = make_engine(model_dir, 16, kv_tokens=1024, prefill_budget=128)
    reqs = [GenerateRequest("a", prompts["long"], sp()),
            GenerateRequest("b", prompts["other"], sp())]  # fmt: skip
    out = run(engine, reqs)
    assert engine.scheduler.num_retracted > 0
    assert out["a"] == hf_greedy(hf, prompts["long"])
    assert out["b"] == hf_greedy(hf, prompts["other"])
