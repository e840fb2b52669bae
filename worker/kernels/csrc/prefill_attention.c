/* Prefill attention over the KV pool in bfloat16, AVX512-BF16 (worker/kernels/
   prefill_attention.py says how it works). */
#include "avx512_exp.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512BF16__
#include <immintrin.h>

#define KB 32   /* keys per packed block */
#define SB 512  /* keys per softmax span */

static inline __m512 dp(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* Scores of 8 query rows (qw: [8][D2] pair words) against one packed key block (kw:
   [D2][32] words), times scale, into s (row stride ss). */
static inline void score8(const uint32_t *qw, int64_t D2, const uint32_t *kw, float scale,
                          float *s, int64_t ss) {
    __m512 a[8][2];
    for (int r = 0; r < 8; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int64_t w = 0; w < D2; w++) {
        __m512i k0 = _mm512_loadu_si512(kw + w * KB), k1 = _mm512_loadu_si512(kw + w * KB + 16);
        for (int r = 0; r < 8; r++) {
            __m512i b = _mm512_set1_epi32((int)qw[r * D2 + w]);
            a[r][0] = dp(a[r][0], b, k0);
            a[r][1] = dp(a[r][1], b, k1);
        }
    }
    __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < 8; r++) {
        _mm512_storeu_ps(s + r * ss, _mm512_mul_ps(a[r][0], sc));
        _mm512_storeu_ps(s + r * ss + 16, _mm512_mul_ps(a[r][1], sc));
    }
}

/* acc[r] = acc[r] * corr[r] + p[r] . V for 4 rows: pw the rows' weights as pair words (row
   stride ps), vw [np][D] pair words of values, acc [4][D] float32 (D a multiple of 64). */
static inline void weigh4(const uint32_t *pw, int64_t ps, const uint32_t *vw, int64_t np,
                          int64_t D, float *acc, const float *corr) {
    for (int64_t d = 0; d < D; d += 64) {
        __m512 x[4][4];
        for (int r = 0; r < 4; r++) {
            __m512 c = _mm512_set1_ps(corr[r]);
            for (int u = 0; u < 4; u++)
                x[r][u] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d + 16 * u), c);
        }
        for (int64_t jp = 0; jp < np; jp++) {
            const uint32_t *v = vw + jp * D + d;
            __m512i v0 = _mm512_loadu_si512(v), v1 = _mm512_loadu_si512(v + 16);
            __m512i v2 = _mm512_loadu_si512(v + 32), v3 = _mm512_loadu_si512(v + 48);
            for (int r = 0; r < 4; r++) {
                __m512i b = _mm512_set1_epi32((int)pw[r * ps + jp]);
                x[r][0] = dp(x[r][0], b, v0);
                x[r][1] = dp(x[r][1], b, v1);
                x[r][2] = dp(x[r][2], b, v2);
                x[r][3] = dp(x[r][3], b, v3);
            }
        }
        for (int r = 0; r < 4; r++)
            for (int u = 0; u < 4; u++) _mm512_storeu_ps(acc + r * D + d + 16 * u, x[r][u]);
    }
}


/* 16 rows of 16 words (row i at src[i]) transposed: word w of row i to dst[w * ds + i]. */
static inline void transpose16(const uint32_t *const *src, uint32_t *dst, int64_t ds) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(src[i]);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
    }
    for (int i = 0; i < 16; i++) _mm512_storeu_si512(dst + i * ds, r[i]);
}

