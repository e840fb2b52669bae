"""The `auto` dtype (vLLM's rule) and a bfloat16 engine against HF transformers in bfloat16.

`auto` serves a float32 checkpoint in bfloat16 where the device computes bf16 natively, as
vLLM does by default. On the real SmolLM2-135M-Instruct weights (`RADIXRAY_SMOLLM2_DIR`, else
skipped) every token a bf16 engine picks for chat prompts, EOS included, is HF bf16's greedy
choice given the same text, up to bf16 noise: its HF logit is within `TIE` of the best one.
Both run the same bf16 weights but round differently (one fused q/k/v and gate/up matmul
here, separate ones in HF; the decode linears and attention in C kernels, see
`worker.kernels.pair_gemm` and `worker.kernels.decode_attention`), so a near-tie between two
logits can flip the argmax and the texts then part: "List three prime numbers." ends after
"3. 3" here and goes on in HF, whose logits put EOS one bf16 step (0.125) below a newline. In
float32 the engine matches HF exactly (test_engine_hf_identity)."""

from __future__ import annotations

import pytest
import torch

from tests.smollm2_env import require_smollm2_dir
from worker.engine import Engine, EngineConfig
from worker.loader.weights import auto_dtype, cpu_has_bf16, resolve_dtype
from worker.offline import run_to_completion
from worker.protocol import GenerateRequest, SamplingParams

NEW_TOKENS = 32  # tokens generated per answer
TIE = 0.25  # logit: two bf16 steps of a logit between 16 and 32
QUESTIONS = [
    "What is the capital of France?",
    "List three prime numbers.",
    "Write a haiku about the sea.",
]


def test_auto_dtype_follows_vllms_rule(monkeypatch):
    import worker.loader.weights as loader

    for has in (True, False):
        monkeypatch.setattr(loader, "cpu_has_bf16", lambda has=has: has)
        want = torch.bfloat16 if has else torch.float32
        assert auto_dtype(torch.float32, "cpu") == want  # float32 downcast where bf16 is native
        assert auto_dtype(torch.float16, "cpu") == torch.float16  # others keep their own
        assert auto_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    assert resolve_dtype("tiny", None, "cpu") is None  # None: the checkpoint's, untouched
    assert resolve_dtype("tiny", "float32", "cpu") == torch.float32  # explicit wins
    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: True)
    assert resolve_dtype("tiny", "auto", "cpu") == torch.bfloat16  # tiny is a float32 checkpoint


def test_auto_engine_runs_in_the_resolved_dtype():
    engine = Engine(EngineConfig(model="tiny", dtype="auto", kv_tokens=256))
    want = torch.bfloat16 if cpu_has_bf16() else torch.float32
    assert engine.model.config.dtype == want
    assert engine.model.embed_tokens.weight.dtype == want


@pytest.fixture(scope="module")
def smollm2_bf16():
    path = require_smollm2_dir()
    transformers = pytest.importorskip("transformers")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    yield str(path), hf, tok
    torch.set_num_threads(before)


def chat(tok, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def test_smollm2_bf16_engine_picks_hfs_bf16_tokens(smollm2_bf16):
    path, hf, tok = smollm2_bf16
    prompts = [chat(tok, q) for q in QUESTIONS]
    engine = Engine(EngineConfig(model=path, dtype="bfloat16", kv_tokens=4096))
    assert engine.model.config.dtype == torch.bfloat16
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    reqs = [GenerateRequest(f"q{i}", p, sp) for i, p in enumerate(prompts)]
    out = run_to_completion(engine, reqs, after_step=lambda e, s: e.check_integrity())
    pairs = zip(reqs, prompts, strict=True)
    exact = sum(hf_gap_ok(hf, tok, p, out[r.request_id].token_ids) for r, p in pairs)
    assert exact >= 1  # a near-tie is the exception: most answers are HF's token for token
    assert "Paris" in tok.decode(out[reqs[0].request_id].token_ids)
    assert_idle(engine)


def test_smollm2_bf16_long_prompt_and_a_cached_prefix_pick_hfs_tokens(smollm2_bf16):
    """A prompt over 2k tokens (prefilled in chunks, each over the ones before), then two
    questions behind it as a cached prefix, in one batch with a short prompt."""
    path, hf, tok = smollm2_bf16
    facts = " ".join(f"Item {i} is a {('red', 'blue')[i % 2]} box." for i in range(240))
    long = chat(tok, facts + " What color is item 7?")
    assert len(long) > 2000
    engine = Engine(EngineConfig(model=path, dtype="bfloat16", kv_tokens=8192))
    sp = SamplingParams(max_tokens=12, temperature=0.0)
    first = GenerateRequest("long", long, sp)
    out = run_to_completion(engine, [first], after_step=lambda e, s: e.check_integrity())
    prompts = [chat(tok, facts + q) for q in (" What color is item 8?", " How many items?")]
    prompts.append(chat(tok, QUESTIONS[0]))
    reqs = [GenerateRequest(f"q{i}", p, sp) for i, p in enumerate(prompts)]
    out |= run_to_completion(engine, reqs, after_step=lambda e, s: e.check_integrity())
    assert min(out[r.request_id].cached_tokens for r in reqs[:2]) > 2000  # the long prefix
    for req, prompt in zip([first, *reqs], [long, *prompts], strict=True):
        hf_gap_ok(hf, tok, prompt, out[req.request_id].token_ids)
    assert_idle(engine)


def hf_gap_ok(hf, tok, prompt: list[int], got: list[int]) -> bool:
    """Asserts every token of `got` is HF's greedy pick after `prompt` up to `TIE`; returns
    whether all were exactly HF's."""
    assert got
    with torch.inference_mode():  # HF's logits for each position of the engine's text
        ids = torch.tensor([prompt + got[:-1]])
        logits = hf(ids).logits[0, len(prompt) - 1 :].float()
    picked = logits.gather(1, torch.tensor(got)[:, None])[:, 0]
    gap = logits.max(-1).values - picked
    assert float(gap.max()) <= TIE, (tok.decode(got), gap.tolist())
    return bool((gap == 0).all())


def assert_idle(engine: Engine) -> None:
    s = engine.stats()
    assert s.running == s.waiting == s.kv_protected == 0
    assert s.kv_free + s.kv_evictable == s.kv_total
