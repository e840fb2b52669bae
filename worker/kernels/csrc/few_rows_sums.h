/* C shared by the float32-summing kernels' sources (`f32_gemm`, `quant_gemm`), which define VW
   (floats a vector), `vf` (its type), GROUP outputs a group in NB vectors, one block of up to
   TILE rows or else blocks of up to WIDE (<= TILE) rows, over up to GANG groups at once
   (GANG_OF(n, wide) for a block of n rows, wide where WIDE < TILE rows), and before
   few_rows_driver.h `rows_block` (n rows against ng groups) and LINEAR (the exported name). Every
   output is one float32 sum of fused multiply-adds over the inputs in order, then the bias:
   whatever the kernel and the layout of its weight, the same weights give the same bits. */
#pragma once
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
