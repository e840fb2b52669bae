/* Decode attention over the KV pool in place (worker/kernels/decode_attention.py says how it
   works); built once for a bfloat16 pool and once with -DELEM_F32 for a float32 one. */
#define _DEFAULT_SOURCE  /* syscall(), for AMX's permission */
#include "bf16_scalars.h"
#include "element.h"
#include "avx512_exp.h"
#include "amx_tiles.h"

#include <stdlib.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define KB 32    /* keys per tile: the unit of scores, softmax and p @ V */
#define QB 6     /* queries per register block (G = 3: a sequence's, or two sequences') */
#define AHEAD 4  /* tiles between a slot's prefetch and its use */

/* Walks the slots of all segments in order, asking for their K and V rows (every head's)
   into L2 ahead of their use (a few tiles on the bf16 pair path, a block on the float32 one),
   across segment boundaries. The share owed is asked for a few lines at a time, spread over
   the work: in one burst, hundreds of prefetches stall the core (measured: 10-25% slower
   cold). */
typedef struct {
    const int64_t *slots, *seg;
    const char *kpool, *vpool;
    int64_t nseg, row;  /* row: bytes of one slot's K (or V), every head */
    int64_t s, t, b;    /* the next line: byte b of the rows of key t of segment s */
    int64_t due, step;  /* line pairs still owed; asked for per call */
} Prefetcher;

/* Ask for the next n (at most `due`) lines of K and V. */
static void prefetch(Prefetcher *pf, int64_t n) {
    n = n < pf->due ? n : pf->due;
    pf->due -= n;
    while (n > 0 && pf->s < pf->nseg) {
        const int64_t *sg = pf->seg + 4 * pf->s;
        if (pf->t >= sg[1]) {
            pf->s++;
            pf->t = 0;
            continue;
        }
        int64_t off = pf->slots[sg[0] + pf->t] * pf->row;
        int64_t end = pf->b + 64 * n < pf->row ? pf->b + 64 * n : pf->row;
        for (int64_t b = pf->b; b < end; b += 64) {
            __builtin_prefetch(pf->kpool + off + b, 0, 1);
            __builtin_prefetch(pf->vpool + off + b, 0, 1);
        }
        n -= (end - pf->b + 63) / 64;
        pf->b = end;
        if (pf->b >= pf->row) {
            pf->b = 0;
            pf->t++;
        }
    }
}

#if defined(__AVX512BF16__) && !defined(ELEM_F32)
/* Where the AVX512-BF16 pair products are. Keys go by in tiles of KB, every KV head's row of
   a slot at once: K transposed to pair words [D / 2, KB] per head (two dims of one key) for
   the scores; V read from the pool rows by p @ V itself and unpacked there into pair words
   (one dim of two keys). The unpacks work within 128-bit lanes, so a head's D dims sit in a
   fixed permuted order (`write_row`): the float32 accumulators keep that order and the output
   undoes it. */

/* out[n * stride + i] = word w0 + n of row i, for 16 rows (bf16 pairs as 32-bit words) and
   the nw <= 16 words from w0: a 16 x 16 transpose in three shuffle stages. */
static inline void transpose16(const uint16_t *const *rows, int64_t w0, int64_t nw,
                               uint32_t *out, int64_t stride) {
    __mmask16 m = nw >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nw) - 1u);
    __m512i r[16], t[16], u[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_maskz_loadu_epi32(m, rows[i] + 2 * w0);
    for (int i = 0; i < 8; i++) {  /* pairs of rows, word by word, in each 128-bit lane */
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  /* lane L of u[4i + c]: word 4L + c of rows 4i..4i+3 */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {  /* word 4L + c: lane L of u[c], u[4 + c], u[8 + c], ... */
        __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);
        __m512i x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
        __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        __m512i y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
        __m512i w[4] = {_mm512_shuffle_i32x4(x0, y0, 0x88), _mm512_shuffle_i32x4(x1, y1, 0x88),
                        _mm512_shuffle_i32x4(x0, y0, 0xDD), _mm512_shuffle_i32x4(x1, y1, 0xDD)};
        for (int l = 0; l < 4; l++)
            if (4 * l + c < nw) _mm512_storeu_si512(out + (4 * l + c) * stride, w[l]);
    }
}

/* out [D] = acc [D] * inv, rounded to bfloat16 (nearest even), acc in the unpacks' order: in
   each block of 32 positions (or the last 16), dims 8L..8L+3 of 128-bit lane L, then (the
   block's second half) dims 8L+4..8L+7. */
