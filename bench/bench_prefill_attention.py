"""Prefill attention over the KV pool: `worker.kernels.prefill_attention` against torch's SDPA,
in bf16 (the AVX512-BF16 kernel) or float32 (`--dtype float32`: the kernel for any CPU).

For each chunk shape (`nq` new tokens over `nk` keys: a cached prefix, then the chunk), the
keys sit at scattered slots of a pool as in the engine; the kernel reads them there, torch's
flash kernel (`scaled_dot_product_attention`, causal aligned to the end through an explicit
mask where nq < nk) gets them gathered first, as the torch path does; `native` is what the
native backend runs where the kernel does not serve (a cold chunk causal over its own K/V; over
a cached prefix, the prefix gathered and two flash calls merged by their log-sum-exp). Printed:
ms per layer, GFLOP/s over the visible (query, key) pairs, the ratio to the fastest torch way,
and the largest error of the kernel and of torch's GQA path against a float32 softmax. One
torch thread (the engine's).

    python bench/bench_prefill_attention.py                   # SmolLM2-135M's heads
    python bench/bench_prefill_attention.py --dtype float32
    python bench/bench_prefill_attention.py --heads 32 8 --head-dim 128 --shape 512x4096
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from functools import partial

import torch
import torch.nn.functional as F

import worker.kernels.prefill_attention as prefill_kernel
from worker.attention.base import end_aligned_mask
from worker.attention.native import _prefill

SHAPES = ("560x560", "65x560", "1100x1100", "64x2100", "2048x2048", "7x1300")  # nq x nk


def per_call(fn, repeat: int) -> float:
    fn()  # warm: the kernel builds and the pages fault in before the timed calls
    return statistics.median(timeit.repeat(fn, number=1, repeat=repeat))


def reference(q, k_buf, v_buf, slots) -> torch.Tensor:
    """float32 attention of q [nq, H, D] over the keys at `slots`."""
    nq, heads, dim = q.shape
    group = heads // k_buf.shape[1]
    k = k_buf[slots].float().repeat_interleave(group, 1)
    v = v_buf[slots].float().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * dim**-0.5
    visible = end_aligned_mask(nq, slots.numel(), q.device)
    if visible is None:  # no cached prefix: plain causal
        visible = torch.ones(nq, nq, dtype=torch.bool).tril()
    s = s.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", s, v)


def torch_path(q, k_buf, v_buf, slots, expand: bool = False) -> torch.Tensor:
    """Gather, then torch's SDPA with `enable_gqa`, as the engine's torch attention path does;
    with `expand`, the KV heads repeated for each query head instead (torch's flash kernel
    then serves the causal case)."""
    nq, nk = q.shape[0], slots.numel()
    k, v = k_buf[slots].transpose(0, 1), v_buf[slots].transpose(0, 1)
    if expand:
        group = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    mask = end_aligned_mask(nq, nk, q.device)
    q, k, v = (t.contiguous() for t in (q.transpose(0, 1), k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=not expand
    )
    return out.transpose(0, 1)


def native_path(q, k_buf, v_buf, slots) -> torch.Tensor:
    """The native backend's torch path for one chunk (its own K/V are the last nq slots')."""
    nq, nk = q.shape[0], slots.numel()
    own = slots[nk - nq :]
    prefix = slots[: nk - nq] if nk > nq else None
    return _prefill(q, k_buf[own], v_buf[own], prefix, k_buf, v_buf, True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="*", default=list(SHAPES), help="NQxNK chunk shapes")
    parser.add_argument("--heads", nargs=2, type=int, default=(9, 3), metavar=("H", "KVH"))
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16384, help="pool slots")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    kernel = prefill_kernel.load(dtype)
    if kernel is None:
        print(f"the {args.dtype} prefill kernel does not build here (bf16 needs AVX512-BF16; "
              "both a C compiler)")
        return 1
    heads, kv_heads = args.heads
    dim = args.head_dim
    k_buf = torch.randn(args.slots, kv_heads, dim, dtype=dtype)
    v_buf = torch.randn(args.slots, kv_heads, dim, dtype=dtype)
    print(f"heads {heads}/{kv_heads}, head dim {dim}, {args.dtype}, one thread; ms per layer")
    print(
        f"{'nq x nk':>12} {'kernel':>10} {'GFLOP/s':>8} {'torch gqa':>10} {'GFLOP/s':>8} "
        f"{'torch exp':>10} {'GFLOP/s':>8} {'native':>10} {'GFLOP/s':>8} {'ratio':>6} "
        f"{'err kernel':>11} {'err torch':>10}"
    )
    for shape in args.shape:
        nq, nk = (int(n) for n in shape.split("x"))
        slots = torch.randperm(args.slots)[:nk]
        q = torch.randn(nq, heads, dim, dtype=dtype)
        flops = 4 * heads * dim * (nq * (nk - nq) + nq * (nq + 1) // 2)  # visible pairs
        t_kernel = per_call(partial(kernel, q, k_buf, v_buf, slots), args.repeat)
        t_torch = per_call(partial(torch_path, q, k_buf, v_buf, slots), args.repeat)
        t_expand = per_call(partial(torch_path, q, k_buf, v_buf, slots, True), args.repeat)
        t_native = per_call(partial(native_path, q, k_buf, v_buf, slots), args.repeat)
        ref = reference(q, k_buf, v_buf, slots)
        err_kernel = (kernel(q, k_buf, v_buf, slots).float() - ref).abs().max().item()
        err_torch = (torch_path(q, k_buf, v_buf, slots).float() - ref).abs().max().item()
        print(f"{shape:>12} {t_kernel * 1e3:>8.2f}ms {flops / t_kernel / 1e9:>8.0f} "
              f"{t_torch * 1e3:>8.2f}ms {flops / t_torch / 1e9:>8.0f} "
              f"{t_expand * 1e3:>8.2f}ms {flops / t_expand / 1e9:>8.0f} "
              f"{t_native * 1e3:>8.2f}ms {flops / t_native / 1e9:>8.0f} "
              f"{min(t_torch, t_expand, t_native) / t_kernel:>5.2f}x {err_kernel:>11.2e} "
              f"{err_torch:>10.2e}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
