"""Built-in models: deterministic files, safe concurrent creation, a usable tokenizer and chat
template, loadable by our loader and by transformers with the same logits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from mem_cache.kv_pool import KVPool
from worker.attention.base import AttentionBatch
from worker.loader import builtin_model_path, load_model, resolve_model
from worker.loader.builtin import BUILTIN_MODELS, generate


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    generate("tiny", path)
    return path


def test_generation_is_deterministic(tiny_dir, tmp_path):
    generate("tiny", tmp_path)
    names = sorted(p.name for p in tiny_dir.iterdir())
    assert names == sorted(p.name for p in tmp_path.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
        names
    )
    for name in names:
        assert (tiny_dir / name).read_bytes() == (tmp_path / name).read_bytes(), name


def test_concurrent_processes_create_it_once(tmp_path):
    code = "from worker.loader import builtin_model_path; print(builtin_model_path('tiny'))"
    env = {**os.environ, "RADIXRAY_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs == [str(tmp_path / "tiny-v1")] * 3
    visible = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock"))
    assert visible == ["tiny-v1"]  # no temporary folder left behind


def test_resolve_model(tmp_path, monkeypatch, tiny_dir):
    monkeypatch.setenv("RADIXRAY_CACHE", str(tmp_path))
    assert resolve_model(str(tiny_dir)) == tiny_dir
    assert resolve_model("tiny") == builtin_model_path("tiny") == tmp_path / "tiny-v1"
    with pytest.raises(ValueError):
        resolve_model("no-such-model")
    with pytest.raises(ValueError):
        builtin_model_path("huge")


def test_tokenizer_round_trip_and_special_tokens(tiny_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    assert len(tok) == BUILTIN_MODELS["tiny"].vocab_size
    for text in ["The cat runs quickly.", "def f(x):\n    return x + 1\n", "naïve café 東京 🚀"]:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
    for special in ["<|begin_of_text|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]:
        assert len(tok(special)["input_ids"]) == 1
    assert tok.eos_token == "<|im_end|>"


def test_chat_template(tiny_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Add one."}]},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "2"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nAdd one.<|im_end|>\n"
        '<|im_start|>assistant\n\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>tool\n2<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    tools = [{"type": "function", "function": {"name": n, "parameters": {}}} for n in "ab"]
    with_tools = tok.apply_chat_template(messages[:2], tools=tools, tokenize=False)
    assert with_tools.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n{")
    assert with_tools.count("\n{") == 2  # one tool per line
    assert with_tools.count("<|im_start|>system") == 1
    assert not with_tools.endswith("<|im_start|>assistant\n")


def greedy(model, prompt: list[int], steps: int) -> list[int]:
    cfg = model.config
    pool = KVPool(len(prompt) + steps, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    tokens, q_len = list(prompt), len(prompt)
    for _ in range(steps):
        n = len(tokens)
        batch = AttentionBatch([q_len], [n], torch.arange(n - q_len, n), [torch.arange(n)])
        ids, positions = torch.tensor(tokens[n - q_len :]), torch.arange(n - q_len, n)
        logits = model(ids, positions, batch, pool, [q_len - 1])
        tokens.append(int(logits.argmax(-1)))
        q_len = 1
    return tokens[len(prompt) :]


def test_loads_in_transformers_with_the_same_logits_and_varied_output(tiny_dir):
    ours = load_model(tiny_dir)
    assert ours.config.name == "tiny" and ours.config.max_context == 8192
    assert ours.config.num_kv_heads < ours.config.num_heads  # GQA
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Tell me about the river."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt = tok(text)["input_ids"]
    out = greedy(ours, prompt, 24)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
    assert ref[0, len(prompt) :].tolist() == out
    assert len(set(out)) >= 8, out  # random weights, but not stuck on one token


def test_small_is_bigger_and_loads(tmp_path):
    spec = BUILTIN_MODELS["small"]
    assert spec.max_context >= 16384 and spec.hidden_size >= 256 and spec.num_layers >= 6
    generate("small", tmp_path)
    model = load_model(tmp_path)
    assert model.config.vocab_size == spec.vocab_size
    assert len(greedy(model, [5, 6, 7], 2)) == 2