static void write_row(const float *acc, float inv, int64_t D, uint16_t *out) {
    const __m512i lo = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    const __m512i one = _mm512_set_epi32(15, 14, 13, 12, 7, 6, 5, 4, 11, 10, 9, 8, 3, 2, 1, 0);
    const __m512 vinv = _mm512_set1_ps(inv);
    for (int64_t d = 0; d < D; d += 16) {
        __m512 x;
        if (D - d >= 32 && d % 32 == 0)
            x = _mm512_permutex2var_ps(_mm512_loadu_ps(acc + d), lo, _mm512_loadu_ps(acc + d + 16));
        else if (d % 32)
            x = _mm512_permutex2var_ps(_mm512_loadu_ps(acc + d - 16), hi, _mm512_loadu_ps(acc + d));
        else
            x = _mm512_permutexvar_ps(one, _mm512_loadu_ps(acc + d));
        __m512i u = _mm512_castps_si512(_mm512_mul_ps(x, vinv));
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
        _mm256_storeu_si256((__m256i *)(out + d), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
    }
}

/* The tile's keys (nb <= KB, at slots sl; pool rows of KVH * D): K into kw [KVH, D / 2, KB]
   words (lanes past nb keep old words: their scores are masked); vr[j]: key j's V row, the
   last odd pair's second key repeating key 0 (its weight is zero, its value must be finite). */
static void load_tile(const uint16_t *kpool, const uint16_t *vpool, const int64_t *sl,
                      int64_t nb, int64_t KVH, int64_t D, uint32_t *kw, const uint16_t **vr) {
    const int64_t W = D / 2, row = KVH * D;
    for (int64_t j0 = 0; j0 < nb; j0 += 16) {
        const uint16_t *kr[16];
        for (int i = 0; i < 16; i++) kr[i] = kpool + sl[j0 + i < nb ? j0 + i : 0] * row;
        for (int64_t h = 0; h < KVH; h++)
            for (int64_t w0 = 0; w0 < W; w0 += 16)
                transpose16(kr, h * W + w0, W - w0 < 16 ? W - w0 : 16,
                            kw + (h * W + w0) * KB + j0, KB);
    }
    for (int64_t j = 0; j < nb + 1 && j < KB; j++) vr[j] = vpool + sl[j < nb ? j : 0] * row;
}

/* Scores of n <= QB queries (their bf16 rows as pair words, qw[r]) against the KB keys of kw
   [W, KB], scaled, into sc[r * KB + j]. */
static inline __attribute__((always_inline)) void score_block(
    int n, const uint32_t *const *qw, const uint32_t *kw, int64_t W, float scale, float *sc) {
    __m512 s[QB][KB / 16];
    for (int r = 0; r < n; r++)
        for (int c = 0; c < KB / 16; c++) s[r][c] = _mm512_setzero_ps();
    for (int64_t w = 0; w < W; w++) {
        __m512bh k[KB / 16];
        for (int c = 0; c < KB / 16; c++) k[c] = (__m512bh)_mm512_loadu_si512(kw + w * KB + 16 * c);
        for (int r = 0; r < n; r++) {
            __m512bh b = (__m512bh)_mm512_set1_epi32((int)qw[r][w]);
            for (int c = 0; c < KB / 16; c++) s[r][c] = _mm512_dpbf16_ps(s[r][c], b, k[c]);
        }
    }
    const __m512 vs = _mm512_set1_ps(scale);
    for (int r = 0; r < n; r++)
        for (int c = 0; c < KB / 16; c++)
            _mm512_storeu_ps(sc + r * KB + 16 * c, _mm512_mul_ps(s[r][c], vs));
}

static void score_queries(int64_t nq, const uint32_t *const *qw, const uint32_t *kw,
                          int64_t W, float scale, float *sc, Prefetcher *pf) {
    for (int64_t i = 0; i < nq; i += QB) {
        prefetch(pf, pf->step);
        const uint32_t *const *q = qw + i;
        float *o = sc + i * KB;
        switch (nq - i < QB ? nq - i : QB) {
        case 1: score_block(1, q, kw, W, scale, o); break;
        case 2: score_block(2, q, kw, W, scale, o); break;
        case 3: score_block(3, q, kw, W, scale, o); break;
        case 4: score_block(4, q, kw, W, scale, o); break;
        case 5: score_block(5, q, kw, W, scale, o); break;
        default: score_block(6, q, kw, W, scale, o); break;
        }
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* Where the core has AMX: a segment's scores for at least AMX_MIN_Q queries of a KV head in
   tiles (`tdpbf16ps`: 16 queries x 32 dims of A against 16 pairs of dims x 16 keys of B, the
   sums float32). The tile's K pair words [D / 2, KB] (`load_tile`) are B's layout as they lie;
   the queries' rows are copied into qa (16 rows of D / 2 words, zero past the last query). */
#define AMX_MIN_Q 4  /* fewer queries of a KV head over a segment take the vdpbf16ps path */

/* Whether this process may use the tiles. */
int decode_attention_amx(void) { return amx_granted(); }

static void score_queries_amx(int64_t nq, const uint32_t *const *qw, const uint32_t *kw,
                              int64_t W, float scale, float *sc, uint32_t *qa, Prefetcher *pf) {
    float c[16 * KB] __attribute__((aligned(64)));
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < nq; i += 16) {
        int64_t n = nq - i < 16 ? nq - i : 16;
        prefetch(pf, pf->step * ((n + QB - 1) / QB));  /* what score_queries asks for them */
        for (int64_t r = 0; r < n; r++) memcpy(qa + r * W, qw[i + r], sizeof(uint32_t) * W);
        if (n < 16) memset(qa + n * W, 0, sizeof(uint32_t) * W * (16 - n));
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t w = 0; w < W; w += 16) {
            _tile_loadd(2, qa + w, W * 4);
            _tile_loadd(3, kw + w * KB, KB * 4);
            _tile_dpbf16ps(0, 2, 3);
            _tile_loadd(4, kw + w * KB + 16, KB * 4);
            _tile_dpbf16ps(1, 2, 4);
        }
        _tile_stored(0, c, KB * 4);
        _tile_stored(1, c + 16, KB * 4);
        for (int64_t r = 0; r < n; r++)
            for (int k = 0; k < KB; k += 16)
                _mm512_storeu_ps(sc + (i + r) * KB + k,
                                 _mm512_mul_ps(_mm512_load_ps(c + r * KB + k), vs));
    }
}

/* p @ V of a head's nq queries over a tile in tiles: the tile's V rows of this head unpacked
   once into pair words vb [D / 16][KB / 2][16] (16 dims in `weigh_block`'s order, a pair of
   keys a row; zero past the tile's np pairs), the weights' rows as `softmax_row` left them in
   sc (pair words) as A, 16 queries at a time into ct [16][D]; each query's accumulator takes
   corr, then ct. sc has 16 rows of room past the last query. */
static void weigh_queries_amx(int64_t nq, const float *sc, int64_t np, const uint16_t *const *vr,
                              int64_t hd, int64_t D, float *const *acc, const float *corr,
                              uint32_t *vb, float *ct, Prefetcher *pf) {
    const int64_t NV = D / 16, PB = KB / 2 * 16;  /* words of one dims block */
    for (int64_t jp = 0; jp < KB / 2; jp++)
        for (int64_t c = 0; c < NV; c += 2) {
            __m512i lo = _mm512_setzero_si512(), hi = lo;
            if (jp < np) {
                __m512i va = _mm512_loadu_si512(vr[2 * jp] + hd + 16 * c);
                __m512i vc = _mm512_loadu_si512(vr[2 * jp + 1] + hd + 16 * c);
                lo = _mm512_unpacklo_epi16(va, vc);
                hi = _mm512_unpackhi_epi16(va, vc);
            }
            _mm512_storeu_si512(vb + c * PB + jp * 16, lo);
            _mm512_storeu_si512(vb + (c + 1) * PB + jp * 16, hi);
        }
    for (int64_t i = 0; i < nq; i += 16) {
        int64_t n = nq - i < 16 ? nq - i : 16;
        prefetch(pf, pf->step * ((n + QB - 1) / QB));  /* what weigh_queries asks for them */
        _tile_loadd(2, sc + i * KB, KB * 4);
        for (int64_t c = 0; c < NV; c++) {
            _tile_zero(0);
            _tile_loadd(3, vb + c * PB, 64);
            _tile_dpbf16ps(0, 2, 3);
            _tile_stored(0, ct + 16 * c, D * 4);
        }
        for (int64_t r = 0; r < n; r++) {
            float *a = acc[i + r];
            const __m512 f = _mm512_set1_ps(corr[i + r]);
            for (int64_t d = 0; d < D; d += 16)
                _mm512_storeu_ps(a + d, _mm512_fmadd_ps(_mm512_loadu_ps(a + d), f,
                                                        _mm512_loadu_ps(ct + r * D + d)));
        }
    }
}
#else
int decode_attention_amx(void) { return 0; }
#endif

/* One row's online softmax over a tile: scores sc[0..nb) -> its weights, rounded to bfloat16
   (as torch's flash kernel does), as 16 pair words in place; the running max *mx and sum
   vector *sv updated (the sum in float32, of the unrounded weights). Returns the factor the
   row's accumulator must take first (1 when the max stays). */
static inline float softmax_row(float *sc, int64_t nb, float *mx, float *sv) {
    const __m512 ninf = _mm512_set1_ps(-__builtin_inff()), mo = _mm512_set1_ps(*mx);
    __m512 s[KB / 16], top = ninf;
    __mmask16 m[KB / 16], up = 0;
    for (int c = 0; c < KB / 16; c++) {
        int64_t left = nb - 16 * c;
        m[c] = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1u) : 0;
        s[c] = _mm512_mask_loadu_ps(ninf, m[c], sc + 16 * c);
        up |= _mm512_cmp_ps_mask(s[c], mo, _CMP_GT_OQ);
    }
    float corr = 1.0f;
    __m512 sum = _mm512_loadu_ps(sv);
    if (up) {  /* a new max (rare after the first tiles) */
        for (int c = 0; c < KB / 16; c++) top = _mm512_max_ps(top, s[c]);
        float mt = _mm512_reduce_max_ps(top);
        corr = exp_f32(*mx - mt);
        sum = _mm512_mul_ps(sum, _mm512_set1_ps(corr));
        *mx = mt;
    }
    const __m512 vm = _mm512_set1_ps(*mx);
    for (int c = 0; c < KB / 16; c += 2) {
        __m512 e0 = _mm512_maskz_mov_ps(m[c], exp16(_mm512_sub_ps(s[c], vm)));
        __m512 e1 = _mm512_maskz_mov_ps(m[c + 1], exp16(_mm512_sub_ps(s[c + 1], vm)));
        sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
        /* word j: keys 2j, 2j+1 */
        _mm512_storeu_si512(sc + 8 * c, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    _mm512_storeu_ps(sv, sum);
    return corr;
}

/* acc_r = acc_r * corr_r + sum_j p_r[j] * v[j] for n <= QB queries over np key pairs, on
   NV vectors of 16 dims (from acc[r] + d; the values from vr[j] + vd): the weights as bf16
   pair words (pw[r]: [np]), the values unpacked into pairs of keys here (dims in `write_row`'s
   order), products exact, sums float32. */
static inline __attribute__((always_inline)) void weigh_block(
    int n, int NV, const uint32_t *const *pw, int64_t np, const uint16_t *const *vr, int64_t vd,
    float *const *acc, int64_t d, const float *corr, int rescale) {
    __m512 x[QB][4];
    for (int r = 0; r < n; r++)
        for (int c = 0; c < NV; c++) {
            x[r][c] = _mm512_loadu_ps(acc[r] + d + 16 * c);
            if (rescale) x[r][c] = _mm512_mul_ps(x[r][c], _mm512_set1_ps(corr[r]));
        }
    for (int64_t jp = 0; jp < np; jp++) {
        const uint16_t *a = vr[2 * jp] + vd, *b = vr[2 * jp + 1] + vd;
        __m512bh v[4];
        for (int c = 0; c + 1 < NV; c += 2) {
            __m512i va = _mm512_loadu_si512(a + 16 * c), vb = _mm512_loadu_si512(b + 16 * c);
            v[c] = (__m512bh)_mm512_unpacklo_epi16(va, vb);
            v[c + 1] = (__m512bh)_mm512_unpackhi_epi16(va, vb);
        }
        if (NV % 2) {
            __m256i va = _mm256_loadu_si256((const __m256i *)(a + 16 * (NV - 1)));
            __m256i vb = _mm256_loadu_si256((const __m256i *)(b + 16 * (NV - 1)));
            v[NV - 1] = (__m512bh)_mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_unpacklo_epi16(va, vb)),
                _mm256_unpackhi_epi16(va, vb), 1);
        }
        for (int r = 0; r < n; r++) {
            __m512bh w = (__m512bh)_mm512_set1_epi32((int)pw[r][jp]);
            for (int c = 0; c < NV; c++) x[r][c] = _mm512_dpbf16_ps(x[r][c], w, v[c]);
        }
    }
    for (int r = 0; r < n; r++)
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(acc[r] + d + 16 * c, x[r][c]);
}