static inline __mmask16 first(int64_t n) {  /* the first n (clamped to 0..16) of 16 lanes */
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

static const uint32_t ZERO_ROW[16];  /* the words of a key past nk */

/* KV head h of the keys at slots (nk of them) packed: K as [blocks][D/2][KB] pair words (two
   dims of one key per word), V as [keys/2][D] (one dim of two consecutive keys per word); keys
   past nk are zero. */
static void pack_keys(const uint16_t *kpool, const uint16_t *vpool, const int64_t *slots,
                      int64_t nk, int64_t KVH, int64_t h, int64_t D, uint32_t *kp, uint32_t *vp) {
    const int64_t D2 = D / 2, nblk = (nk + KB - 1) / KB;
    const uint32_t *rows[16];
    for (int64_t b = 0; b < nblk; b++)
        for (int64_t half = 0; half < KB; half += 16) {
            for (int i = 0; i < 16; i++) {
                const int64_t j = b * KB + half + i;
                rows[i] = j < nk ? (const uint32_t *)(kpool + (slots[j] * KVH + h) * D) : ZERO_ROW;
            }
            for (int64_t w = 0; w < D2; w += 16) {
                const uint32_t *at[16];
                for (int i = 0; i < 16; i++) at[i] = rows[i] == ZERO_ROW ? ZERO_ROW : rows[i] + w;
                transpose16(at, kp + b * D2 * KB + w * KB + half, KB);
            }
        }
    /* V: word d of pair row p holds dim d of key 2p (low half) and of key 2p + 1 (high) */
    __m512i lo_idx, hi_idx;
    {
        uint16_t lo[32], hi[32];
        for (int i = 0; i < 16; i++) {
            lo[2 * i] = i; lo[2 * i + 1] = 32 + i;
            hi[2 * i] = 16 + i; hi[2 * i + 1] = 48 + i;
        }
        lo_idx = _mm512_loadu_si512(lo);
        hi_idx = _mm512_loadu_si512(hi);
    }
    const int64_t npairs = nblk * KB / 2;
    for (int64_t p = 0; p < npairs; p++) {
        const int64_t j = 2 * p;
        for (int64_t d = 0; d < D; d += 32) {
            __m512i a = j < nk ? _mm512_loadu_si512(vpool + (slots[j] * KVH + h) * D + d)
                               : _mm512_setzero_si512();
            __m512i c = j + 1 < nk ? _mm512_loadu_si512(vpool + (slots[j + 1] * KVH + h) * D + d)
                                   : _mm512_setzero_si512();
            _mm512_storeu_si512(vp + p * D + d, _mm512_permutex2var_epi16(a, lo_idx, c));
            _mm512_storeu_si512(vp + p * D + d + 16, _mm512_permutex2var_epi16(a, hi_idx, c));
        }
    }
}

/* q [nq, H, D], out [nq, H, D]: bf16 bits, contiguous; pools [S, KVH, D] bf16; slots [nk]
   the chunk's keys in order (its cached prefix, then its own), nk >= nq; D a multiple of 64.
   Query i attends keys 0 .. nk - nq + i. Returns 0, or 1 when out of memory. */
int prefill_attention(const uint16_t *q, const uint16_t *kpool, const uint16_t *vpool,
                      const int64_t *slots, int64_t nk, int64_t nq, int64_t H, int64_t KVH,
                      int64_t D, float scale, int64_t rows_per_block, uint16_t *out) {
    const int64_t G = H / KVH, D2 = D / 2, nblk = (nk + KB - 1) / KB;
    int64_t qi = rows_per_block / G;
    qi = qi < 1 ? 1 : qi;
    const int64_t rows = (qi * G + 7) / 8 * 8;  /* a block's rows, padded to the score tile */
    uint32_t *kp = aligned_alloc(64, (size_t)nblk * D2 * KB * 4 + 64);
    uint32_t *vp = aligned_alloc(64, (size_t)nblk * (KB / 2) * D * 4 + 64);
    uint32_t *qw = aligned_alloc(64, (size_t)rows * D2 * 4 + 64);
    float *s = aligned_alloc(64, (size_t)rows * SB * 4 + 64);
    uint32_t *pw = aligned_alloc(64, (size_t)rows * (SB / 2) * 4 + 64);
    float *acc = aligned_alloc(64, (size_t)rows * D * 4 + 64);
    float *mx = malloc(rows * 4), *sum = malloc(rows * 4), *corr = malloc(rows * 4);
    if (!kp || !vp || !qw || !s || !pw || !acc || !mx || !sum || !corr) {
        free(kp); free(vp); free(qw); free(s); free(pw); free(acc); free(mx); free(sum);
        free(corr);
        return 1;
    }
    for (int64_t h = 0; h < KVH; h++) {
        pack_keys(kpool, vpool, slots, nk, KVH, h, D, kp, vp);
        for (int64_t i0 = 0; i0 < nq; i0 += qi) {
            const int64_t ni = nq - i0 < qi ? nq - i0 : qi, used = ni * G;
            /* rows computed: the used ones, padded to the score and weigh tiles */
            const int64_t r8 = (used + 7) / 8 * 8, r4 = (used + 3) / 4 * 4;
            /* row r: query i0 + r / G, head h * G + r % G; padding rows are zero */
            memset(qw, 0, (size_t)r8 * D2 * 4);
            for (int64_t r = 0; r < used; r++)
                memcpy(qw + r * D2, q + ((i0 + r / G) * H + h * G + r % G) * D, D * 2);
            for (int64_t r = 0; r < rows; r++) {
                mx[r] = -1e30f;
                sum[r] = 0.0f;
            }
            memset(acc, 0, (size_t)rows * D * 4);
            const int64_t end = nk - nq + i0 + ni;  /* keys visible to some row: 0 .. end - 1 */
            /* a span of SB keys at a time: all the rows' scores, then each row's exact softmax
               over the span (rescaling what the earlier spans summed), then the weighted V */
            for (int64_t k0 = 0; k0 < end; k0 += SB) {
                const int64_t span = end - k0 < SB ? end - k0 : SB;
                const int64_t nb = (span + KB - 1) / KB;
                for (int64_t b = 0; b < nb; b++)
                    for (int64_t r = 0; r < r8; r += 8)
                        score8(qw + r * D2, D2, kp + (k0 / KB + b) * D2 * KB, scale,
                               s + r * SB + b * KB, SB);
                for (int64_t r = 0; r < r4; r++) {
                    int64_t vis = r < used ? nk - nq + i0 + r / G + 1 - k0 : 0;
                    vis = vis > span ? span : vis;
                    uint32_t *p = pw + r * (SB / 2);
                    if (vis <= 0) {  /* nothing of this span is visible to the row */
                        corr[r] = 1.0f;
                        memset(p, 0, (size_t)nb * KB * 2);
                        continue;
                    }
                    const float *sr = s + r * SB;
                    __m512 m = _mm512_set1_ps(-1e30f);
                    for (int64_t c = 0; c < vis; c += 16)
                        m = _mm512_mask_max_ps(m, first(vis - c), m, _mm512_loadu_ps(sr + c));
                    const float bm = _mm512_reduce_max_ps(m);
                    const float m_new = mx[r] > bm ? mx[r] : bm;
                    const __m512 mn = _mm512_set1_ps(m_new);
                    __m512 tot = _mm512_setzero_ps();
                    /* the weights as bf16, in key order: word jp is keys 2jp, 2jp + 1 */
                    for (int64_t c = 0; c < nb * KB; c += 32) {
                        __m512 e0 = _mm512_maskz_mov_ps(first(vis - c),
                            exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + c), mn)));
                        __m512 e1 = _mm512_maskz_mov_ps(first(vis - c - 16),
                            exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + c + 16), mn)));
                        tot = _mm512_add_ps(tot, _mm512_add_ps(e0, e1));
                        _mm512_storeu_si512(p + c / 2, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
                    }
                    corr[r] = _mm512_cvtss_f32(exp16(_mm512_set1_ps(mx[r] - m_new)));
                    sum[r] = sum[r] * corr[r] + _mm512_reduce_add_ps(tot);
                    mx[r] = m_new;
                }
                for (int64_t r = 0; r < r4; r += 4)
                    weigh4(pw + r * (SB / 2), SB / 2, vp + (k0 / 2) * D, nb * KB / 2, D,
                           acc + r * D, corr + r);
            }
            for (int64_t r = 0; r < used; r++) {
                uint16_t *o = out + ((i0 + r / G) * H + h * G + r % G) * D;
                __m512 inv = _mm512_set1_ps(1.0f / sum[r]);
                for (int64_t d = 0; d < D; d += 16)
                    _mm256_storeu_si256((__m256i *)(o + d), (__m256i)_mm512_cvtneps_pbh(
                        _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d), inv)));
            }
        }
    }
    free(kp); free(vp); free(qw); free(s); free(pw); free(acc); free(mx); free(sum); free(corr);
    return 0;
}
int prefill_attention_available(void) { return 1; }
#else
int prefill_attention_available(void) { return 0; }
#endif
