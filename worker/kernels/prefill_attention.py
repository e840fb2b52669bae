"""CPU prefill-attention kernels in C over the KV pool in place: bfloat16 (AVX512-BF16) and
float32 (any CPU).

A prefill chunk of `nq` tokens attends causally to `nk` keys: its cached prefix and itself,
query i seeing keys 0 .. nk - nq + i (the mask aligned to the end). Torch's SDPA needs the
prefix gathered out of the pool first, and does this at 12-35 GFLOP/s on one Zen 4 core in bf16
(`bench/bench_prefill_attention.py`).

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
Measured there: ~150-160 GFLOP/s from 65 to 2,048 tokens (the core's bf16 peak is ~230), 4-13x
torch's SDPA.

float32 (`F32_SOURCE`): the same blocks, spans and softmax on float32 vectors of GCC's vector
types (8 lanes on AVX2, 16 with AVX-512), so it builds for any CPU. Per KV head the keys are
packed transposed (`[blocks][D][2 VW]`, by VW x VW transposes in registers), and both products
run as the register tile of a float32 GEMM, 6 rows x 2 vectors: the scores over a packed block
(each dim of it loaded once for 6 rows), then p.V over value rows read where they lie in the
pool (each row's two vectors loaded once for 6 rows). Scores, weights and sums are float32,
within float32 rounding of exact attention. On one AVX2 EPYC core at SmolLM2's heads, 1.1-2x
the native backend's torch path (docs/engine.md).

Built at first use by `worker.kernels.build`; `load(dtype)` returns None where the kernel
cannot serve (bf16 without AVX512-BF16; no compiler), and prefill keeps torch's flash kernel.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

import worker.kernels.build as c_library

ROWS = 48  # query rows (tokens x query heads of a KV head) per block, about

SOURCE = c_library.AVX512_EXP + r"""
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
"""


# float32, for any CPU, on `c_library.FLOAT_VECTORS` (VW lanes). Per KV head the chunk's keys are
# packed transposed in blocks of KB (`[blocks][D][KB]`, zero past nk) so that a score tile is SR
# rows x two vectors of keys, each dim of a block loaded once for the SR rows; the values are
# read where they lie in the pool. Spans of SB keys as in the bf16 kernel: the span's scores up
# to each row tile's diagonal, then per row the exact softmax against the running max (e^x as
# exp_f32's polynomial on VW lanes), then p.V a row tile at a time. Every sum float32.
F32_SOURCE = c_library.FLOAT_VECTORS + r"""
#include <stdlib.h>
#include <string.h>
#define KB (2 * VW)  /* keys per packed block: a score tile's width */
#define SB 512       /* keys per softmax span (a multiple of KB) */
#define SR 6         /* rows per score tile */

/* Lane l of the result: l + base < n. */
static inline vi lanes_below(int64_t base, int64_t n) {
    vi idx;
    for (int l = 0; l < VW; l++) idx[l] = l;
    return idx + (int32_t)base < (int32_t)n;
}

/* KV head h of the keys at slots (nk of them), transposed in blocks: kp[b][d][j] is dim d of key
   b * KB + j (zero past nk), VW keys x VW dims at a time through the registers. */
static void pack_keys(const float *kpool, const int64_t *slots, int64_t nk, int64_t KVH,
                      int64_t h, int64_t D, float *kp) {
    const int64_t nblk = (nk + KB - 1) / KB;
    for (int64_t b = 0; b < nblk; b++)
        for (int64_t half = 0; half < KB; half += VW) {
            const float *rows[VW];
            for (int i = 0; i < VW; i++) {
                const int64_t key = b * KB + half + i;
                rows[i] = key < nk ? kpool + (slots[key] * KVH + h) * D : NULL;
            }
            for (int64_t d = 0; d < D; d += VW) {
                vf r[VW];
                for (int i = 0; i < VW; i++)
                    r[i] = rows[i] ? *(const vfu *)(rows[i] + d) : splat(0.0f);
                transpose(r);
                for (int t = 0; t < VW; t++) *(vf *)(kp + (b * D + d + t) * KB + half) = r[t];
            }
        }
}

/* Scores of SR rows qs [SR][D] (scaled) against one packed block kb [D][KB], into s (row
   stride ss). */