static inline __attribute__((always_inline)) void weigh_dims(
    int n, const uint32_t *const *pw, int64_t np, const uint16_t *const *vr, int64_t hd,
    int64_t D, float *const *acc, const float *corr, int rescale) {
    for (int64_t d = 0; d < D; d += 64) {
        switch (D - d >= 64 ? 4 : (D - d) / 16) {
        case 1: weigh_block(n, 1, pw, np, vr, hd + d, acc, d, corr, rescale); break;
        case 2: weigh_block(n, 2, pw, np, vr, hd + d, acc, d, corr, rescale); break;
        case 3: weigh_block(n, 3, pw, np, vr, hd + d, acc, d, corr, rescale); break;
        default: weigh_block(n, 4, pw, np, vr, hd + d, acc, d, corr, rescale); break;
        }
    }
}

/* p @ V of a head's nq queries over a tile: vr[j] + hd is key j's V row of this head. */
static void weigh_queries(int64_t nq, const uint32_t *const *pw, int64_t np,
                          const uint16_t *const *vr, int64_t hd, int64_t D, float *const *acc,
                          const float *corr, Prefetcher *pf) {
    for (int64_t i = 0; i < nq; i += QB) {
        prefetch(pf, pf->step);
        int64_t n = nq - i < QB ? nq - i : QB;
        int rescale = 0;
        for (int64_t r = 0; r < n; r++) rescale |= corr[i + r] != 1.0f;
        const uint32_t *const *p = pw + i;
        float *const *a = acc + i;
        switch (n) {
        case 1: weigh_dims(1, p, np, vr, hd, D, a, corr + i, rescale); break;
        case 2: weigh_dims(2, p, np, vr, hd, D, a, corr + i, rescale); break;
        case 3: weigh_dims(3, p, np, vr, hd, D, a, corr + i, rescale); break;
        case 4: weigh_dims(4, p, np, vr, hd, D, a, corr + i, rescale); break;
        case 5: weigh_dims(5, p, np, vr, hd, D, a, corr + i, rescale); break;
        default: weigh_dims(6, p, np, vr, hd, D, a, corr + i, rescale); break;
        }
    }
}

