"""The engine on a plain HF model directory produces what HF transformers `generate` does."""

from __future__ import annotations

import random

import pytest
import torch
from engine_kit import make

from worker.offline import run_to_completion
from worker.protocol import GenerateRequest, SamplingParams

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    """A random Qwen2 (GQA, QKV bias) saved as a real HF directory."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=299,
        bos_token_id=1,
    )
    model = transformers.Qwen2ForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path)
    return str(path)


def test_greedy_outputs_match_hf_generate_through_cache_and_batching(hf_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    rng = random.Random(0)
    shared = [rng.randrange(2, 299) for _ in range(24)]
    prompts = [shared + [rng.randrange(2, 299) for _ in range(8 + 3 * i)] for i in range(3)]
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=10,
                min_new_tokens=10,
                do_sample=False,
                pad_token_id=0,
            )
        expected.append(out[0, len(p) :].tolist())
    # engine_kit's device and backend: the CPU here, CUDA + Triton (+ graphs) on the GPU machine
    engine = make(model=hf_dir, dtype="float32", kv_tokens=1024, prefill_budget=16)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for rnd in range(2):  # the second round hits the cache
        reqs = [GenerateRequest(f"{rnd}-{i}", p, sp) for i, p in enumerate(prompts)]
        out = run_to_completion(engine, reqs, after_step=lambda e, s: e.check_integrity())
        assert [out[r.request_id].token_ids for r in reqs] == expected
    assert engine.stats().kv_free + engine.stats().kv_evictable == 1024
