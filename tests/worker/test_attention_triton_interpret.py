"""The Triton paged-attention kernel's logic, checked on CPU in Triton's interpreter
(`triton_kit.run_interpreted`: a child process). Skipped when the `triton` package is not
installed (the CPU torch wheel lacks it; CI installs it)."""

from __future__ import annotations

import textwrap

import pytest
from triton_kit import needs_triton, run_interpreted

pytestmark = needs_triton

CHECK = textwrap.dedent(
    """
    import sys

    import torch
    from torch.nn.utils.rnn import pad_sequence

    from mem_cache.kv_pool import KVPool
    from worker.attention.base import AttentionBatch
    from worker.attention.registry import make_attention

    H, KVH = int(sys.argv[1]), int(sys.argv[2])
    D = 24  # not a power of two: the kernel pads it to 32
    shapes = [(7, 7), (5, 12), (1, 9), (1, 3), (1, 17), (40, 40), (33, 100), (1, 1)]
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(512, 1, KVH, D)
    pool.k_buffer[0].copy_(torch.randn(512, KVH, D, generator=gen))
    pool.v_buffer[0].copy_(torch.randn(512, KVH, D, generator=gen))
    perm = torch.randperm(512, generator=gen)
    kv_slots, used = [], 0
    for _, kv in shapes:
        kv_slots.append(perm[used : used + kv])
        used += kv
    slot_mapping = torch.cat([s[kv - q :] for (q, kv), s in zip(shapes, kv_slots)])
    t = sum(q for q, _ in shapes)
    q = torch.randn(t, H, D, generator=gen)
    k = torch.randn(t, KVH, D, generator=gen)
    v = torch.randn(t, KVH, D, generator=gen)
    q_lens, kv_lens = [a for a, _ in shapes], [b for _, b in shapes]
    # the slots as a table, its rows past each length filled with other valid slots
    table = pad_sequence(kv_slots, batch_first=True, padding_value=511)

    ref = make_attention("torch").forward(q, k, v, 0, AttentionBatch(q_lens, kv_lens,
                                          slot_mapping, kv_slots), pool)
    triton = make_attention("triton")
    lists = triton.forward(q, k, v, 0, AttentionBatch(q_lens, kv_lens, slot_mapping,
                                                     kv_slots), pool)
    rows = triton.forward(q, k, v, 0, AttentionBatch(q_lens, kv_lens, slot_mapping,
                                                    slot_table=table), pool)
    # decode rows alone, through the plan a CUDA graph keeps: rows of a larger table in place
    decode = [i for i, (a, _) in enumerate(shapes) if a == 1]
    starts = torch.tensor([0] + q_lens).cumsum(0)
    tokens = torch.stack([starts[i] for i in decode])
    big = torch.full((20, table.shape[1]), 3)
    picked = torch.tensor([4, 17, 0, 9], dtype=torch.int32)
    big[picked.long()] = table[decode]
    plan = triton.graph_plan(
        torch.arange(len(decode) + 1, dtype=torch.int32),
        torch.tensor([kv_lens[i] for i in decode], dtype=torch.int32), picked, big, 1,
    )
    batch = AttentionBatch([1] * len(decode), [1] * len(decode), slot_mapping[tokens],
                           slot_table=big)
    batch.plan["triton"] = plan
    graph = triton.forward(q[tokens], k[tokens], v[tokens], 0, batch, pool)
    for out in (lists, rows):
        print((out - ref).abs().max().item())
    print((graph - ref[tokens]).abs().max().item())
    """
)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2), (3, 3), (8, 1)])
def test_triton_kernel_matches_torch_in_the_interpreter(heads, kv_heads):
    """Slot lists, a slot table, and the decode plan over table rows in place: the same
    attention as the torch reference."""
    errors = [float(x) for x in run_interpreted(CHECK, str(heads), str(kv_heads)).split()]
    assert len(errors) == 3 and max(errors) < 1e-4, errors
