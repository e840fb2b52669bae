/* The bfloat16 few-rows linear (worker/kernels/pair_gemm.py says how it works). */
#define _DEFAULT_SOURCE  /* syscall(), for AMX's permission */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "amx_tiles.h"

#ifdef __AVX512BF16__
#include <immintrin.h>
#define NB 4  /* vectors of 16 outputs per group */
#define PF_PAIRS 16  /* software prefetch this many pairs (256 bytes each) ahead */

/* The pair's four cache lines PF_PAIRS pairs ahead (past the weight's end: a prefetch never
   faults): a loop of `vdpbf16ps` streams faster with these than with the hardware prefetchers
   alone. */
static inline void prefetch_pair(const uint16_t *wp) {
    const char *a = (const char *)(wp + PF_PAIRS * NB * 32);
    for (int b = 0; b < NB; b++) _mm_prefetch(a + b * 64, _MM_HINT_T0);
}

static inline __m512 dp(__m512 acc, __m512i w, __m512i x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
}

/* 16 weight pairs widened to float32: the even inputs' weights (each word's low half) and the
   odd inputs' (its high half), exact. */
static inline __m512 pair_even(__m512i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
static inline __m512 pair_odd(__m512i v) {
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* Adds the bias, rounds to bf16, stores the group's valid outputs (`valid` of 64). */
static inline void store(uint16_t *out, const __m512 *acc, const uint16_t *bias, int64_t valid) {
    for (int b = 0; b < NB; b++) {
        int64_t n = valid - b * 16;
        if (n <= 0) return;
        __mmask16 m = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
        __m512 v = acc[b];
        if (bias) {
            __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, bias + b * 16));
            v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
        }
        _mm256_mask_storeu_epi16(out + b * 16, m, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* One row: four pairs in flight (16 independent sums), added at the end. */
static void one_row(const uint32_t *x, const uint16_t *wg, int64_t pairs, __m512 *res) {
    __m512 a[4][NB];
    for (int u = 0; u < 4; u++)
        for (int b = 0; b < NB; b++) a[u][b] = _mm512_setzero_ps();
    int64_t p = 0;
    for (; p + 4 <= pairs; p += 4) {
        const uint16_t *wp = wg + p * NB * 32;
        for (int u = 0; u < 4; u++) prefetch_pair(wp + u * NB * 32);
        for (int u = 0; u < 4; u++) {
            __m512i xb = _mm512_set1_epi32((int)x[p + u]);
            for (int b = 0; b < NB; b++)
                a[u][b] = dp(a[u][b], _mm512_loadu_si512(wp + (u * NB + b) * 32), xb);
        }
    }
    for (; p < pairs; p++) {
        const uint16_t *wp = wg + p * NB * 32;
        __m512i xb = _mm512_set1_epi32((int)x[p]);
        for (int b = 0; b < NB; b++) a[0][b] = dp(a[0][b], _mm512_loadu_si512(wp + b * 32), xb);
    }
    for (int b = 0; b < NB; b++)
        res[b] = _mm512_add_ps(_mm512_add_ps(a[0][b], a[1][b]), _mm512_add_ps(a[2][b], a[3][b]));
}

/* RT rows at once: each weight load serves RT rows. */
#define TILE(RT)                                                                          \
static void tile##RT(const uint32_t *x, int64_t pairs, const uint16_t *wg, __m512 *res) { \
    __m512 acc[RT][NB];                                                                   \
    for (int i = 0; i < RT; i++)                                                          \
        for (int b = 0; b < NB; b++) acc[i][b] = _mm512_setzero_ps();                     \
    for (int64_t p = 0; p < pairs; p++) {                                                 \
        const uint16_t *wp = wg + p * NB * 32;                                            \
        prefetch_pair(wp);                                                                \
        __m512i wv[NB];                                                                   \
        for (int b = 0; b < NB; b++) wv[b] = _mm512_loadu_si512(wp + b * 32);             \
        for (int i = 0; i < RT; i++) {                                                    \
            __m512i xb = _mm512_set1_epi32((int)x[i * pairs + p]);                        \
            for (int b = 0; b < NB; b++) acc[i][b] = dp(acc[i][b], wv[b], xb);            \
        }                                                                                 \
    }                                                                                     \
    for (int i = 0; i < RT; i++)                                                          \
        for (int b = 0; b < NB; b++) res[i * NB + b] = acc[i][b];                         \
}
TILE(2)
TILE(3)
TILE(4)

/* The same tiles with float32 FMAs: each pair of weights widened to float32 once (its even
   input a shift, its odd one a mask) and used by every row of the tile, whose inputs were
   widened once per call (`xf`: [rows][k]). Each product is exact in float32 as in `vdpbf16ps`,
   and added in its order (the odd input's first), so the sums are the same but for float32
   denormals, which `vdpbf16ps` flushes. */
#define FTILE(RT)                                                                         \
static void ftile##RT(const float *xf, int64_t k, int64_t pairs, const uint16_t *wg,      \
                      __m512 *res) {                                                      \
    __m512 acc[RT][NB];                                                                   \
    for (int i = 0; i < RT; i++)                                                          \
        for (int b = 0; b < NB; b++) acc[i][b] = _mm512_setzero_ps();                     \
    for (int64_t p = 0; p < pairs; p++) {                                                 \
        const uint16_t *wp = wg + p * NB * 32;                                            \
        prefetch_pair(wp);                                                                \
        __m512 we[NB], wo[NB];                                                            \
        for (int b = 0; b < NB; b++) {                                                    \
            __m512i v = _mm512_loadu_si512(wp + b * 32);                                  \
            we[b] = pair_even(v);                                                         \
            wo[b] = pair_odd(v);                                                          \
        }                                                                                 \
        for (int i = 0; i < RT; i++) {                                                    \
            __m512 xo = _mm512_set1_ps(xf[i * k + 2 * p + 1]);                            \
            __m512 xe = _mm512_set1_ps(xf[i * k + 2 * p]);                                \
            for (int b = 0; b < NB; b++)                                                  \
                acc[i][b] = _mm512_fmadd_ps(we[b], xe, _mm512_fmadd_ps(wo[b], xo, acc[i][b])); \
        }                                                                                 \
    }                                                                                     \
    for (int i = 0; i < RT; i++)                                                          \
        for (int b = 0; b < NB; b++) res[i * NB + b] = acc[i][b];                         \
}
FTILE(2)
FTILE(3)
FTILE(4)

/* Prefill-sized calls (`WIDE_MIN` rows or more, FMA build): each group's weights are widened
   to float32 once per call into `wf` ([pairs][2][NB][16]: a pair's even input's 64 weights,
   then its odd input's), which stays in L2, and WROWS rows at a time multiply against it, so
   the vector ports do FMAs only (the tiles above widen each weight pair again for every tile
   of four rows). The same products added in the same order: the same sums. */
#define WROWS 5  /* 5 x 4 sums, 8 weight vectors and 2 inputs: 30 of 32 registers */
#define WIDE_MIN 64  /* fewer rows: widening the weights costs more than it saves */

static void widen_group(const uint16_t *wg, int64_t pairs, float *wf) {
    for (int64_t p = 0; p < pairs; p++) {
        const uint16_t *wp = wg + p * NB * 32;
        float *dst = wf + p * 2 * NB * 16;
        prefetch_pair(wp);
        for (int b = 0; b < NB; b++) {
            __m512i v = _mm512_loadu_si512(wp + b * 32);
            _mm512_store_ps(dst + b * 16, pair_even(v));
            _mm512_store_ps(dst + (NB + b) * 16, pair_odd(v));
        }
    }
}

/* WROWS rows (`xr`: their float32 inputs; a short tile repeats its last row) over a widened
   group. */
static void wide_tile(const float *const *xr, int64_t pairs, const float *wf, __m512 *res) {
    __m512 acc[WROWS][NB];
    for (int i = 0; i < WROWS; i++)
        for (int b = 0; b < NB; b++) acc[i][b] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const float *wp = wf + p * 2 * NB * 16;
        __m512 we[NB], wo[NB];
        for (int b = 0; b < NB; b++) {
            we[b] = _mm512_load_ps(wp + b * 16);
            wo[b] = _mm512_load_ps(wp + (NB + b) * 16);
        }
        for (int i = 0; i < WROWS; i++) {
            __m512 xo = _mm512_set1_ps(xr[i][2 * p + 1]);
            __m512 xe = _mm512_set1_ps(xr[i][2 * p]);
            for (int b = 0; b < NB; b++)
                acc[i][b] = _mm512_fmadd_ps(we[b], xe, _mm512_fmadd_ps(wo[b], xo, acc[i][b]));
        }
    }
    for (int i = 0; i < WROWS; i++)
        for (int b = 0; b < NB; b++) res[i * NB + b] = acc[i][b];
}

