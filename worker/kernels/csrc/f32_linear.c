/* The float32 few-rows linear (worker/kernels/f32_gemm.py says how it works). */
#include <stdint.h>
/* VW floats a vector: 16 where the core has AVX-512, 8 elsewhere (a test builds the other
   width with -DVW). A group of GROUP outputs is NB vectors; a block of up to TILE rows shares
   each weight load. The two widths' tiles fill their register files: with AVX-512 6 rows x 4
   vectors of sums and the 4 weight vectors (28 of 32). With AVX2, up to 8 rows take one
   block of 8 rows x 1 vector of sums (10 of 16 registers with the weight vector and a
   broadcast input: 8 rows a pass over memory, faster at 8 rows than blocks of 6 rows x 2
   vectors); more rows go in blocks of up to WIDE 6 rows x 2 groups (15 of 16 registers: 12
   sums, 2 weight vectors, a broadcast), which load 8 vectors for 12 fused multiply-adds
   against 9 for 8 (measured with bench/bench_linears.py --base-tree: docs/engine.md). */
#include "vector_width.h"
#if VW == 16
#define GROUP 64
#define TILE 6
#define WIDE TILE  /* no wide blocks */
#else
#define GROUP 8
#define TILE 8
#define WIDE 6
#endif
#define NB (GROUP / VW)
/* A block of few rows takes up to GANG groups at once, so that at least 8 vectors of sums are
   in flight (each sum is a chain of FMAs, and the FMA units take a new one every half cycle
   for some 4 cycles of latency): 4 groups a row at 8 lanes. WIDE blocks take 2 groups. */
#define GANG 4
#define GANG_FEW(n) ((n) * NB >= 8 ? 1 : 8 / ((n) * NB) > GANG ? GANG : 8 / ((n) * NB))
#define GANG_OF(n, wide) ((wide) ? 2 : GANG_FEW(n))
typedef float vf __attribute__((vector_size(4 * VW)));
#include "few_rows_sums.h"

#define PF_BYTES 4096  /* software prefetch this far ahead in a group's weights */
/* an empty asm that takes v in a vector register, where one holds a vf: the compiler must
   load it there */
#if VW == 16 && defined(__AVX512F__)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#elif VW == 8 && defined(__AVX__)
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define IN_REGISTER(v) (void)0
#endif

int f32_group(void) { return GROUP; }

/* n rows against ng groups from g0, a WIDE block or not (n, ng, wide constants where it is
   inlined: the sums stay in registers); then each row's sums of each group (those below o)
   plus the bias to `out`. */
static inline __attribute__((always_inline)) void rows_block(
    const float *x, int64_t k, const float *w, int64_t g0, const int ng, const int n,
    const int wide, const float *bias, float *out, int64_t o) {
    vf acc[GANG][TILE][NB];
    for (int g = 0; g < ng; g++)
        for (int i = 0; i < n; i++)
            for (int b = 0; b < NB; b++) acc[g][i][b] = (vf){0};
    const float *wg = w + g0 * k * GROUP;
    for (int64_t p = 0; p < k; p++) {
        if (!wide) {  /* few rows: each group's weights, then its sums */
            float xv[TILE];
            for (int i = 0; i < n; i++) xv[i] = x[i * k + p];
            for (int g = 0; g < ng; g++) {
                const float *wp = wg + (g * k + p) * GROUP;
                /* the hardware prefetchers alone leave part of one core's read bandwidth
                   unused; a prefetch past the end never faults */
                for (int b = 0; b < GROUP; b += 16)
                    __builtin_prefetch((const char *)(wp + b) + PF_BYTES);
                vf wv[NB];
                for (int b = 0; b < NB; b++) wv[b] = ((const vf *)wp)[b];
                for (int i = 0; i < n; i++) {
                    vf xi = (vf){0} + xv[i];  /* the input broadcast */
                    for (int b = 0; b < NB; b++) acc[g][i][b] = FMA(acc[g][i][b], xi, wv[b]);
                }
            }
            continue;
        }
        /* a WIDE block computes more than it reads: the first group's prefetch is enough
           (with one for each group, blocks of 6 rows x 2 groups ran slower). Every group's weights of input p go to registers, each loaded once: left to
           itself, GCC folded the load into each row's FMA and spilled sums of the 6 x 2 tile. */
        for (int b = 0; b < GROUP; b += 16)
            __builtin_prefetch((const char *)(wg + p * GROUP + b) + PF_BYTES);
        vf wv[GANG][NB];
        for (int g = 0; g < ng; g++)
            for (int b = 0; b < NB; b++) {
                wv[g][b] = ((const vf *)(wg + (g * k + p) * GROUP))[b];
                IN_REGISTER(wv[g][b]);
            }
        for (int i = 0; i < n; i++) {
            vf xi = (vf){0} + x[i * k + p];
            for (int g = 0; g < ng; g++)
                for (int b = 0; b < NB; b++) acc[g][i][b] = FMA(acc[g][i][b], xi, wv[g][b]);
        }
    }
    store_sums(acc, g0, ng, n, bias, out, o);
}

#define LINEAR f32_linear
#include "few_rows_driver.h"