/* q [B, H, D], pools [S, KVH, D], out [B, H, D]: bfloat16 bits; D a multiple of 16.
   seg [nseg, 4]: offset into `slots`, key count, offset into `members`, member count.
   state: float32 [B * H * (D + 2)]: accumulators [B * H, D], then the running
   max [B * H] and sum [B * H]. Returns 0, or 1 when out of memory. */
int decode_attention(const uint16_t *q, const uint16_t *kpool, const uint16_t *vpool,
                     const int64_t *slots, const int64_t *seg, const int64_t *members,
                     int64_t nseg, int64_t B, int64_t H, int64_t KVH, int64_t D, float scale,
                     float *state, uint16_t *out) {
    const int64_t G = H / KVH, W = D / 2;
    int64_t max_nq = 1;  /* queries of one KV head in a segment */
    for (int64_t s = 0; s < nseg; s++)
        if (seg[4 * s + 3] * G > max_nq) max_nq = seg[4 * s + 3] * G;
    const int64_t nrows = KVH * max_nq;
    /* kw, sc (16 rows of room), corr, sv, then the AMX paths' qa, vb and ct */
    size_t words = KVH * W * KB + (nrows + 16) * KB + nrows + B * H * 16 + 16 * W + W * KB
                   + 16 * D;
    uint32_t *buf = aligned_alloc(64, ((sizeof(uint32_t) * words + 63) / 64) * 64);
    void **ptrs = malloc(sizeof(void *) * (5 * nrows + KB));
    if (!buf || !ptrs) {
        free(buf);
        free(ptrs);
        return 1;
    }
    memset(buf, 0, sizeof(uint32_t) * KVH * W * KB);  /* K lanes past a short first tile */
    uint32_t *kw = buf;
    float *sc = (float *)(kw + KVH * W * KB), *corr = sc + (nrows + 16) * KB;
    float *sv = corr + nrows;
    memset(sc + nrows * KB, 0, sizeof(float) * 16 * KB);
    uint32_t *qa = (uint32_t *)(sv + B * H * 16), *vb = qa + 16 * W;
    float *ct = (float *)(vb + W * KB);  /* vb: D / 16 blocks of KB / 2 x 16 words */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    const int amx = W % 16 == 0 && max_nq >= AMX_MIN_Q && decode_attention_amx();
    if (amx) amx_configure(5);  /* 0, 1: scores (or 0: p @ V); 2: A; 3, 4: B */
#else
    (void)qa, (void)vb, (void)ct;
#endif
    const uint32_t **qw = (const uint32_t **)ptrs, **pw = qw + nrows;
    float **accs = (float **)(pw + nrows), **svs = accs + nrows;
    float **mxs = svs + nrows;
    const uint16_t **vr = (const uint16_t **)(mxs + nrows);
    float *acc = state, *mx = state + B * H * D, *sum = mx + B * H;
    memset(acc, 0, sizeof(float) * B * H * D);
    memset(sv, 0, sizeof(float) * B * H * 16);
    for (int64_t i = 0; i < B * H; i++) mx[i] = -1e30f;
    for (int64_t i = 0; i < nrows; i++) pw[i] = (const uint32_t *)(sc + i * KB);
    const int64_t row = KVH * D * 2, lines = (row + 63) / 64;  /* per slot, of K and of V */
    Prefetcher pf = {slots, seg, (const char *)kpool, (const char *)vpool, nseg, row, 0, 0, 0,
                     KB * lines, 0};
    int64_t ramp = (AHEAD - 1) * KB * lines;  /* the rest of the distance, a tile at a time */
    prefetch(&pf, pf.due);
    for (int64_t s = 0; s < nseg; s++) {
        const int64_t *sl = slots + seg[4 * s], nkeys = seg[4 * s + 1];
        const int64_t *mem = members + seg[4 * s + 2], nq = seg[4 * s + 3] * G;
        for (int64_t h = 0; h < KVH; h++)
            for (int64_t i = 0; i < nq; i++) {
                int64_t row = mem[i / G] * H + h * G + i % G;
                qw[h * nq + i] = (const uint32_t *)(q + row * D);
                accs[h * nq + i] = acc + row * D;
                svs[h * nq + i] = sv + row * 16;
                mxs[h * nq + i] = mx + row;
            }
        const int64_t calls = 1 + 2 * KVH * ((nq + QB - 1) / QB);  /* prefetches per tile */
        for (int64_t t0 = 0; t0 < nkeys; t0 += KB) {
            int64_t nb = nkeys - t0 < KB ? nkeys - t0 : KB;
            int64_t more = ramp < KB * lines ? ramp : KB * lines;
            ramp -= more;
            pf.due += nb * lines + more;
            pf.step = (nb * lines + more + calls - 1) / calls;
            prefetch(&pf, pf.step);
            load_tile(kpool, vpool, sl + t0, nb, KVH, D, kw, vr);
            for (int64_t h = 0; h < KVH; h++) {
                const int64_t r0 = h * nq;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
                if (amx && nq >= AMX_MIN_Q)
                    score_queries_amx(nq, qw + r0, kw + h * W * KB, W, scale, sc + r0 * KB, qa,
                                      &pf);
                else
#endif
                    score_queries(nq, qw + r0, kw + h * W * KB, W, scale, sc + r0 * KB, &pf);
                for (int64_t i = r0; i < r0 + nq; i++)
                    corr[i] = softmax_row(sc + i * KB, nb, mxs[i], svs[i]);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
                if (amx && nq >= AMX_MIN_Q)
                    weigh_queries_amx(nq, sc + r0 * KB, (nb + 1) / 2, vr, h * D, D, accs + r0,
                                      corr + r0, vb, ct, &pf);
                else
#endif
                    weigh_queries(nq, pw + r0, (nb + 1) / 2, vr, h * D, D, accs + r0,
                                  corr + r0, &pf);
            }
            prefetch(&pf, pf.due);
        }
    }
    for (int64_t i = 0; i < B * H; i++) {
        sum[i] = _mm512_reduce_add_ps(_mm512_loadu_ps(sv + i * 16));
        write_row(acc + i * D, 1.0f / sum[i], D, out + i * D);
    }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx) _tile_release();