static inline void score_tile(const float *qs, int64_t D, const float *kb, float *s, int64_t ss) {
    vf a[SR][2];
    for (int r = 0; r < SR; r++) a[r][0] = a[r][1] = splat(0.0f);
    for (int64_t d = 0; d < D; d++) {
        const vf k0 = *(const vf *)(kb + d * KB), k1 = *(const vf *)(kb + d * KB + VW);
        for (int r = 0; r < SR; r++) {
            const float x = qs[r * D + d];
            a[r][0] += x * k0;
            a[r][1] += x * k1;
        }
    }
    for (int r = 0; r < SR; r++) {
        *(vfu *)(s + r * ss) = a[r][0];
        *(vfu *)(s + r * ss + VW) = a[r][1];
    }
}

/* For SR rows r: acc_r [D] = acc_r * corr_r + sum_{j < n} p_r[j] * vr[j] (p_r at p + r * ps),
   two vectors of dims a pass: a value row's two vectors loaded once for the SR rows, the
   register tile of the scores again. */
static inline void weigh_tile(const float *p, int64_t ps, int64_t n, const float *const *vr,
                              int64_t D, float *acc, const float *corr) {
    int64_t d = 0;
    for (; d + 2 * VW <= D; d += 2 * VW) {
        vf a[SR][2];
        for (int r = 0; r < SR; r++) {
            a[r][0] = *(vfu *)(acc + r * D + d) * corr[r];
            a[r][1] = *(vfu *)(acc + r * D + d + VW) * corr[r];
        }
        for (int64_t j = 0; j < n; j++) {
            const vf v0 = *(const vfu *)(vr[j] + d), v1 = *(const vfu *)(vr[j] + d + VW);
            for (int r = 0; r < SR; r++) {
                const float x = p[r * ps + j];
                a[r][0] += x * v0;
                a[r][1] += x * v1;
            }
        }
        for (int r = 0; r < SR; r++) {
            *(vfu *)(acc + r * D + d) = a[r][0];
            *(vfu *)(acc + r * D + d + VW) = a[r][1];
        }
    }
    for (; d < D; d += VW) {  /* D an odd number of vectors */
        vf a[SR];
        for (int r = 0; r < SR; r++) a[r] = *(vfu *)(acc + r * D + d) * corr[r];
        for (int64_t j = 0; j < n; j++) {
            const vf v = *(const vfu *)(vr[j] + d);
            for (int r = 0; r < SR; r++) a[r] += p[r * ps + j] * v;
        }
        for (int r = 0; r < SR; r++) *(vfu *)(acc + r * D + d) = a[r];
    }
}

/* q [nq, H, D], out [nq, H, D] float32, contiguous; pools [S, KVH, D] float32; slots [nk] the
   chunk's keys in order (its cached prefix, then its own), nk >= nq; D a multiple of VW.
   Query i attends keys 0 .. nk - nq + i. Returns 0, or 1 when out of memory. */
