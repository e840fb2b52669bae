/* The linear over GGUF blocks, built with -DBITS=4 or -DBITS=8 (worker/kernels/quant_gemm.py
   says how it works). */
#include <stdint.h>
/* VW floats a vector (16 with AVX-512, else 8; -DVW builds the other); BITS 4 or 8 a quant.
   A group is one vector of outputs (NB 1); a block of up to 8 rows shares each weight made. */
#include "vector_width.h"
#define GROUP VW
#define NB 1
#define TILE 8
#define WIDE TILE  /* no wide blocks */
#define GANG 4
#define GANG_OF(n, wide) ((n) >= 8 ? 1 : 8 / (n) > GANG ? GANG : 8 / (n))
typedef float vf __attribute__((vector_size(4 * VW)));
typedef int32_t vi __attribute__((vector_size(4 * VW)));
typedef uint32_t vu __attribute__((vector_size(4 * VW)));
#include "few_rows_sums.h"

#define QBLOCK 32
#if BITS == 4
#define PER_LANE 8    /* inputs a 32-bit lane */
#define SCALES 2      /* d, m */
#define LINEAR q4_linear
#else
#define PER_LANE 4
#define SCALES 1      /* d */
#define LINEAR q8_linear
#endif
#define WORDS (QBLOCK / PER_LANE)  /* vectors of quants a block */
#define BLOCK_VECTORS (SCALES + WORDS)
#define PF_BYTES 2048  /* software prefetch this far ahead in a group's blocks */

int quant_group(void) { return GROUP; }

/* The weights of input i (of a lane's PER_LANE) of quants `word`: fma(q, d, m), the GGUF's
   d * q + m (d * q exact); at 8 bits q * d, exact. */
static inline __attribute__((always_inline)) vf weights(vu word, const int i, vf d, vf m) {
#if BITS == 4
    vf q = __builtin_convertvector((vi)((word >> (4 * i)) & 15), vf);
    return FMA(m, q, d);
#else
    vf q = __builtin_convertvector(((vi)(word << (24 - 8 * i))) >> 24, vf);
    (void)m;
    return q * d;
#endif
}

/* n rows against ng groups from g0 (n, ng constants where it is inlined: the sums stay in
   registers); then each row's sums plus the bias to `out`. */
static inline __attribute__((always_inline)) void rows_block(
    const float *x, int64_t k, const float *w, int64_t g0, const int ng, const int n,
    const int wide, const float *bias, float *out, int64_t o) {
    (void)wide;  /* never: WIDE is TILE */
    vf acc[GANG][TILE][NB];
    for (int g = 0; g < ng; g++)
        for (int r = 0; r < n; r++) acc[g][r][0] = (vf){0};
    int64_t blocks = k / QBLOCK;
    const vf *wg = (const vf *)w + g0 * blocks * BLOCK_VECTORS;
    for (int64_t b = 0; b < blocks; b++) {
        const vf *blk[GANG];
        for (int g = 0; g < ng; g++) {
            blk[g] = wg + (g * blocks + b) * BLOCK_VECTORS;
            for (int line = 0; line < BLOCK_VECTORS * 4 * VW; line += 64)
                __builtin_prefetch((const char *)blk[g] + PF_BYTES + line);
        }
        /* a group's scales and quants at a time (few registers: the sums stay in them); the
           groups' chains of fused multiply-adds overlap out of order. Holding 4 groups'
           scales and quants at once instead (each input over the groups) spills the sums. */
        for (int v = 0; v < WORDS; v++) {
            const float *xp = x + b * QBLOCK + v * PER_LANE;
            for (int g = 0; g < ng; g++) {
                vf d = blk[g][0], m = SCALES > 1 ? blk[g][SCALES - 1] : (vf){0};
                vu word = ((const vu *)blk[g])[SCALES + v];
#pragma GCC unroll 8
                for (int i = 0; i < PER_LANE; i++) {
                    vf wv = weights(word, i, d, m);
                    for (int r = 0; r < n; r++)
                        acc[g][r][0] = FMA(acc[g][r][0], (vf){0} + xp[r * k + i], wv);
                }
            }
        }
    }
    store_sums(acc, g0, ng, n, bias, out, o);
}
#include "few_rows_driver.h"