#endif
    free(buf);
    free(ptrs);
    return 0;
}
#else
int decode_attention_amx(void) { return 0; }

/* Elsewhere, and for a float32 pool: float32 vectors of VW lanes (float_vectors.h),
   keys in softmax blocks of about PF_BYTES of rows, every KV head over a block before the next
   block, the rows of the block after asked for (`Prefetcher`) over the block's work. */
#include "float_vectors.h"

#define KVS 256           /* the most keys of a softmax block */
#define PF_BYTES 196608  /* K and V rows of a block: it and the next one, asked for, fit in L2 */
#define DOT_QUERIES 8  /* segments of up to this many queries per KV head take dot products */
#if VW == 16
#define PV_QUERIES 4  /* queries per pass of p @ V over a block's value rows */
#define PV_MANY 4     /* the same for many queries (weights keys x queries) */
#else
#define PV_QUERIES 2
#define PV_MANY 2
#endif
#define SK 3        /* keys per pass of the many queries' scores */
#define PV_KEYS 32  /* keys per chunk of the many queries' p @ V */
/* The largest of p[0..n), n >= 1. */
static inline float max_of(const float *p, int64_t n) {
    int64_t j = 0;
    float m = p[0];
    if (n >= VW) {
        vf mv = *(const vfu *)p;
        for (j = VW; j + VW <= n; j += VW) {
            vf x = *(const vfu *)(p + j);
            vi gt = x > mv;
            mv = (vf)(((vi)x & gt) | ((vi)mv & ~gt));
        }
        for (int l = 0; l < VW; l++) m = mv[l] > m ? mv[l] : m;
    }
    for (; j < n; j++) m = p[j] > m ? p[j] : m;
    return m;
}

/* The scores of SK keys (rows k[t], n <= SK of them wanted) against NC vectors of queries
   (from vector c of qt [D, NV vectors]), each key's dims broadcast against the queries'
   lanes, into st[t * nqp + ...]: scores keys x queries, as the softmax over many queries and
   their p @ V read them. */
static inline __attribute__((always_inline)) void score_keys(
    int NC, const vf *qtv, int64_t NV, int64_t c, const float *const *k, int64_t n, int64_t D,
    float *st, int64_t nqp) {
    vf s[SK][3] = {{{0}}};
    for (int64_t d = 0; d < D; d++) {
        vf qv[3];
        for (int x = 0; x < NC; x++) qv[x] = qtv[d * NV + c + x];
        for (int t = 0; t < SK; t++) {
            float kd = k[t][d];
            for (int x = 0; x < NC; x++) s[t][x] += kd * qv[x];
        }
    }
    for (int t = 0; t < SK; t++)
        if (t < n)
            for (int x = 0; x < NC; x++) *(vfu *)(st + t * nqp + (c + x) * VW) = s[t][x];
}

/* Scores of many queries (qt [D, nqp], transposed, zero past the last) against the nb keys of
   rows kf[0..nb) into st [nb rows of nqp]: SK keys at a time against up to 3 vectors of
   queries (their registers and the scores' fit in AVX2's 16), no transposes (the scores stay
   keys x queries). */
static void score_many(const float *qt, int64_t nqp, const float *const *kf, int64_t nb,
                       int64_t D, float *st, Prefetcher *pf) {
    const vf *qtv = (const vf *)qt;
    const int64_t NV = nqp / VW;
    for (int64_t j = 0; j < nb; j += SK) {
        prefetch(pf, pf->step);
        const float *k[SK];
        for (int t = 0; t < SK; t++) k[t] = kf[j + t < nb ? j + t : j];
        int64_t n = nb - j < SK ? nb - j : SK, c = 0;
        float *o = st + j * nqp;
        for (; c + 3 <= NV; c += 3) score_keys(3, qtv, NV, c, k, n, D, o, nqp);
        if (NV - c == 2) score_keys(2, qtv, NV, c, k, n, D, o, nqp);
        if (NV - c == 1) score_keys(1, qtv, NV, c, k, n, D, o, nqp);
    }
}