int prefill_attention_f32(const float *q, const float *kpool, const float *vpool,
                          const int64_t *slots, int64_t nk, int64_t nq, int64_t H, int64_t KVH,
                          int64_t D, float scale, int64_t rows_per_block, float *out) {
    const int64_t G = H / KVH, nblk = (nk + KB - 1) / KB;
    int64_t qi = rows_per_block / G;
    qi = qi < 1 ? 1 : qi;
    const int64_t rows = (qi * G + SR - 1) / SR * SR;  /* a block's rows, padded to the tile */
    float *kp = aligned_alloc(64, (size_t)nblk * D * KB * 4 + 64);
    float *qs = aligned_alloc(64, (size_t)rows * D * 4 + 64);
    float *s = aligned_alloc(64, (size_t)rows * SB * 4 + 64);
    float *acc = aligned_alloc(64, (size_t)rows * D * 4 + 64);
    float *mx = malloc(rows * 4), *sum = malloc(rows * 4), *corr = malloc(rows * 4);
    int64_t *nv = malloc(rows * 8);  /* each row's visible keys in the span */
    const float **vr = malloc(sizeof(float *) * SB);
    if (!kp || !qs || !s || !acc || !mx || !sum || !corr || !nv || !vr) {
        free(kp); free(qs); free(s); free(acc); free(mx); free(sum); free(corr); free(nv);
        free(vr);
        return 1;
    }
    for (int64_t h = 0; h < KVH; h++) {
        pack_keys(kpool, slots, nk, KVH, h, D, kp);
        for (int64_t i0 = 0; i0 < nq; i0 += qi) {
            const int64_t ni = nq - i0 < qi ? nq - i0 : qi, used = ni * G;
            const int64_t rt = (used + SR - 1) / SR * SR;  /* rows computed: whole tiles */
            /* row r: query i0 + r / G, head h * G + r % G, scaled; padding rows are zero */
            for (int64_t r = 0; r < used; r++) {
                const float *src = q + ((i0 + r / G) * H + h * G + r % G) * D;
                for (int64_t d = 0; d < D; d += VW)
                    *(vf *)(qs + r * D + d) = *(const vfu *)(src + d) * scale;
            }
            memset(qs + used * D, 0, (size_t)(rt - used) * D * 4);
            for (int64_t r = 0; r < rt; r++) {
                mx[r] = -1e30f;
                sum[r] = 0.0f;
            }
            memset(acc, 0, (size_t)rt * D * 4);
            const int64_t base = nk - nq + i0;  /* row r sees keys 0 .. base + r / G */
            const int64_t end = base + ni;      /* keys visible to some row: 0 .. end - 1 */
            for (int64_t k0 = 0; k0 < end; k0 += SB) {
                const int64_t span = end - k0 < SB ? end - k0 : SB;
                for (int64_t j = 0; j < span; j++) vr[j] = vpool + (slots[k0 + j] * KVH + h) * D;
                /* each row tile's scores up to its last row's diagonal */
                for (int64_t r = 0; r < rt; r += SR) {
                    const int64_t last = r + SR - 1 < used ? r + SR - 1 : used - 1;
                    int64_t vis = base + last / G + 1 - k0;
                    vis = vis > span ? span : vis;
                    for (int64_t j = 0; j < vis; j += KB)
                        score_tile(qs + r * D, D, kp + (k0 + j) / KB * D * KB, s + r * SB + j, SB);
                }
                /* per row: the exact softmax over the span's visible keys, as weights in s */
                for (int64_t r = 0; r < rt; r++) {
                    int64_t vis = r < used ? base + r / G + 1 - k0 : 0;
                    vis = vis > span ? span : vis;
                    nv[r] = vis;
                    corr[r] = 1.0f;  /* a row that sees nothing of the span keeps its sums */
                    if (vis <= 0) continue;
                    float *sr = s + r * SB;
                    vf m = splat(-1e30f);
                    for (int64_t c = 0; c < vis; c += VW) {
                        const vf x = *(vfu *)(sr + c);
                        m = blend(lanes_below(c, vis) & (x > m), x, m);
                    }
                    float bm = m[0];
                    for (int l = 1; l < VW; l++) bm = m[l] > bm ? m[l] : bm;
                    const float m_new = mx[r] > bm ? mx[r] : bm;
                    vf tot = splat(0.0f);
                    for (int64_t c = 0; c < vis; c += VW) {
                        vf e = exp_v(*(vfu *)(sr + c) - m_new);
                        e = (vf)((vi)e & lanes_below(c, vis));
                        *(vfu *)(sr + c) = e;
                        tot += e;
                    }
                    float t = 0.0f;
                    for (int l = 0; l < VW; l++) t += tot[l];
                    corr[r] = exp_v(splat(mx[r] - m_new))[0];  /* of the spans before */
                    sum[r] = sum[r] * corr[r] + t;
                    mx[r] = m_new;
                }
                /* then p.V a row tile at a time, up to its longest row: zero past each row's */
                for (int64_t r = 0; r < rt; r += SR) {
                    int64_t n = 0;
                    for (int w = 0; w < SR; w++) n = nv[r + w] > n ? nv[r + w] : n;
                    if (n <= 0) continue;
                    for (int w = 0; w < SR; w++) {
                        const int64_t from = nv[r + w] <= 0 ? 0 : (nv[r + w] + VW - 1) / VW * VW;
                        if (from < n) memset(s + (r + w) * SB + from, 0, (n - from) * 4);
                    }
                    weigh_tile(s + r * SB, SB, n, vr, D, acc + r * D, corr + r);
                }
            }
            for (int64_t r = 0; r < used; r++) {
                float *o = out + ((i0 + r / G) * H + h * G + r % G) * D;
                const float inv = 1.0f / sum[r];
                for (int64_t d = 0; d < D; d++) o[d] = acc[r * D + d] * inv;
            }
        }
    }
    free(kp); free(qs); free(s); free(acc); free(mx); free(sum); free(corr); free(nv);
    free(vr);
    return 0;
}
"""


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
        library = c_library.build("prefill_attention_f32", F32_SOURCE)
        return PrefillKernel(library, dtype) if library is not None else None
    library = c_library.build("prefill_attention", SOURCE)
    if library is None or not library.prefill_attention_available():
        return None
    return PrefillKernel(library)
