"""Greedy output identical to HF transformers `generate`, on every engine code path.

Paths: the `native` attention backend (the default) and the `torch` reference, eager and
compiled layers, page sizes 1 and 16; workloads: a batch of mixed lengths, a cached prefix
(a second round of the same prompts), chunked prefill. On the built-in `tiny` model always;
on the real SmolLM2-135M-Instruct weights (chat prompts, a prompt over 2k tokens) when
`RADIXRAY_SMOLLM2_DIR` names its HF directory, else those tests skip.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from worker.engine import Engine, EngineConfig
from worker.loader import resolve_model
from worker.offline import run_to_completion
from worker.protocol import GenerateRequest, SamplingParams

transformers = pytest.importorskip("transformers")

SMOLLM2_ENV = "RADIXRAY_SMOLLM2_DIR"


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def hf_greedy(model, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Each prompt alone through HF `generate`, greedy, exactly `max_new` tokens."""
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.inference_mode():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
        out.append(gen[0, len(p) :].tolist())
    return out


def engine_greedy(engine: Engine, prompts: list[list[int]], max_new: int, tag: str):
    # min_tokens bans EOS until max_tokens, as HF's min_new_tokens does
    sp = SamplingParams(max_tokens=max_new, min_tokens=max_new, temperature=0.0)
    reqs = [GenerateRequest(f"{tag}-{i}", p, sp) for i, p in enumerate(prompts)]
    out = run_to_completion(engine, reqs, after_step=lambda e, s: e.check_integrity())
    s = engine.stats()
    assert s.running == s.waiting == s.kv_protected == 0
    assert s.kv_free + s.kv_evictable == s.kv_total  # nothing leaked
    return [out[r.request_id] for r in reqs]


# --- built-in model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_case():
    """Prompts of mixed lengths sharing a 40-token head, and HF's greedy continuations."""
    rng = random.Random(5)
    head = [rng.randrange(3, 1000) for _ in range(40)]
    prompts = [head + [rng.randrange(3, 1000) for _ in range(n)] for n in (3, 29, 70, 11)]
    prompts.append([rng.randrange(3, 1000) for _ in range(57)])
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        resolve_model("tiny"), dtype=torch.float32
    ).eval()
    return prompts, hf_greedy(hf, prompts, 12)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("attention", ["native", "torch"])
@pytest.mark.parametrize("budget", [24, 4096])
def test_tiny_matches_hf_on_every_path(tiny_case, page_size, attention, budget):
    prompts, expected = tiny_case
    config = EngineConfig(
        model="tiny", dtype="float32", kv_tokens=4096, page_size=page_size, attention=attention,
        prefill_budget=budget,
    )  # fmt: skip
    engine = Engine(config)
    for rnd in range(2):  # the second round runs over cached prefixes
        out = engine_greedy(engine, prompts, 12, f"r{rnd}")
        assert [c.token_ids for c in out] == expected
        if rnd == 1:
            assert all(c.cached_tokens > 0 for c in out)


def test_tiny_compiled_matches_hf(tiny_case):
    prompts, expected = tiny_case
    config = EngineConfig(model="tiny", dtype="float32", kv_tokens=4096, page_size=16, compile=True)
    engine = Engine(config)
    for rnd in range(2):
        assert [c.token_ids for c in engine_greedy(engine, prompts, 12, f"c{rnd}")] == expected
    assert all(k.active for k in engine.model.kernels)  # compiled for real, no fallback


def test_compile_failure_falls_back_to_eager(tiny_case, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: broken)
    prompts, expected = tiny_case
    engine = Engine(EngineConfig(model="tiny", dtype="float32", kv_tokens=4096, compile=True))
    assert [c.token_ids for c in engine_greedy(engine, prompts, 12, "f")] == expected
    assert not any(k.active for k in engine.model.kernels)
    assert "running it eagerly" in caplog.text


# --- SmolLM2-135M-Instruct -----------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    """(model dir, HF model, tokenizer), or skip when the real weights are not available."""
    path = os.environ.get(SMOLLM2_ENV)
    if not path:
        pytest.skip(f"real-model test: set {SMOLLM2_ENV} to a SmolLM2-135M-Instruct HF directory")
    if not (Path(path) / "config.json").exists():
        pytest.skip(f"{SMOLLM2_ENV}={path} holds no config.json")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return path, hf, tok


def chat(tok, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a hash table is in one sentence.",
]


@pytest.mark.parametrize("page_size", [1, 16])
def test_smollm2_chat_batch_and_cached_prefix_match_hf(smollm2, page_size):
    path, hf, tok = smollm2
    prompts = [chat(tok, q) for q in QUESTIONS]
    expected = hf_greedy(hf, prompts, 24)
    paris = tok.decode(expected[0])
    assert "Paris" in paris, paris
    engine = Engine(
        EngineConfig(
            model=path, dtype="float32", kv_tokens=8192, page_size=page_size, prefill_budget=64,
        )
    )  # fmt: skip
    for rnd in range(2):  # mixed lengths in one batch; then again over cached prefixes
        out = engine_greedy(engine, prompts, 24, f"chat{rnd}")
        assert [c.token_ids for c in out] == expected


def test_smollm2_long_prompt_over_a_cached_prefix_matches_hf(smollm2):
    """A prompt over 2k tokens, chunked; then a second prompt sharing its first 2k tokens
    prefills only its tail, over the cached prefix."""
    path, hf, tok = smollm2
    text = " ".join(f"Item {i} is {['red', 'green', 'blue'][i % 3]}." for i in range(330))
    long = chat(tok, text + " Which colour is item 7?")
    assert len(long) > 2048
    other = long[:2048] + chat(tok, "Which colour is item 11?")[-20:]
    expected = hf_greedy(hf, [long, other], 8)
    engine = Engine(
        EngineConfig(
            model=path, dtype="float32", kv_tokens=8192, page_size=16, prefill_budget=512,
        )
    )  # fmt: skip
    first = engine_greedy(engine, [long], 8, "long")[0]
    second = engine_greedy(engine, [other], 8, "other")[0]
    assert [first.token_ids, second.token_ids] == expected
    assert second.cached_tokens >= 2032


def test_smollm2_batch_over_a_shared_system_prompt_matches_hf(smollm2, monkeypatch):
    """Requests behind one long system prompt decode together over its cached KV (the
    native backend's cascade path: the shared prefix attended once per group)."""
    import worker.attention.native as native

    groups = []

    def spy(table, kv_lens):
        found = shared_prefixes(table, kv_lens)
        groups.extend(len(members) for members, _ in found)
        return found

    shared_prefixes = native._shared_prefixes
    monkeypatch.setattr(native, "_shared_prefixes", spy)
    path, hf, tok = smollm2
    system = " ".join(f"Rule {i}: answer briefly and politely." for i in range(30))

    def ask(text: str) -> list[int]:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": text}]
        return tok.encode(
            tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )

    prompts = [ask(q) for q in QUESTIONS]
    expected = hf_greedy(hf, prompts, 16)
    engine = Engine(EngineConfig(model=path, dtype="float32", kv_tokens=8192, page_size=16))
    for rnd in range(2):
        out = engine_greedy(engine, prompts, 16, f"sys{rnd}")
        assert [c.token_ids for c in out] == expected
    assert max(groups) == len(QUESTIONS)  # all four decoded over one shared prefix