/* The online softmax of many queries over a block's scores st [nbk rows of nqp], on vectors
   of queries: the running max m and sum l [nqp] updated, st turned into the weights (in the
   pool's precision, summed in float32), corr [nqp]: the factor the accumulators take first. */
static void softmax_many(float *st, int64_t nbk, int64_t nqp, float *m, float *l, float *corr) {
    for (int64_t c = 0; c < nqp; c += VW) {
        vf mb = *(vfu *)(st + c);
        for (int64_t j = 1; j < nbk; j++) {
            vf x = *(vfu *)(st + j * nqp + c);
            mb = blend(x > mb, x, mb);
        }
        vf mo = *(vfu *)(m + c), mn = blend(mb > mo, mb, mo), sum = {0};
        vf cf = exp_v(mo - mn);
        for (int64_t j = 0; j < nbk; j++) {
            vfu *p = (vfu *)(st + j * nqp + c);
            vf e = exp_v(*p - mn);
            sum += e;
            *p = e;
        }
        *(vfu *)(m + c) = mn;
        *(vfu *)(l + c) = *(vfu *)(l + c) * cf + sum;
        *(vfu *)(corr + c) = cf;
    }
#ifndef ELEM_F32
    for (int64_t j = 0; j < nbk; j++)
        for (int64_t c = 0; c < nqp; c++) st[j * nqp + c] = E_ROUND(st[j * nqp + c]);
#endif
}

/* acc_w [NB vectors from dv] += sum_j st[j * nqp + w] * vr[j] [the same] for NW queries
   (acc_w: aw[w]) over keys j0..j1, each value vector read once for all NW. */
static inline __attribute__((always_inline)) void weigh_keys(
    int NW, int NB, const float *st, int64_t nqp, int64_t j0, int64_t j1,
    const float *const *vr, int64_t dv, vfu *const *aw) {
    vf x[4][4];
    for (int w = 0; w < NW; w++)
        for (int b = 0; b < NB; b++) x[w][b] = aw[w][dv + b];
    for (int64_t j = j0; j < j1; j++) {
        const vfu *v = (const vfu *)vr[j] + dv;
        for (int w = 0; w < NW; w++) {
            float p = st[j * nqp + w];
            for (int b = 0; b < NB; b++) x[w][b] += p * v[b];
        }
    }
    for (int w = 0; w < NW; w++)
        for (int b = 0; b < NB; b++) aw[w][dv + b] = x[w][b];
}

/* weigh_keys over all DV vectors of dims: four at a time, then the rest. */
static inline __attribute__((always_inline)) void weigh_dims_f(
    int NW, const float *st, int64_t nqp, int64_t j0, int64_t j1, const float *const *vr,
    int64_t DV, vfu *const *aw) {
    int64_t dv = 0;
    for (; dv + 4 <= DV; dv += 4) weigh_keys(NW, 4, st, nqp, j0, j1, vr, dv, aw);
    switch (DV - dv) {
    case 3: weigh_keys(NW, 3, st, nqp, j0, j1, vr, dv, aw); break;
    case 2: weigh_keys(NW, 2, st, nqp, j0, j1, vr, dv, aw); break;
    case 1: weigh_keys(NW, 1, st, nqp, j0, j1, vr, dv, aw); break;
    }
}

/* p @ V of many queries over a block: each query's accumulator (aw[i], D / VW vectors) takes
   corr[i], then the weights st [nbk rows of nqp] times the value rows vr[0..nbk), in chunks of
   PV_KEYS keys (one head's rows of a chunk stay in L1 while every query passes over them),
   PV_MANY queries per pass. */
static void weigh_many(const float *st, int64_t nbk, int64_t nq, int64_t nqp,
                       const float *const *vr, int64_t DV, vfu *const *aw, const float *corr,
                       Prefetcher *pf) {
    for (int64_t i = 0; i < nq; i++)
        if (corr[i] != 1.0f)
            for (int64_t dv = 0; dv < DV; dv++) aw[i][dv] *= corr[i];
    for (int64_t j0 = 0; j0 < nbk; j0 += PV_KEYS) {
        int64_t j1 = nbk - j0 < PV_KEYS ? nbk : j0 + PV_KEYS;
        int64_t i = 0;
        for (; i + PV_MANY <= nq; i += PV_MANY) {
            prefetch(pf, pf->step);
            weigh_dims_f(PV_MANY, st + i, nqp, j0, j1, vr, DV, aw + i);
        }
        for (; i < nq; i++) weigh_dims_f(1, st + i, nqp, j0, j1, vr, DV, aw + i);
    }
}

/* Scores of the nq queries against nb <= KB keys at slots sl, head h: up to DOT_QUERIES into
   sc[i * KVS + j] (for j up to nb rounded up to VW), more keys x queries into sc[j * nqp + i]
   (`score_many`); each key's rows as float32: K into kf[j] and V into vr[j],
   the pool's own rows (float32 pool) or their copies in kt and vt [KB, D]. The queries come
   scaled, as rows qf [nq, D] and, where nq > DOT_QUERIES, transposed as qt [D, nqp] (nqp a
   multiple of VW, zero past nq). */