/* out[rows, o] = x[rows, k] . w^T (+ bias): x bf16 row-major (k even), w packed as
   [ceil(o/64)][k/2][64][2] bf16 (outputs past o are zero), bias bf16 [o] or NULL. `xf`:
   NULL, or x widened to float32 ([rows][k]) for the FMA tiles. */
static void linear(const uint16_t *x, const float *xf, const uint16_t *w, const uint16_t *bias,
                   uint16_t *out, int64_t rows, int64_t k, int64_t o) {
    int64_t pairs = k / 2, groups = (o + 63) / 64;
    const uint32_t *xw = (const uint32_t *)x;
    __m512 res[WROWS * NB];
    /* NULL (few rows, the vdpbf16ps build, or no memory): the tiles of up to four rows */
    float *wf = xf && rows >= WIDE_MIN
        ? (float *)aligned_alloc(64, (size_t)pairs * 2 * NB * 16 * sizeof(float)) : 0;
    for (int64_t g = 0; g < groups; g++) {
        const uint16_t *wg = w + g * pairs * NB * 32;
        const uint16_t *bg = bias ? bias + g * 64 : 0;
        int64_t valid = o - g * 64 < 64 ? o - g * 64 : 64;
        if (wf) {
            widen_group(wg, pairs, wf);
            for (int64_t r = 0; r < rows; r += WROWS) {
                int64_t n = rows - r >= WROWS ? WROWS : rows - r;
                const float *xr[WROWS];
                for (int64_t i = 0; i < WROWS; i++) xr[i] = xf + (r + (i < n ? i : n - 1)) * k;
                wide_tile(xr, pairs, wf, res);
                for (int64_t i = 0; i < n; i++)
                    store(out + (r + i) * o + g * 64, res + i * NB, bg, valid);
            }
            continue;
        }
        for (int64_t r = 0; r < rows;) {
            int64_t n = rows - r >= 4 ? 4 : rows - r;
            const uint32_t *xr = xw + r * pairs;
            if (xf && n > 1) {
                const float *xfr = xf + r * k;
                switch (n) {
                    case 4: ftile4(xfr, k, pairs, wg, res); break;
                    case 3: ftile3(xfr, k, pairs, wg, res); break;
                    default: ftile2(xfr, k, pairs, wg, res);
                }
            } else {
                switch (n) {
                    case 4: tile4(xr, pairs, wg, res); break;
                    case 3: tile3(xr, pairs, wg, res); break;
                    case 2: tile2(xr, pairs, wg, res); break;
                    default: one_row(xr, wg, pairs, res);
                }
            }
            for (int64_t i = 0; i < n; i++)
                store(out + (r + i) * o + g * 64, res + i * NB, bg, valid);
            r += n;
        }
    }
    free(wf);
}

