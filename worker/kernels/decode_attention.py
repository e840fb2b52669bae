"""A CPU decode-attention kernel in C that reads the KV pool (bfloat16 or float32) in place, built
at first use, once per pool dtype.

Torch's CPU flash kernel is tuned for long query blocks; a decode step hands it one query per
sequence (a few query heads per KV head), and then its fixed cost per (sequence, head) and its
per-key work dominate, and the KV has to be gathered out of the pool first. This kernel walks
*segments*: a list of key slots (read straight from the pool, no gather) and the sequences whose
queries attend to them. Each query keeps an online-softmax state (running max, sum, float32
accumulator) across the segments it takes part in, so a group's shared prefix (one segment, all
its members' queries) and each member's own keys (one segment each) need no separate merge,
mask or padding. Scores, softmax and the weighted sum are float32; over a bfloat16 pool the
weights are rounded to bfloat16 (as torch's flash kernel does) and the output once.

Where the CPU has AVX512-BF16, q.k and p.V take bf16 pairs (`vdpbf16ps`: products exact, sums
in float32). A segment's keys go by in tiles of 32, each slot's row read once for every KV head
(the pool is slot-major: one slot's K for all heads is contiguous): K transposed into pair
words, then per head the scores of all its queries, their softmax over the tile, and p @ V
(V read from the pool and unpacked into pairs of keys on the way), up to six queries sharing
each load. Rows a few tiles ahead are prefetched a few lines at a time, spread over a tile's
work, so the memory reads overlap the arithmetic. Where the core also has AMX (and Linux grants
the process its tile state), a KV head's queries over a segment, from `AMX_MIN_Q` of them (two
sequences over a shared prefix, at 3 query heads per KV head), score and weigh in tiles: q.k of
16 queries against the tile's 32 keys (the K pair words are already AMX's B layout), then p @ V
of the same 16 against the tile's V unpacked once into pairs of keys, each query's accumulator
rescaled and added in vectors. Groups over a shared prefix gain most; one sequence's few
queries gain nothing (memory-bound) and stay on vdpbf16ps (docs/engine.md).

Elsewhere, and always over a float32 pool (the dtype of CPUs without bf16 units), the same
segments and online softmax run on float32 vectors, in plain C over the compiler's vector types:
16 lanes where the core has AVX-512, 8 elsewhere (AVX2 has 16 registers of 8 floats: built at
16 lanes, the register tiles would spill). Keys go in blocks of
about 192 KB of rows (128 of SmolLM2's in float32, at most 256), every KV head over a block
before the next, while the rows of the block after it are asked into L2 a few lines at a time
over the block's work. A segment of up to 8 queries per KV head takes, per query, the products
of a vector's width of keys at once, then sums each key's lanes in a tree of shuffles, and its
p @ V takes four queries (two at 8 lanes) per pass over the block's value rows. More (a group
over its shared prefix) work on vectors of queries: scores of 3 keys against up to 3 vectors of
queries at a time (each key's dims broadcast), kept keys x queries, so that the softmax runs
down the keys on vectors of queries and p @ V broadcasts each weight, over the value rows of 32
keys at a time (in L1) for every query (faster than transposing the scores into query rows;
docs/engine.md).
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

import worker.kernels.build as builder

SOURCE = "decode_attention.c"  # in csrc/


class DecodeKernel:
    """The loaded library. `__call__` attends every decoding sequence over its segments."""

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype = torch.bfloat16) -> None:
        self.dtype = dtype  # of the queries, the pool and the output
        # queries of a KV head over a segment's keys score in AMX tiles (where the core has
        # them and Linux grants them) from AMX_MIN_Q on
        self.amx = dtype == torch.bfloat16 and bool(library.decode_attention_amx())
        fn = library.decode_attention
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5 + [
            ctypes.c_float,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        self._fn = fn

    def __call__(
        self,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        slots: torch.Tensor,
        segments: torch.Tensor,
        members: torch.Tensor,
    ) -> torch.Tensor:
        """q [B, H, D] -> [B, H, D], `k_buf`/`v_buf` [S, KVH, D] (one layer of the pool), all
        in the kernel's `dtype`; `segments` int64 [n, 4] rows (offset into `slots`, key count,
        offset into `members`, member count); `slots`, `members` int64. Every sequence must
        take part in at least one segment with at least one key, and every slot must be a row
        of the pool (the kernel reads what it is told to, unchecked)."""
        b, heads, dim = q.shape
        kv_heads = k_buf.shape[1]
        q = q.contiguous()
        # per call, not kept: engines in several threads of one process share this kernel
        state = torch.empty(b * heads * (dim + 2), dtype=torch.float32)
        out = torch.empty_like(q)
        rc = self._fn(
            q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), slots.data_ptr(),
            segments.data_ptr(), members.data_ptr(), segments.shape[0], b, heads, kv_heads,
            dim, dim**-0.5, state.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("decode_attention: out of memory")
        return out


def supports(q: torch.Tensor, k_buf: torch.Tensor) -> bool:
    """Whether a kernel serves these tensors: CPU, queries and pool both bfloat16 or both
    float32, a contiguous pool, a head size that is a multiple of 16."""
    return (
        q.device.type == "cpu"
        and q.dtype in builder.ELEMENT_DTYPES
        and k_buf.dtype == q.dtype
        and k_buf.is_contiguous()
        and q.shape[-1] % 16 == 0
    )


@cache
def load(dtype: torch.dtype = torch.bfloat16) -> DecodeKernel | None:
    """The kernel for a pool of `dtype`, built on first use; None when it cannot be built here
    (no C compiler, a build error)."""
    library = builder.build_for("decode_attention", SOURCE, dtype)
    return DecodeKernel(library, dtype) if library is not None else None
