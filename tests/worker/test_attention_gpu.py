"""GPU attention backends (Triton kernel, flashinfer) against the torch reference on CUDA.

Skipped without CUDA, and each backend is skipped when its package is missing.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mem_cache.kv_pool import KVPool
from worker.attention.base import AttentionBatch
from worker.attention.registry import make_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPES = [
    [(37, 37)],  # plain prefill
    [(1, 300)],  # one decode step over a long prefix
    [(1, 5), (1, 129), (1, 64), (1, 1)],  # a decode batch
    [(50, 50), (1, 77), (20, 140), (1, 3), (65, 65), (7, 200)],  # mixed, chunked prefills
]


def backend_or_skip(name: str):
    package = {"triton": "triton", "flashinfer": "flashinfer"}[name]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")
    return make_attention(name)


def random_batch(shapes, heads: int, kv_heads: int, head_dim: int, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    size = sum(kv for _, kv in shapes) + 64
    pool = KVPool(size, 2, kv_heads, head_dim, dtype=dtype, device="cuda")
    for layer in range(2):  # random prefixes everywhere, scattered slots
        pool.k_buffer[layer].copy_(torch.randn(pool.k_buffer[layer].shape, generator=gen))
        pool.v_buffer[layer].copy_(torch.randn(pool.v_buffer[layer].shape, generator=gen))
    perm = torch.randperm(size, generator=gen)
    used, kv_slots, slot_mapping = 0, [], []
    for q_len, kv_len in shapes:
        kv_slots.append(perm[used : used + kv_len].cuda())
        slot_mapping.append(kv_slots[-1][kv_len - q_len :])
        used += kv_len
    t = sum(q for q, _ in shapes)
    q = torch.randn(t, heads, head_dim, generator=gen).to("cuda", dtype)
    k = torch.randn(t, kv_heads, head_dim, generator=gen).to("cuda", dtype)
    v = torch.randn(t, kv_heads, head_dim, generator=gen).to("cuda", dtype)
    batch = AttentionBatch(
        [q for q, _ in shapes], [kv for _, kv in shapes], torch.cat(slot_mapping), kv_slots
    )
    return pool, batch, q, k, v


def fresh(batch: AttentionBatch) -> AttentionBatch:
    return AttentionBatch(batch.q_lens, batch.kv_lens, batch.slot_mapping, batch.kv_slots)


@pytest.mark.parametrize("name", ["triton", "flashinfer"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (4, 4, 128), (16, 2, 128)])
@pytest.mark.parametrize("shapes", SHAPES)
def test_gpu_backend_matches_torch(name, dtype, heads, kv_heads, head_dim, shapes):
    backend = backend_or_skip(name)
    pool, batch, q, k, v = random_batch(shapes, heads, kv_heads, head_dim, dtype)
    ref_pool, _, _, _, _ = random_batch(shapes, heads, kv_heads, head_dim, dtype)
    for layer in (0, 1):  # two layers share one plan per batch
        ref = make_attention("torch").forward(q, k, v, layer, fresh(batch), ref_pool)
        out = backend.forward(q, k, v, layer, batch, pool)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        for buf, ref_buf in (
            (pool.k_buffer, ref_pool.k_buffer),
            (pool.v_buffer, ref_pool.v_buffer),
        ):
            assert torch.equal(buf[layer], ref_buf[layer])


def test_triton_odd_head_dim_and_fp32():
    backend = backend_or_skip("triton")
    shapes = [(9, 40), (1, 33), (30, 30)]
    pool, batch, q, k, v = random_batch(shapes, 6, 3, 80, torch.float32, seed=3)
    ref_pool, _, _, _, _ = random_batch(shapes, 6, 3, 80, torch.float32, seed=3)
    ref = make_attention("torch").forward(q, k, v, 0, fresh(batch), ref_pool)
    out = backend.forward(q, k, v, 0, batch, pool)
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)  # tf32 dots


@pytest.mark.parametrize("name", ["triton", "flashinfer"])
def test_small_model_logits_match_torch_backend(name, tmp_path):
    backend_or_skip(name)
    from worker.loader import load_model
    from worker.loader.builtin import generate

    generate("small", tmp_path)  # head_dim 64: flashinfer has no kernels for tiny's 16
    models = {a: load_model(tmp_path, "cuda", torch.bfloat16, attention=a) for a in ("torch", name)}
    cfg = models["torch"].config
    prompt = list(range(10, 90))
    n = len(prompt)
    logits = {}
    for attn, model in models.items():
        pool = KVPool(256, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cuda")
        slots = torch.arange(n, device="cuda")
        batch = AttentionBatch([n], [n], slots, [slots])
        ids, pos = torch.tensor(prompt, device="cuda"), torch.arange(n, device="cuda")
        logits[attn] = model(ids, pos, batch, pool, [n - 1])
    ref, out = logits["torch"], logits[name]
    # bf16 through six layers: compare relative to the logits' scale, and the top token.
    assert (out - ref).abs().max() <= 0.05 * ref.abs().max()
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