void pair_linear(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *out,
                 int64_t rows, int64_t k, int64_t o) {
    linear(x, 0, w, bias, out, rows, k, o);
}

/* `pair_linear` with the FMA tiles for two rows or more (one row stays on `vdpbf16ps`). */
void pair_linear_fma(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *out,
                     int64_t rows, int64_t k, int64_t o) {
    /* NULL (one row, or no memory): the `vdpbf16ps` tiles */
    float *xf = rows > 1 ? (float *)malloc((size_t)(rows * k) * sizeof(float)) : 0;
    for (int64_t i = 0; xf && i < rows * k; i++) {
        uint32_t bits = (uint32_t)x[i] << 16;
        memcpy(xf + i, &bits, 4);
    }
    linear(x, xf, w, bias, out, rows, k, o);
    free(xf);
}
int pair_linear_available(void) { return 1; }

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* AMX: a tile multiply (`tdpbf16ps`) takes 16 rows x 32 inputs (A) against 16 input pairs x
   16 outputs of weights (B) into 16 x 16 float32 sums, products of bf16 pairs added in
   float32. B's layout is the pair layout's own: 16 outputs' pairs are 64 bytes of a pair's
   256-byte row of the group, so the weights are read where they lie, 4 KB of a group per step
   of 32 inputs, prefetched AMX_AHEAD bytes ahead. A block of up to 16 rows takes a group's
   64 outputs in tiles 0-3; the next block of rows reads the same group again from L2 (a
   group is 256 bytes per input pair: 72 KB at K = 576). */
