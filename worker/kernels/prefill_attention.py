"""CPU prefill-attention kernels in C over the KV pool in place: bfloat16 (AVX512-BF16) and
float32 (any CPU).

A prefill chunk of `nq` tokens attends causally to `nk` keys: its cached prefix and itself,
query i seeing keys 0 .. nk - nq + i (the mask aligned to the end). Torch's SDPA needs the
prefix gathered out of the pool first, and without AMX runs far below the core's bf16 peak
(`bench/bench_prefill_attention.py`, docs/engine.md).

bfloat16 (`SOURCE`): per KV head, the chunk's keys are read from the pool by slot once and
packed into pair words with vector shuffles: K as `[blocks][D/2][32]` (two dims of a key per
word, by 16 x 16 transposes), V as `[keys/2][D]` (a dim of two consecutive keys per word). Then
blocks of queries (each query head of the group a row) walk the keys up to their diagonal in
spans of 512, torch's flash kernel's key split:
- all the span's scores, as `vdpbf16ps` over pairs (products exact, sums float32), times the
  scale;
- per row, an exact softmax over the span against the running max: one rescale of the sum and
  the output per span;
- the weights rounded to bf16 (as torch's flash kernel rounds them) and multiplied with V pairs.
The output is rounded once. Keys past a row's diagonal get no weight. A block of fewer rows (a
chunk's last, a short chunk) computes only its rows, padded to the tiles of 8 and 4.

float32 (`F32_SOURCE`): the same blocks, spans and softmax on float32 vectors of GCC's vector
types (8 lanes on AVX2, 16 with AVX-512), so it builds for any CPU. Per KV head the keys are
packed transposed (`[blocks][D][2 VW]`, by VW x VW transposes in registers), and both products
run as the register tile of a float32 GEMM, 6 rows x 2 vectors: the scores over a packed block
(each dim of it loaded once for 6 rows), then p.V over value rows read where they lie in the
pool (each row's two vectors loaded once for 6 rows). Scores, weights and sums are float32,
within float32 rounding of exact attention; faster than the native backend's torch path
(docs/engine.md).

Built at first use by `worker.kernels.build`; `load(dtype)` returns None where the kernel
cannot serve (bf16 without AVX512-BF16; no compiler), and prefill keeps torch's flash kernel.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

import worker.kernels.build as builder

ROWS = 48  # query rows (tokens x query heads of a KV head) per block, about

SOURCE = "prefill_attention.c"  # in csrc/


F32_SOURCE = "prefill_attention_f32.c"  # in csrc/


class PrefillKernel:
    """A loaded library: `__call__` attends one prefill chunk over its keys in the pool."""

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype = torch.bfloat16) -> None:
        self.dtype = dtype  # of the queries, the pool and the output
        fn = library.prefill_attention if dtype == torch.bfloat16 else library.prefill_attention_f32
        fn.restype = ctypes.c_int
        fn.argtypes = (
            [ctypes.c_void_p] * 4
            + [ctypes.c_int64] * 5
            + [
                ctypes.c_float,
                ctypes.c_int64,
                ctypes.c_void_p,
            ]
        )
        self._fn = fn

    def __call__(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """q [nq, H, D] -> [nq, H, D] in the kernel's dtype, causal and aligned to the end over
        the keys at `slots` (int64 [nk], nk >= nq: the cached prefix, then the chunk's own,
        already written to `k_buf`/`v_buf` [S, KVH, D], the same dtype). Slots are read
        unchecked."""
        nq, heads, dim = q.shape
        q = q.contiguous()
        slots = slots.contiguous()
        out = torch.empty_like(q)
        rc = self._fn(
            q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), slots.data_ptr(), slots.numel(),
            nq, heads, k_buf.shape[1], dim, dim**-0.5, ROWS, out.data_ptr(),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("prefill_attention: out of memory")
        return out


def supports(q: torch.Tensor, k_buf: torch.Tensor) -> bool:
    """Whether a kernel serves these tensors: CPU, queries and pool both bfloat16 (a head size
    that is a multiple of 64) or both float32 (a multiple of 16), a contiguous pool."""
    multiple = {torch.bfloat16: 64, torch.float32: 16}.get(q.dtype)
    return (
        q.device.type == "cpu"
        and multiple is not None
        and k_buf.dtype == q.dtype
        and k_buf.is_contiguous()
        and q.shape[-1] % multiple == 0
    )


@cache
def load(dtype: torch.dtype = torch.bfloat16) -> PrefillKernel | None:
    """The kernel for `dtype`, built on first use; None where it cannot be built here (no C
    compiler, a build error) and, for bfloat16, where the CPU lacks AVX512-BF16."""
    if dtype == torch.float32:
        library = builder.build("prefill_attention_f32", F32_SOURCE)
        return PrefillKernel(library, dtype) if library is not None else None
    library = builder.build("prefill_attention", SOURCE)
    if library is None or not library.prefill_attention_available():
        return None
    return PrefillKernel(library)