static void score_tile(const float *qf, const float *qt, int64_t nq, int64_t nqp,
                       const elem_t *kpool, const elem_t *vpool, const int64_t *sl, int64_t nb,
                       int64_t KVH, int64_t h, int64_t D, float *kt, const float **vr,
                       float *vt, float *sc, Prefetcher *pf) {
    const int64_t DV = D / VW;
    const float *kf[KB];
    if (nq <= DOT_QUERIES) prefetch(pf, pf->step);  /* (many queries: every SK keys) */
    for (int64_t j = 0; j < KB; j++) {  /* a short tile repeats its first key (unused) */
        int64_t off = (sl[j < nb ? j : 0] * KVH + h) * D;
#ifdef ELEM_F32
        kf[j] = kpool + off;
        vr[j] = vpool + off;
#else
        for (int64_t d = 0; d < D; d++) {
            kt[j * D + d] = E_LOAD(kpool[off + d]);
            vt[j * D + d] = E_LOAD(vpool[off + d]);
        }
        kf[j] = kt + j * D;
        vr[j] = vt + j * D;
#endif
    }
    if (nq <= DOT_QUERIES) {  /* few queries: VW keys' products at once, then their sums */
        for (int64_t j0 = 0; j0 < nb; j0 += VW)
            for (int64_t i = 0; i < nq; i++) {
                const vf *qv = (const vf *)(qf + i * D);
                vf t[VW];
                /* the VW keys' sums side by side, a vector of dims at a time: VW chains of
                   adds in flight (one key's chain at a time waited out each add's latency) */
                for (int j = 0; j < VW; j++) t[j] = qv[0] * ((const vfu *)kf[j0 + j])[0];
                for (int64_t dv = 1; dv < DV; dv++) {
                    vf qd = qv[dv];
                    for (int j = 0; j < VW; j++) t[j] += qd * ((const vfu *)kf[j0 + j])[dv];
                }
                *(vfu *)(sc + i * KVS + j0) = row_sums(t);
            }
        return;
    }
    score_many(qt, nqp, kf, nb, D, sc, pf);
}

/* For NW queries w at once: acc_w [DV vectors] = acc_w * corr_w + sum_j p_w[j] * vr[j], four
   vectors of dims per pass over the rows, each row read once for all NW: from L2 a row costs
   more than the NW x 4 products it feeds. */
#define WEIGH(NAME, NW)                                                                    \
static void NAME(float *const *p, int64_t n, const float *const *vr, int64_t DV,          \
                 vfu *const *acc, const float *corr) {                                    \
    int64_t dv = 0;                                                                        \
    for (; dv + 4 <= DV; dv += 4) {                                                        \
        vf x[NW][4];                                                                       \
        for (int w = 0; w < NW; w++)                                                       \
            for (int b = 0; b < 4; b++) x[w][b] = acc[w][dv + b] * corr[w];               \
        for (int64_t j = 0; j < n; j++) {                                                  \
            const vfu *v = (const vfu *)vr[j] + dv;                                        \
            vf v0 = v[0], v1 = v[1], v2 = v[2], v3 = v[3];                                 \
            for (int w = 0; w < NW; w++) {                                                 \
                float pw = p[w][j];                                                        \
                x[w][0] += pw * v0;                                                        \
                x[w][1] += pw * v1;                                                        \
                x[w][2] += pw * v2;                                                        \
                x[w][3] += pw * v3;                                                        \
            }                                                                              \
        }                                                                                  \
        for (int w = 0; w < NW; w++)                                                       \
            for (int b = 0; b < 4; b++) acc[w][dv + b] = x[w][b];                          \
    }                                                                                      \
    for (; dv < DV; dv++) {                                                                \
        vf x[NW];                                                                          \
        for (int w = 0; w < NW; w++) x[w] = acc[w][dv] * corr[w];                          \
        for (int64_t j = 0; j < n; j++) {                                                  \
            vf v = ((const vfu *)vr[j])[dv];                                               \
            for (int w = 0; w < NW; w++) x[w] += p[w][j] * v;                              \
        }                                                                                  \
        for (int w = 0; w < NW; w++) acc[w][dv] = x[w];                                    \
    }                                                                                      \
}
WEIGH(weigh_values1, 1)
WEIGH(weigh_values_many, PV_QUERIES)

