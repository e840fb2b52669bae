"""Loading HF model directories: shards, tied embeddings, config keys old and new, dtypes."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from mem_cache.kv_pool import KVPool
from worker.attention.base import AttentionBatch
from worker.loader import load_model
from worker.models import ModelConfig

SHAPE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def save_llama(path, dtype=torch.float32, shard: str | None = None, **overrides):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**SHAPE, **overrides})
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.2)
    model = model.to(dtype)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return model


def prefill_logits(model, tokens: list[int]) -> torch.Tensor:
    cfg, n = model.config, len(tokens)
    pool = KVPool(n, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype=cfg.dtype)
    batch = AttentionBatch([n], [n], torch.arange(n), [torch.arange(n)])
    return model(torch.tensor(tokens), torch.arange(n), batch, pool, list(range(n)))


TOKENS = [5, 17, 3, 80, 41, 41, 9, 60]


def test_sharded_checkpoint_loads(tmp_path):
    hf = save_llama(tmp_path, shard="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    with torch.no_grad():
        ref = hf(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(prefill_logits(load_model(tmp_path), TOKENS), ref)


def test_pytorch_bin_checkpoint_loads(tmp_path):
    hf = save_llama(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    torch.save(weights, tmp_path / "pytorch_model.bin")
    with torch.no_grad():
        ref = hf(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(prefill_logits(load_model(tmp_path), TOKENS), ref)


def test_tied_embeddings_share_one_tensor(tmp_path):
    hf = save_llama(tmp_path, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    model = load_model(tmp_path)
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        ref = hf(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(prefill_logits(model, TOKENS), ref)


def test_bf16_checkpoint_keeps_its_dtype_or_casts(tmp_path):
    save_llama(tmp_path, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    native = load_model(tmp_path)
    assert native.config.dtype == torch.bfloat16
    assert native.embed_tokens.weight.dtype == torch.bfloat16
    as_fp32 = load_model(tmp_path, dtype=torch.float32)
    assert as_fp32.embed_tokens.weight.dtype == torch.float32
    # Reloaded rather than cast: casting to bf16 also rounded HF's RoPE frequency buffer.
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(prefill_logits(as_fp32, TOKENS), ref)
    logits = prefill_logits(native, TOKENS)
    assert logits.dtype == torch.float32
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


def test_transformers4_and_5_config_keys_agree():
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    base = {**SHAPE, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    old = {**base, "torch_dtype": "bfloat16", "rope_theta": 500000.0, "rope_scaling": rope}
    new = {**base, "dtype": "bfloat16", "rope_parameters": {**rope, "rope_theta": 500000.0}}
    old_cfg, new_cfg = ModelConfig.from_hf(old, "m"), ModelConfig.from_hf(new, "m")
    assert old_cfg == new_cfg
    assert new_cfg.dtype == torch.bfloat16 and new_cfg.rope_theta == 500000.0
    assert new_cfg.rope_scaling["original_max_position_embeddings"] == 256
    legacy_type = {**base, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert ModelConfig.from_hf(legacy_type, "m").rope_scaling == {
        "rope_type": "linear",
        "factor": 2.0,
    }


def test_rope_types():
    base = {**SHAPE, "architectures": ["LlamaForCausalLM"]}
    dynamic = {**base, "rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}
    dynamic["rope_parameters"]["original_max_position_embeddings"] = 128
    cfg = ModelConfig.from_hf(dynamic, "m")
    assert cfg.rope_scaling is None and cfg.max_context == 128  # exact only up to there
    with pytest.raises(ValueError, match="rope"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "longrope"}}, "m")


def test_config_details(tmp_path):
    save_llama(tmp_path, eos_token_id=2)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.eos_token_ids == [2, 7]
    assert cfg.name == tmp_path.name and cfg.max_context == 256 and cfg.head_dim == 8
    mistral = {**SHAPE, "architectures": ["MistralForCausalLM"], "sliding_window": 64}
    assert ModelConfig.from_hf(mistral, "m").max_context == 64  # full attention only up to it
    qwen2 = {**SHAPE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 64}
    qwen2_cfg = ModelConfig.from_hf(qwen2, "m")
    assert qwen2_cfg.max_context == 256 and qwen2_cfg.qkv_bias and not qwen2_cfg.o_bias


def test_unsupported_architecture_and_missing_tensor_are_errors(tmp_path):
    with pytest.raises(ValueError, match="unsupported model"):
        ModelConfig.from_hf({**SHAPE, "architectures": ["GPT2LMHeadModel"]}, "m")
    save_llama(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="lacks"):
        load_model(tmp_path)


def test_missing_model_is_a_value_error(tmp_path):
    with pytest.raises(ValueError):
        load_model(tmp_path / "nowhere")
