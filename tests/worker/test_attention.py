"""The torch attention backend against a naive per-sequence softmax over the same KV."""

from __future__ import annotations

import math

import pytest
import torch

from mem_cache.kv_pool import KVPool
from worker.attention.base import AttentionBatch
from worker.attention.registry import make_attention
from worker.attention.torch_ref import TorchAttention

H, KVH, D = 4, 2, 8


def naive_attention(q, k_all, v_all, q_len: int, kv_len: int) -> torch.Tensor:
    """q [q_len, H, D] over k/v [kv_len, KVH, D]; query i sees keys 0 .. kv_len - q_len + i."""
    rep = H // KVH
    k = k_all.repeat_interleave(rep, dim=1)
    v = v_all.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
    q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    scores = scores.masked_fill(torch.arange(kv_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_batch(shapes: list[tuple[int, int]], pool: KVPool, gen: torch.Generator):
    """Fill each sequence's cached prefix in the pool at scattered slots; return the batch,
    the new q/k/v and, per sequence, its full K/V for the reference."""
    perm = torch.randperm(pool.size, generator=gen)
    used, kv_slots, slot_mapping, full = 0, [], [], []
    qs, ks, vs = [], [], []
    for q_len, kv_len in shapes:
        slots = perm[used : used + kv_len]
        used += kv_len
        k = torch.randn(kv_len, KVH, D, generator=gen)
        v = torch.randn(kv_len, KVH, D, generator=gen)
        prefix = kv_len - q_len
        pool.set_kv(0, slots[:prefix], k[:prefix], v[:prefix])
        kv_slots.append(slots)
        slot_mapping.append(slots[prefix:])
        qs.append(torch.randn(q_len, H, D, generator=gen))
        ks.append(k[prefix:])
        vs.append(v[prefix:])
        full.append((k, v))
    batch = AttentionBatch(
        q_lens=[s[0] for s in shapes],
        kv_lens=[s[1] for s in shapes],
        slot_mapping=torch.cat(slot_mapping),
        kv_slots=kv_slots,
    )
    return batch, torch.cat(qs), torch.cat(ks), torch.cat(vs), full


@pytest.mark.parametrize(
    "shapes",
    [
        [(7, 7)],  # plain causal prefill
        [(5, 12)],  # prefill after a cached prefix: mask aligned to the end
        [(1, 9)],  # one decode step
        [(1, 3), (1, 17), (1, 1)],  # a decode batch of uneven lengths
        [(6, 6), (1, 10), (4, 15), (1, 2), (3, 3)],  # everything mixed
    ],
)
def test_torch_backend_matches_naive_attention(shapes):
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(128, num_layers=1, num_kv_heads=KVH, head_dim=D)
    batch, q, k, v, full = make_batch(shapes, pool, gen)
    batch.validate()
    out = TorchAttention().forward(q, k, v, 0, batch, pool)
    start = 0
    for (q_len, kv_len), (k_all, v_all) in zip(shapes, full, strict=True):
        ref = naive_attention(q[start : start + q_len], k_all, v_all, q_len, kv_len)
        torch.testing.assert_close(out[start : start + q_len], ref, atol=1e-5, rtol=1e-5)
        start += q_len


def test_forward_writes_new_kv_at_slot_mapping():
    gen = torch.Generator().manual_seed(1)
    pool = KVPool(64, num_layers=1, num_kv_heads=KVH, head_dim=D)
    batch, q, k, v, _ = make_batch([(3, 8), (1, 5)], pool, gen)
    TorchAttention().forward(q, k, v, 0, batch, pool)
    k_pool, v_pool = pool.get_kv(0, batch.slot_mapping)
    assert torch.equal(k_pool, k) and torch.equal(v_pool, v)


def test_validate_rejects_inconsistent_batches():
    slots = torch.arange(4)
    with pytest.raises(ValueError):
        AttentionBatch([5], [4], torch.arange(5), [slots]).validate()  # q_len > kv_len
    with pytest.raises(ValueError):
        AttentionBatch([2], [4], torch.arange(3), [slots]).validate()  # slot_mapping length
    with pytest.raises(ValueError):
        AttentionBatch([2], [5], torch.arange(2), [slots]).validate()  # kv_slots length


def test_make_attention_names():
    assert make_attention("torch").name == "torch"
    with pytest.raises(ValueError):
        make_attention("no-such-backend")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
@pytest.mark.parametrize("name", ["triton", "flashinfer"])
def test_gpu_backends_refuse_to_load_without_cuda(name):
    with pytest.raises(ImportError):
        make_attention(name)