#define AMX_K 32        /* inputs per tile step (a 64-byte row of A) */
#define AMX_AHEAD 4096  /* bytes of a group's weights between a prefetch and its tile load */

/* Tiles 0-3: sums [16 rows][16 outputs] of the group's four vectors of outputs; 4: A; 5, 6: B
   (`amx_configure(7)`). */

static inline float bf16_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Sixteen rows (`x`, `ld` elements apart) times one group's weights `wg` over `pairs` input
   pairs: the sums to c [16][64]. The first AMX_K-multiple of inputs in tiles, the rest (K not a
   multiple of 32) in scalar products, the odd input's first as in `vdpbf16ps`. */
static void amx_block(const uint16_t *x, int64_t ld, const uint16_t *wg, int64_t pairs,
                      float *c, int prefetch) {
    int64_t steps = 2 * pairs / AMX_K;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; s++) {
        const uint16_t *wp = wg + s * (AMX_K / 2) * NB * 32;
        if (prefetch)
            for (int l = 0; l < AMX_K / 2 * NB; l++)
                _mm_prefetch((const char *)wp + AMX_AHEAD + l * 64, _MM_HINT_T0);
        _tile_loadd(4, x + s * AMX_K, ld * 2);
        _tile_loadd(5, wp, NB * 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, wp + 32, NB * 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, wp + 64, NB * 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, wp + 96, NB * 64);
        _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, c, NB * 64);
    _tile_stored(1, c + 16, NB * 64);
    _tile_stored(2, c + 32, NB * 64);
    _tile_stored(3, c + 48, NB * 64);
    for (int64_t p = steps * AMX_K / 2; p < pairs; p++) {
        const uint16_t *wp = wg + p * NB * 32;
        for (int i = 0; i < 16; i++) {
            float xo = bf16_f32(x[i * ld + 2 * p + 1]), xe = bf16_f32(x[i * ld + 2 * p]);
            for (int n = 0; n < 64; n++) {
                c[i * 64 + n] += bf16_f32(wp[2 * n + 1]) * xo;
                c[i * 64 + n] += bf16_f32(wp[2 * n]) * xe;
            }
        }
    }
}

/* `pair_linear` in AMX tiles from two rows on (one row streams faster through `one_row`). The
   last block of fewer than 16 rows is a zero-padded copy. */
void pair_linear_amx(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                     uint16_t *out, int64_t rows, int64_t k, int64_t o) {
    int64_t pairs = k / 2, groups = (o + 63) / 64, full = rows / 16 * 16;
    uint16_t *pad = 0;
    if (rows == 1) {
        linear(x, 0, w, bias, out, rows, k, o);
        return;
    }
    if (rows > full) {
        pad = (uint16_t *)calloc((size_t)(16 * k), sizeof(uint16_t));
        if (!pad) {  /* no memory: the vdpbf16ps tiles */
            linear(x, 0, w, bias, out, rows, k, o);
            return;
        }
        memcpy(pad, x + full * k, (size_t)((rows - full) * k) * sizeof(uint16_t));
    }
    float c[16 * 64] __attribute__((aligned(64)));
    amx_configure(7);
    for (int64_t g = 0; g < groups; g++) {
        const uint16_t *wg = w + g * pairs * NB * 32;
        const uint16_t *bg = bias ? bias + g * 64 : 0;
        int64_t valid = o - g * 64 < 64 ? o - g * 64 : 64;
        for (int64_t r = 0; r < rows; r += 16) {
            int64_t n = rows - r < 16 ? rows - r : 16;
            amx_block(n == 16 ? x + r * k : pad, k, wg, pairs, c, r == 0);
            for (int64_t i = 0; i < n; i++) {
                __m512 acc[NB];
                for (int b = 0; b < NB; b++) acc[b] = _mm512_load_ps(c + i * 64 + b * 16);
                store(out + (r + i) * o + g * 64, acc, bg, valid);
            }
        }
    }
    _tile_release();
    free(pad);
}

/* Whether this process may use the tiles (Linux grants AMX's state only when asked). */
int pair_linear_amx_available(void) { return amx_granted(); }
#else
int pair_linear_amx_available(void) { return 0; }
#endif
#else
int pair_linear_available(void) { return 0; }
int pair_linear_amx_available(void) { return 0; }
#endif
