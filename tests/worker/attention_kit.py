"""Builders for attention tests: a one-layer KV pool of random K/V, and a forward pass over it
as the engine builds one (the slot table, the new tokens' slots, random q/k/v)."""

from __future__ import annotations

import torch

from mem_cache.kv_pool import KVPool
from worker.attention.base import AttentionBatch


def random_pool(gen: torch.Generator, size: int, kv_heads: int, dim: int, dtype) -> KVPool:
    pool = KVPool(size, 1, kv_heads, dim, dtype)
    pool.k_buffer[0].copy_(torch.randn(size, kv_heads, dim, generator=gen))
    pool.v_buffer[0].copy_(torch.randn(size, kv_heads, dim, generator=gen))
    return pool


def pass_over(
    gen: torch.Generator,
    seq_slots: list[torch.Tensor],
    q_lens: list[int],
    heads: int,
    pool: KVPool,
) -> tuple[AttentionBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One pass: sequence i has the keys at `seq_slots[i]`, its last `q_lens[i]` new; returns
    the batch and random q [T, heads, D], k and v [T, KVH, D] in the pool's dtype."""
    kv_lens = [s.numel() for s in seq_slots]
    table = torch.zeros(len(seq_slots), max(kv_lens) + 4, dtype=torch.int64)  # some padding
    for i, s in enumerate(seq_slots):
        table[i, : s.numel()] = s
    mapping = torch.cat([s[s.numel() - n :] for s, n in zip(seq_slots, q_lens, strict=True)])
    batch = AttentionBatch(q_lens, kv_lens, mapping, slot_table=table)
    t, kvh, dim = sum(q_lens), pool.num_kv_heads, pool.head_dim
    q, k, v = (torch.randn(t, n, dim, generator=gen).to(pool.dtype) for n in (heads, kvh, kvh))
    return batch, q, k, v
