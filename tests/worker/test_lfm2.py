"""The recurrent hybrid `tiny-lfm2` (LFM2: short convolutions and attention, random weights):
greedy output identical to transformers' `Lfm2ForCausalLM` on the same directory.

Chunked prefill carries each request's convolution state across chunks; a session's next turn
resumes from its parked state; an abort and a retraction mid-prefill free the state and the
retracted request recomputes the same text. After every step the integrity check balances the
state slots (free + running + parked + the tree's == all) beside the KV slots. With the
component cache, a prefix hit resumes only where a state was saved (a page-aligned chunk end),
copying it.
"""

from __future__ import annotations

import pytest
import torch

from worker.engine import Engine, EngineConfig
from worker.loader import resolve_model
from worker.offline import run_to_completion
from worker.protocol import GenerateRequest, SamplingParams

transformers = pytest.importorskip("transformers")

MAX_NEW = 12


@pytest.fixture(scope="module")
def hf():
    path = resolve_model("tiny-lfm2")
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randint(4, 1024, (n,), generator=gen).tolist() for n in (3, 40, 300)}


def hf_greedy(hf, prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def engine(page_size: int = 1, **kw) -> Engine:
    cfg = dict(model="tiny-lfm2", page_size=page_size, prefill_budget=64, kv_tokens=2048,
               max_running=4)
    cfg.update(kw)
    return Engine(EngineConfig(**cfg))


def sp() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0)


def run(e: Engine, reqs, after=None) -> dict[str, list[int]]:
    def each(e: Engine, step: int) -> None:
        e.check_integrity()
        if after is not None:
            after(e, step)

    out = run_to_completion(e, reqs, after_step=each)
    e.check_integrity()
    if not e.sessions:  # each slot free or the tree's
        radix = e.memory.radix
        tree = (radix.total_size(1), radix.total_size(0)) if radix is not None else (0, 0)
        assert e.memory.states.allocator.available_size() + tree[0] == e.memory.states.size
        assert e.memory.allocator.available_size() + tree[1] == e.memory.allocator.size
    return {rid: c.token_ids for rid, c in out.items()}


@pytest.mark.parametrize(("page_size", "attention"), [(1, "native"), (16, "torch")])
def test_greedy_matches_transformers_with_chunked_prefill(hf, prompts, page_size, attention):
    e = engine(page_size, attention=attention)
    out = run(e, [GenerateRequest(str(n), p, sp()) for n, p in prompts.items()])
    for n, p in prompts.items():
        assert out[str(n)] == hf_greedy(hf, p), n


def test_session_turn_resumes_from_its_parked_state(hf, prompts):
    e = engine()
    first = prompts[40]
    sess = dict(session_id="s", session_ttl_s=60.0)
    out1 = run(e, [GenerateRequest("t1", first, sp(), **sess)])["t1"]
    second = first + out1 + prompts[3]
    done = run_to_completion(e, [GenerateRequest("t2", second, sp(), **sess)])["t2"]
    assert done.cached_tokens == len(first) + MAX_NEW - 1  # every computed token reused
    assert done.token_ids == hf_greedy(hf, second)
    # a turn that diverges inside the parked tokens cannot resume a state: it recomputes
    third = second[:30] + prompts[3]
    done = run_to_completion(e, [GenerateRequest("t3", third, sp(), **sess)])["t3"]
    assert done.cached_tokens == 0 and done.token_ids == hf_greedy(hf, third)
    assert e.close_session("s")
    run(e, [])


def test_abort_and_retraction_mid_prefill(hf, prompts):
    e = engine(kv_tokens=400, prefill_budget=32)  # room for one 300-token prompt at a time

    def abort_early(e: Engine, step: int) -> None:
        if step == 2:
            e.abort("gone")

    reqs = [GenerateRequest("a", prompts[300], sp()), GenerateRequest("gone", prompts[40], sp()),
            GenerateRequest("b", prompts[300][::-1], sp())]  # fmt: skip
    out = run(e, reqs, abort_early)
    assert e.scheduler.num_retracted > 0
    assert len(out["gone"]) < MAX_NEW
    assert out["a"] == hf_greedy(hf, prompts[300])
    assert out["b"] == hf_greedy(hf, prompts[300][::-1])


def test_prefix_hits_resume_only_at_saved_states(hf):
    e = engine(16)  # page 16, 64-token chunks: each chunk end of a prompt is a checkpoint
    gen = torch.Generator().manual_seed(5)
    shared, a, b, c = (torch.randint(4, 1024, (n,), generator=gen).tolist()
                       for n in (64, 20, 30, 25))  # fmt: skip
    radix = e.memory.radix

    def serve(name: str, prompt: list[int]) -> int:
        done = run_to_completion(e, [GenerateRequest(name, prompt, sp())],
                                 after_step=lambda e, s: e.check_integrity())[name]  # fmt: skip
        e.check_integrity()
        assert done.token_ids == hf_greedy(hf, prompt), name
        return done.cached_tokens

    assert serve("a", shared + a) == 0
    assert serve("b", shared + b) == 64  # the state saved at the end of "a"'s first chunk
    # the full KV of 48 tokens of "c" is in the tree, but no state stands there: recomputed
    m = radix.match_prefix(shared[:50] + c)
    assert m.full_length == 48 and m.length == 0
    assert serve("c", shared[:50] + c) == 0
    assert radix.total_size(1) >= 2  # states the tree holds (group 1), balanced by the check


def test_a_host_tier_is_refused_for_a_hybrid_model_not_ignored():
    # The component cache's host tier is not wired into the engine: asking for one must say so
    # at start rather than serve without it.
    with pytest.raises(ValueError, match="host KV tier"):
        engine(host_kv_tokens=1024)
    assert engine(host_kv_tokens=0).memory.radix is not None
