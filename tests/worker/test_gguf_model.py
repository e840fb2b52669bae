"""A GGUF file as the model: greedy text identical to HF transformers loading the same GGUF, and
the tokenizer and chat template HF makes of it. Needs the real SmolLM2 GGUF (tests/smollm2_env.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.smollm2_env import require_smollm2_gguf
from worker.engine import Engine, EngineConfig
from worker.kernels.cache_dir import cache_root
from worker.loader.builtin import resolve_model
from worker.offline import run_to_completion
from worker.protocol import GenerateRequest, SamplingParams

transformers = pytest.importorskip("transformers")

SYSTEM = {"role": "system", "content": "You are a concise assistant. Answer in one sentence."}
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [SYSTEM, {"role": "user", "content": "Why is the sky blue?"}],
    [SYSTEM, {"role": "user", "content": "Name three primary colors."},
     {"role": "assistant", "content": "Red, blue and yellow."},
     {"role": "user", "content": "And which colors do they make when mixed?"}],
    [SYSTEM, {"role": "user", "content": "Écris une phrase sur la mer. 🌊"}],
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """The GGUF alone in a folder: transformers would read tokenizer files beside it."""
    alone = tmp_path_factory.mktemp("gguf") / "model.gguf"
    alone.symlink_to(require_smollm2_gguf().resolve())
    return alone


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_file):
    return transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def engine_on_gguf(gguf_file, tmp_path_factory):
    """Our engine given the .gguf path itself, converted into a fresh cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXRAY_CACHE", str(tmp_path_factory.mktemp("cache")))
        before = torch.get_num_threads()
        torch.set_num_threads(1)  # a few CI cores shared with other work: one thread is faster
        engine = Engine(EngineConfig(
            model=str(gguf_file), dtype="float32", kv_tokens=4096, prefill_budget=64
        ))
        converted = resolve_model(str(gguf_file))  # the cached conversion: no second convert
        assert converted.parent == cache_root() / "gguf"
        yield engine, converted
        torch.set_num_threads(before)


def _chat_ids(tokenizer, chat: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _hf_greedy(gguf_file, prompts: list[list[int]], eos: int) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32).eval()
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.inference_mode():
            gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos)
        out.append(gen[0, len(ids):].tolist())
    return out


def _strip_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos)] if eos in ids else ids


def test_gguf_model_greedy_text_is_hf_transformers_on_the_same_gguf(
    gguf_file, hf_tokenizer, engine_on_gguf
):
    engine, _ = engine_on_gguf
    eos = hf_tokenizer.eos_token_id
    prompts = [_chat_ids(hf_tokenizer, chat) for chat in CHATS]
    expected = [_strip_eos(ids, eos) for ids in _hf_greedy(gguf_file, prompts, eos)]
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    for rnd in range(2):  # all four at once (mixed lengths); the second round over cached prefixes
        reqs = [GenerateRequest(f"{rnd}-{i}", p, sp) for i, p in enumerate(prompts)]
        out = run_to_completion(engine, reqs, after_step=lambda e, s: e.check_integrity())
        got = [_strip_eos(out[r.request_id].token_ids, eos) for r in reqs]
        assert got == expected, f"round {rnd}"
    assert "Paris" in hf_tokenizer.decode(expected[0])
    stats = engine.stats()
    assert stats.kv_free + stats.kv_evictable == 4096  # nothing leaked


def test_gguf_tokenizer_and_chat_template_are_hfs(hf_tokenizer, engine_on_gguf):
    from router.tokenizer import Tokenizer

    _, converted = engine_on_gguf
    ours = Tokenizer(converted)  # what the router loads from the converted directory
    assert ours.hf.chat_template == hf_tokenizer.chat_template
    assert ours.eos_token_ids == [hf_tokenizer.eos_token_id]
    for chat in CHATS:
        assert ours.apply_chat(chat) == _chat_ids(hf_tokenizer, chat)
    text = "Grüße, 東京! <|im_start|> tabs\tand  spaces 🌊 1234567"
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert ours.encode_plain(text) == ids
    assert ours.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)
