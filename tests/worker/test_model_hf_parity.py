"""Our decoder on the paged KV pool gives HF transformers' logits on the same random weights.

Each family (Llama with RoPE scaling, Qwen2 with qkv bias, Qwen3 with q/k norm, Mistral) is
saved by transformers into a temporary directory, loaded by our loader, and compared at
prefill, at a prefill over a cached prefix (a chunk), over several decode steps whose KV lives
at scattered slots, and inside a mixed batch of several sequences.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from mem_cache.kv_pool import KVPool
from worker.attention.base import AttentionBatch
from worker.loader import load_model
from worker.models import CausalLM, llama

SHAPE = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
}  # fmt: skip
CONFIGS = {
    "llama3_rope": lambda: transformers.LlamaConfig(**SHAPE, rope_parameters=LLAMA3_ROPE),
    "llama_linear_rope": lambda: transformers.LlamaConfig(
        **SHAPE, rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}
    ),
    "llama_yarn_rope": lambda: transformers.LlamaConfig(
        **SHAPE,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    ),  # fmt: skip
    "llama_dynamic_rope": lambda: transformers.LlamaConfig(
        **SHAPE, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    ),
    "llama_biases": lambda: transformers.LlamaConfig(**SHAPE, attention_bias=True, mlp_bias=True),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, head_dim=24),
    "mistral": lambda: transformers.MistralConfig(**SHAPE, sliding_window=None),
}


def save_random_model(config, path) -> transformers.PreTrainedModel:
    """A transformers model with weights large enough that mistakes show in the logits."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.15)
    model.save_pretrained(path)
    return model


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def run(model: CausalLM, pool: KVPool, seqs: list[tuple[list[int], torch.Tensor, int]]):
    """One forward: per sequence (all its tokens so far, their slots, how many are new)."""
    ids, positions, slot_mapping, logits_rows = [], [], [], []
    for tokens, slots, q_len in seqs:
        start = len(tokens) - q_len
        ids += tokens[start:]
        positions += range(start, len(tokens))
        slot_mapping.append(slots[start : len(tokens)])
        logits_rows += range(len(logits_rows), len(logits_rows) + q_len)
    batch = AttentionBatch(
        q_lens=[q for _, _, q in seqs],
        kv_lens=[len(t) for t, _, _ in seqs],
        slot_mapping=torch.cat(slot_mapping),
        kv_slots=[s[: len(t)] for t, s, _ in seqs],
    )
    return model(torch.tensor(ids), torch.tensor(positions), batch, pool, logits_rows)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_logits_match_transformers(family, tmp_path):
    hf = save_random_model(CONFIGS[family](), tmp_path)
    ours = load_model(tmp_path)
    cfg = ours.config
    pool = KVPool(512, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(512, generator=gen)  # scattered slots: the pool is really paged
    tokens = torch.randint(0, cfg.vocab_size, (60,), generator=gen).tolist()
    ref = hf_logits(hf, tokens)
    tol = dict(atol=2e-4, rtol=2e-4)

    # Prefill 40 tokens: 30 first, then a chunk of 10 over the cached 30.
    torch.testing.assert_close(run(ours, pool, [(tokens[:30], slots, 30)]), ref[:30], **tol)
    torch.testing.assert_close(run(ours, pool, [(tokens[:40], slots, 10)]), ref[30:40], **tol)
    for n in range(41, 46):  # decode steps
        torch.testing.assert_close(run(ours, pool, [(tokens[:n], slots, 1)]), ref[n - 1 : n], **tol)

    # A mixed batch: this sequence decodes while another one prefills at other slots.
    other = torch.randint(0, cfg.vocab_size, (12,), generator=gen).tolist()
    out = run(ours, pool, [(tokens[:46], slots, 1), (other, slots[100:], 12)])
    torch.testing.assert_close(out[:1], ref[45:46], **tol)
    torch.testing.assert_close(out[1:], hf_logits(hf, other), **tol)


def test_logits_rows_select_rows_and_the_last_layer_runs_for_them_alone(tmp_path):
    save_random_model(CONFIGS["qwen3"](), tmp_path)
    model = load_model(tmp_path)
    cfg = model.config
    rows_seen = []  # rows through each layer's MLP, in layer order

    def post(x, *args):
        rows_seen.append(x.shape[0])
        return llama.post_attention(x, *args)

    model.kernels = llama.LayerKernels(llama.pre_attention, post)
    # two sequences: 5 new tokens over 3 cached at slots 0-7, and 3 new tokens at 20-22
    tokens, positions = torch.arange(8), torch.tensor([3, 4, 5, 6, 7, 0, 1, 2])

    def batch() -> AttentionBatch:
        return AttentionBatch(
            [5, 3], [8, 3], torch.tensor([3, 4, 5, 6, 7, 20, 21, 22]),
            [torch.arange(8), torch.arange(20, 23)],
        )  # fmt: skip

    def forward(rows):
        pool = KVPool(64, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        gen = torch.Generator().manual_seed(0)  # the cached prefix: the same random K/V
        for layer in range(cfg.num_layers):
            shape = (3, cfg.num_kv_heads, cfg.head_dim)
            pool.set_kv(layer, torch.arange(3), torch.randn(shape, generator=gen),
                        torch.randn(shape, generator=gen))  # fmt: skip
        rows_seen.clear()
        return model(tokens, positions, batch(), pool, rows), pool, list(rows_seen)

    full, full_pool, seen = forward(None)
    assert seen == [8, 8]
    some, pool, seen = forward([7, 2, 4])  # any rows, in any order
    assert seen == [8, 3]  # the last layer's MLP ran for the 3 rows alone
    assert some.dtype == torch.float32 and some.shape == (3, cfg.vocab_size)
    torch.testing.assert_close(some, full[[7, 2, 4]])
    some -= 1.0  # samplers edit logits in place: they must not be inference tensors
    every, _, seen = forward([7, 6, 5, 4, 3, 2, 1, 0])  # every row, in another order
    torch.testing.assert_close(every, full.flip(0))
    none, none_pool, seen = forward([])  # a prefill chunk that samples nothing
    assert none.shape == (0, cfg.vocab_size) and seen == [8]
    for other in (pool, none_pool):  # every token's K/V, in every layer, as the full pass's
        for layer in range(cfg.num_layers):
            assert torch.equal(other.k_buffer[layer], full_pool.k_buffer[layer])
            assert torch.equal(other.v_buffer[layer], full_pool.v_buffer[layer])
