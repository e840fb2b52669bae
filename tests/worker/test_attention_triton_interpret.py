"""The Triton paged-attention kernel's logic, checked on CPU in Triton's interpreter.

`TRITON_INTERPRET=1` must be set before the kernel is defined, so the check runs in a child
process. Skipped when the `triton` package is not installed (the CPU torch wheel lacks it).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)

CHECK = textwrap.dedent(
    """
    import torch
    from mem_cache.kv_pool import KVPool
    from worker.attention import AttentionBatch
from worker.attention_backends import make_attention

    import sys

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

    def batch():
        q_lens, kv_lens = [a for a, _ in shapes], [b for _, b in shapes]
        return AttentionBatch(q_lens, kv_lens, slot_mapping, kv_slots)

    ref = make_attention("torch").forward(q, k, v, 0, batch(), pool)
    out = make_attention("triton").forward(q, k, v, 0, batch(), pool)
    print((out - ref).abs().max().item())
    """
)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2), (3, 3), (8, 1)])
def test_triton_kernel_matches_torch_in_the_interpreter(heads, kv_heads):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-c", CHECK, str(heads), str(kv_heads)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert float(result.stdout.strip().splitlines()[-1]) < 1e-4
