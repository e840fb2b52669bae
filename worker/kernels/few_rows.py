"""What the few-rows C linears share (`pair_gemm` in bfloat16, `f32_gemm` in float32): the call
over a weight packed in the kernel's layout, and that layout's groups of outputs.

Each kernel's library exports `fn(x, w, bias, out, rows, k, o)`: `x` [rows, k] and `out`
[rows, o] row-major in the kernel's dtype, `w` the weight in the kernel's layout (outputs in
groups, the last padded with zero outputs), `bias` [o] or NULL.
"""

from __future__ import annotations

import copy
import ctypes

import torch

# C shared by the float32-summing kernels' sources (`f32_gemm`, `quant_gemm`), which define VW
# (floats a vector), `vf` (its type), GROUP outputs a group in NB vectors, one block of up to
# TILE rows or else blocks of up to WIDE (<= TILE) rows, over up to GANG groups at once
# (GANG_OF(n, wide) for a block of n rows, wide where WIDE < TILE rows), and before
# `C_DRIVER` `rows_block` (n rows against ng groups) and LINEAR (the exported name). Every
# output is one float32 sum of fused multiply-adds over the inputs in order, then the bias:
# whatever the kernel and the layout of its weight, the same weights give the same bits.
C_SUMS = r"""
/* acc + a * b in one rounding, always: left to -ffp-contract, GCC made one of f32_gemm's row
   blocks a multiply and an add (other bits than the fused blocks beside it). The x86
   intrinsic where the core has it at this width, else fmaf a lane (vectorised where it can).
   GCC does not reassociate fused multiply-adds either (-fassociative-math), so every sum runs
   over the inputs in order and a row's result does not depend on the rows beside it. */
#if VW == 16 && defined(__AVX512F__)
#include <immintrin.h>
#define FMA(acc, a, b) ((vf)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(acc)))
#elif VW == 8 && defined(__FMA__)
#include <immintrin.h>
#define FMA(acc, a, b) ((vf)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(acc)))
#else
static inline vf FMA(vf acc, vf a, vf b) {
    for (int l = 0; l < VW; l++) acc[l] = __builtin_fmaf(a[l], b[l], acc[l]);
    return acc;
}
#endif
/* each of n rows' sums of ng groups from g0 (the outputs below o), plus the bias, to out */
static inline __attribute__((always_inline)) void store_sums(
    vf acc[GANG][TILE][NB], int64_t g0, int ng, int n, const float *bias, float *out, int64_t o) {
    for (int g = 0; g < ng; g++) {
        int64_t first = (g0 + g) * GROUP, valid = o - first < GROUP ? o - first : GROUP;
        for (int i = 0; i < n; i++) {
            const float *s = (const float *)acc[g][i];
            for (int64_t j = 0; j < valid; j++)
                out[i * o + first + j] = s[j] + (bias ? bias[first + j] : 0.0f);
        }
    }
}
"""
C_DRIVER = r"""
#define BLOCK(N)                                                                   \
    case N:                                                                        \
        if (ng == 1) rows_block(xr, k, w, g, 1, N, 0, bias, dst, o);               \
        else if (wide) rows_block(xr, k, w, g, GANG_OF(N, 1), N, 1, bias, dst, o); \
        else rows_block(xr, k, w, g, GANG_OF(N, 0), N, 0, bias, dst, o);           \
        break;

/* out[rows, o] = x[rows, k] . w^T (+ bias): x float32 row-major, w packed in groups of
   GROUP outputs as the source says (outputs past o are zero), bias float32 [o] or NULL. Up to
   TILE rows are one block; more go in blocks of up to TILE rows or, where the source's WIDE
   is less, of up to WIDE rows (wide blocks), as even as that allows (8 rows at 6: 4 + 4, not
   6 + 2, whose 2-row pass has fewer sums in flight), each block over GANG groups at a time
   (from the cache for the blocks after the first). */
void LINEAR(const float *x, const float *w, const float *bias, float *out, int64_t rows,
            int64_t k, int64_t o) {
    const int wide = WIDE < TILE && rows > TILE;
    int64_t tile = wide ? WIDE : TILE;
    int64_t groups = (o + GROUP - 1) / GROUP, blocks = (rows + tile - 1) / tile;
    for (int64_t gang = 0; gang < groups; gang += GANG) {
        int64_t end = gang + GANG < groups ? gang + GANG : groups;
        for (int64_t blk = 0, r = 0; blk < blocks; blk++) {
            int64_t left = blocks - blk, n = (rows - r + left - 1) / left;
            const float *xr = x + r * k;
            float *dst = out + r * o;
            for (int64_t g = gang; g < end;) {
                int ng = g + GANG_OF(n, wide) <= end ? GANG_OF(n, wide) : 1;
                switch (n) {
                    BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6)
#if TILE > 6
                    BLOCK(7) BLOCK(8)
#endif
                }
                g += ng;
            }
            r += n;
        }
    }
}
"""


class FewRowsLinear:
    """A loaded kernel: `__call__` is the linear over a weight its module's `pack` made."""

    dtype: torch.dtype  # of x, the weight, the bias and the output: set by each kernel

    def __init__(self, fn: ctypes._CFuncPtr, max_rows: int) -> None:
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
        self._fn = fn
        self.max_rows = max_rows  # linears over more rows go to oneDNN (`packed.linear`)

    def up_to(self, rows: int) -> FewRowsLinear:
        """The same kernel, taking linears of at most `rows` rows."""
        limited = copy.copy(self)
        limited.max_rows = rows
        return limited

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
    ) -> torch.Tensor:
        """x [..., K] (any rows; `linear` sends it at most `max_rows`) -> [..., out_features]."""
        k = x.shape[-1]
        x2 = x.reshape(-1, k).contiguous()
        out = torch.empty((*x.shape[:-1], out_features), dtype=self.dtype)
        self._fn(
            x2.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
            out.data_ptr(), x2.shape[0], k, out_features,
        )  # fmt: skip
        return out


def output_groups(weight: torch.Tensor, group: int) -> torch.Tensor:
    """[O, K] -> [ceil(O / group), group, K]: the outputs in groups, the last padded with zero
    outputs (a view of `weight` where O is a multiple of `group`)."""
    o, k = weight.shape
    padded = -(-o // group) * group
    w = weight.detach()
    if padded != o:
        w = torch.cat([w, w.new_zeros(padded - o, k)])
    return w.view(padded // group, group, k)
