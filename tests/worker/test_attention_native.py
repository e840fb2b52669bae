"""The native attention backend gives what the torch reference gives, on every batch shape."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mem_cache.kv_pool import KVPool
from worker.attention.base import AttentionBatch
from worker.attention.native import MIN_SHARED
from worker.attention.registry import make_attention

H, KVH, D = 6, 2, 8
POOL = 512

# (q_len, kv_len): decode (1, n), plain prefill (n, n), a chunk over a cached prefix (q < kv)
sequence = st.integers(1, 40).flatmap(
    lambda kv: st.tuples(st.sampled_from(sorted({1, kv, max(1, kv // 3)})), st.just(kv))
)


def build(shapes, seed: int, dtype: torch.dtype, as_table: bool):
    """A pool with each sequence's cached prefix at scattered slots, and its batch."""
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(POOL, 1, KVH, D, dtype)
    pool.k_buffer[0].copy_(torch.randn(POOL, KVH, D, generator=gen))
    pool.v_buffer[0].copy_(torch.randn(POOL, KVH, D, generator=gen))
    perm = torch.randperm(POOL, generator=gen)
    used, slots, mapping = 0, [], []
    for q_len, kv_len in shapes:
        slots.append(perm[used : used + kv_len])
        mapping.append(slots[-1][kv_len - q_len :])
        used += kv_len
    q_lens, kv_lens = [s[0] for s in shapes], [s[1] for s in shapes]
    t = sum(q_lens)
    q, k, v = (torch.randn(t, n, D, generator=gen).to(dtype) for n in (H, KVH, KVH))
    if as_table:  # the engine's form: rows of a request-to-slot table, stale entries past kv_len
        table = perm[torch.randint(0, POOL, (len(shapes), max(kv_lens) + 3), generator=gen)]
        for i, s in enumerate(slots):
            table[i, : s.numel()] = s
        batch = AttentionBatch(q_lens, kv_lens, torch.cat(mapping), slot_table=table)
    else:
        batch = AttentionBatch(q_lens, kv_lens, torch.cat(mapping), kv_slots=slots)
    return pool, batch, q, k, v


def run(name: str, shapes, seed: int, dtype: torch.dtype, as_table: bool):
    pool, batch, q, k, v = build(shapes, seed, dtype, as_table)
    batch.validate()
    out = make_attention(name).forward(q, k, v, 0, batch, pool)
    return out, pool


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(sequence, min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_native_matches_the_reference_on_mixed_batches(shapes, seed):
    ref, ref_pool = run("torch", shapes, seed, torch.float32, as_table=False)
    for as_table in (False, True):
        out, pool = run("native", shapes, seed, torch.float32, as_table)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(pool.k_buffer[0], ref_pool.k_buffer[0])  # new K/V written in place
        assert torch.equal(pool.v_buffer[0], ref_pool.v_buffer[0])


def test_native_matches_the_reference_in_bfloat16():
    shapes = [(1, 30), (12, 40), (9, 9), (1, 3), (1, 17)]
    ref, _ = run("torch", shapes, 3, torch.bfloat16, as_table=False)
    out, _ = run("native", shapes, 3, torch.bfloat16, as_table=True)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_one_backend_serves_batches_of_growing_size():
    """The decode workspace is reused and grown: later, larger batches are still right."""
    backend = make_attention("native")
    for seed, shapes in enumerate([[(1, 50)] * 4, [(1, 5)] * 2, [(1, 90), (1, 7)] * 3]):
        pool, batch, q, k, v = build(shapes, seed, torch.float32, as_table=True)
        ref_pool, ref_batch, *_ = build(shapes, seed, torch.float32, as_table=False)
        ref = make_attention("torch").forward(q, k, v, 0, ref_batch, ref_pool)
        torch.testing.assert_close(backend.forward(q, k, v, 0, batch, pool), ref)


def build_shared(groups, seed: int, dtype: torch.dtype):
    """Decoding sequences that share prefixes: `groups` lists (prefix length, [own lengths]),
    the members of a group holding the same slots for the prefix (as the radix cache hands
    them out); returns the pool, the batch as the torch reference takes it and as the engine
    gives it (a table with stale entries past kv_len), and q/k/v."""
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(POOL * 4, 1, KVH, D, dtype)
    pool.k_buffer[0].copy_(torch.randn(POOL * 4, KVH, D, generator=gen))
    pool.v_buffer[0].copy_(torch.randn(POOL * 4, KVH, D, generator=gen))
    perm = torch.randperm(POOL * 4, generator=gen)
    used, slots = 0, []
    for prefix_len, owns in groups:
        prefix = perm[used : used + prefix_len]
        used += prefix_len
        for own in owns:
            slots.append(torch.cat((prefix, perm[used : used + own])))
            used += own
    kv_lens = [s.numel() for s in slots]
    mapping = torch.stack([s[-1] for s in slots])
    table = perm[torch.randint(0, POOL * 4, (len(slots), max(kv_lens) + 3), generator=gen)]
    for i, s in enumerate(slots):
        table[i, : s.numel()] = s
    q_lens = [1] * len(slots)
    ref = AttentionBatch(q_lens, kv_lens, mapping, kv_slots=slots)
    engine = AttentionBatch(q_lens, kv_lens, mapping.clone(), slot_table=table)
    q, k, v = (torch.randn(len(slots), n, D, generator=gen).to(dtype) for n in (H, KVH, KVH))
    return pool, ref, engine, q, k, v


group = st.tuples(st.integers(0, 80), st.lists(st.integers(1, 30), min_size=1, max_size=4))


@settings(max_examples=40, deadline=None)
@given(groups=st.lists(group, min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_decoding_sequences_that_share_a_prefix_attend_as_the_reference(groups, seed):
    """Cascade decode: a group's shared prefix attended once, merged with each member's own
    keys by log-sum-exp, gives what attending over each sequence's whole KV gives."""
    pool, ref_batch, batch, q, k, v = build_shared(groups, seed, torch.float32)
    ref = make_attention("torch").forward(q, k, v, 0, ref_batch, pool)
    out = make_attention("native").forward(q, k, v, 0, batch, pool)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_a_shared_prefix_is_attended_once_per_group():
    """The plan groups sequences by the prefix slots they share (at least MIN_SHARED of them),
    and the result holds in bfloat16."""
    groups = [(MIN_SHARED + 20, [3, 1, 7]), (MIN_SHARED - 1, [2, 2]), (0, [9]), (90, [4, 5])]
    pool, ref_batch, batch, q, k, v = build_shared(groups, 7, torch.bfloat16)
    ref = make_attention("torch").forward(q, k, v, 0, ref_batch, pool)
    out = make_attention("native").forward(q, k, v, 0, batch, pool)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    shared = [(m.tolist(), n) for m, n in batch.plan["native"].shared]
    assert shared == [([0, 1, 2], MIN_SHARED + 20), ([6, 7], 90)]