int decode_attention(const elem_t *q, const elem_t *kpool, const elem_t *vpool,
                     const int64_t *slots, const int64_t *seg, const int64_t *members,
                     int64_t nseg, int64_t B, int64_t H, int64_t KVH, int64_t D, float scale,
                     float *state, elem_t *out) {
    const int64_t G = H / KVH;
    int64_t max_nq = 16;
    for (int64_t s = 0; s < nseg; s++)
        if (seg[4 * s + 3] * G > max_nq) max_nq = seg[4 * s + 3] * G;
    max_nq = (max_nq + 15) / 16 * 16;
#ifdef ELEM_F32
    const int64_t tile_floats = 0, vt_floats = 0;  /* rows are read where they lie */
#else
    const int64_t tile_floats = KB * D;  /* float32 copies of a tile's key rows */
    const int64_t vt_floats = KVS * D;   /* and of a block's value rows */
#endif
    /* qf, qt; kt, vt; sc; the many queries' max and sum per head (ml), and their corr */
    size_t floats = 2 * KVH * max_nq * D + tile_floats + vt_floats + max_nq * KVS
                    + 2 * KVH * max_nq + max_nq;
    float *buf = aligned_alloc(64, ((sizeof(float) * floats + 63) / 64) * 64);
    int64_t *rows = malloc(sizeof(int64_t) * KVH * max_nq);
    const float **vr = malloc(sizeof(float *) * KVS);  /* a block's value rows */
    vfu **accs = malloc(sizeof(vfu *) * KVH * max_nq);  /* the many queries' accumulators */
    if (!buf || !rows || !vr || !accs) {
        free(buf);
        free(rows);
        free(vr);
        free(accs);
        return 1;
    }
    float *qf = buf, *qt = qf + KVH * max_nq * D, *kt = qt + KVH * max_nq * D;
    float *vt = kt + tile_floats;
    float *sc = vt + vt_floats;  /* few queries: [nq, KVS]; many: [KVS, nqp] */
    float *ml = sc + max_nq * KVS, *cf = ml + 2 * KVH * max_nq;
    float *acc = state, *mx = state + B * H * D, *sum = mx + B * H;
    memset(acc, 0, sizeof(float) * B * H * D);
    for (int64_t i = 0; i < B * H; i++) {
        mx[i] = -1e30f;
        sum[i] = 0.0f;
    }
    const int64_t row_bytes = KVH * D * (int64_t)sizeof(elem_t), lines = (row_bytes + 63) / 64;
    int64_t kvs = PF_BYTES / (2 * row_bytes) / KB * KB;  /* keys of a block */
    kvs = kvs < KB ? KB : kvs > KVS ? KVS : kvs;
    /* the rows of the block after the one being read, spread over its work */
    Prefetcher pf = {slots, seg, (const char *)kpool, (const char *)vpool, nseg, row_bytes,
                     0, 0, 0, kvs * lines, 0};
    prefetch(&pf, pf.due);  /* the first block's, at once */
    for (int64_t s = 0; s < nseg; s++) {
        const int64_t *sl = slots + seg[4 * s], nkeys = seg[4 * s + 1];
        const int64_t *mem = members + seg[4 * s + 2], nq = seg[4 * s + 3] * G;
        const int64_t nqp = (nq + VW - 1) / VW * VW;
        for (int64_t h = 0; h < KVH; h++) {  /* the segment's queries of head group h */
            float *qfh = qf + h * max_nq * D, *qth = qt + h * max_nq * D;
            for (int64_t i = 0; i < nq; i++) {
                int64_t row = mem[i / G] * H + h * G + i % G;
                rows[h * max_nq + i] = row;
                for (int64_t d = 0; d < D; d++) qfh[i * D + d] = E_LOAD(q[row * D + d]) * scale;
            }
            if (nq > DOT_QUERIES) {  /* and transposed, zero past nq; their max and sum */
                for (int64_t d = 0; d < D; d++)
                    for (int64_t i = 0; i < nqp; i++)
                        qth[d * nqp + i] = i < nq ? qfh[i * D + d] : 0.0f;
                float *m = ml + 2 * h * max_nq, *l = m + max_nq;
                for (int64_t i = 0; i < nqp; i++) {
                    int64_t row = rows[h * max_nq + (i < nq ? i : 0)];
                    m[i] = i < nq ? mx[row] : -1e30f;
                    l[i] = i < nq ? sum[row] : 0.0f;
                    accs[h * max_nq + i] = (vfu *)(acc + row * D);
                }
            }
        }
        for (int64_t b0 = 0; b0 < nkeys; b0 += kvs) {
            int64_t nbk = nkeys - b0 < kvs ? nkeys - b0 : kvs, tiles = (nbk + KB - 1) / KB;
            int64_t calls = KVH * (nq <= DOT_QUERIES ? tiles  /* prefetch calls in the block */
                                   : tiles * ((KB + SK - 1) / SK)
                                         + (nbk + PV_KEYS - 1) / PV_KEYS * (nq / PV_MANY));
            pf.due += nbk * lines;
            pf.step = (pf.due + calls - 1) / calls;
            for (int64_t h = 0; h < KVH; h++) {
                const float *qfh = qf + h * max_nq * D, *qth = qt + h * max_nq * D;
                const int64_t *rh = rows + h * max_nq;
                for (int64_t t0 = 0; t0 < nbk; t0 += KB)
                    score_tile(qfh, qth, nq, nqp, kpool, vpool, sl + b0 + t0,
                               nbk - t0 < KB ? nbk - t0 : KB, KVH, h, D, kt, vr + t0,
                               vt + t0 * D, nq > DOT_QUERIES ? sc + t0 * nqp : sc + t0, &pf);
                if (nq > DOT_QUERIES) {  /* on vectors of queries */
                    float *m = ml + 2 * h * max_nq;
                    softmax_many(sc, nbk, nqp, m, m + max_nq, cf);
                    weigh_many(sc, nbk, nq, nqp, vr, D / VW, accs + h * max_nq, cf, &pf);
                    continue;
                }
                float *pw[PV_QUERIES], cw[PV_QUERIES];  /* p @ V PV_QUERIES at a time */
                vfu *aw[PV_QUERIES];
                int nw = 0;
                for (int64_t i = 0; i < nq; i++) {  /* online softmax, then p @ V */
                    float *p = sc + i * KVS, mb = max_of(p, nbk);
                    int64_t row = rh[i];
                    float m_new = mx[row] > mb ? mx[row] : mb;
                    float corr = exp_f32(mx[row] - m_new), psum = 0.0f;
                    /* summed in float32, the weights in the pool's precision (bf16: as torch's
                       flash kernel does) */
                    vf vsum = {0};
                    int64_t j = 0;
                    for (; j + VW <= nbk; j += VW) {
                        vf e = exp_v(*(vfu *)(p + j) - m_new);
                        vsum += e;
                        *(vfu *)(p + j) = e;
                    }
                    for (int l = 0; l < VW; l++) psum += vsum[l];
                    for (; j < nbk; j++) {
                        p[j] = exp_f32(p[j] - m_new);
                        psum += p[j];
                    }
#ifndef ELEM_F32
                    for (j = 0; j < nbk; j++) p[j] = E_ROUND(p[j]);
#endif
                    mx[row] = m_new;
                    sum[row] = sum[row] * corr + psum;
                    pw[nw] = p;
                    aw[nw] = (vfu *)(acc + row * D);
                    cw[nw++] = corr;
                    if (nw == PV_QUERIES) {
                        weigh_values_many(pw, nbk, vr, D / VW, aw, cw);
                        nw = 0;
                    }
                }
                for (int w = 0; w < nw; w++)
                    weigh_values1(pw + w, nbk, vr, D / VW, aw + w, cw + w);
            }
        }
        if (nq > DOT_QUERIES)  /* the many queries' max and sum back to their rows */
            for (int64_t h = 0; h < KVH; h++)
                for (int64_t i = 0; i < nq; i++) {
                    int64_t row = rows[h * max_nq + i];
                    mx[row] = ml[2 * h * max_nq + i];
                    sum[row] = ml[(2 * h + 1) * max_nq + i];
                }
    }
    for (int64_t i = 0; i < B * H; i++) {
        float inv = 1.0f / sum[i];
        for (int64_t d = 0; d < D; d++) out[i * D + d] = E_STORE(acc[i * D + d] * inv);
    }
    free(buf);
    free(rows);
    free(vr);
    free(accs);
    return 0;
}
#endif
