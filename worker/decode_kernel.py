"""A CPU decode-attention kernel in C that reads the bfloat16 KV pool in place, built at first use.

Torch's CPU flash kernel is tuned for long query blocks; a decode step hands it one query per
sequence (a few query heads per KV head), and then its fixed cost per (sequence, head) and its
per-key work dominate, and the KV has to be gathered out of the pool first. This kernel walks
*segments*: a list of key slots (read straight from the pool, no gather) and the sequences whose
queries attend to them, for every KV head. Each query keeps an online-softmax state (running
max, sum, float32 accumulator) across the segments it takes part in, so a group's shared prefix
(one segment, all its members' queries) and each member's own keys (one segment each) need no
separate merge, mask or padding. Scores, softmax and the weighted sum are float32; the output is
rounded to bfloat16 once. Where the CPU has AVX512-BF16, q.k and p.V take bf16 pairs
(`vdpbf16ps`: products exact, sums in float32, as the weights are already rounded to bf16): K
and V are read from the pool into tiles of pair words, no float32 copy, and two queries share
each V load; rows four tiles ahead are prefetched into L2 while one computes. Elsewhere the same
algorithm runs on float32 vectors.

Built at first use by `worker.models.c_library` (compiled for this CPU, cached on disk, loaded
with ctypes); `load()` returns None when it cannot be built, and the `native` backend then keeps
its pure-torch path.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

import worker.models.c_library as c_library

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#ifdef __AVX512BF16__
#define VPACK 2  /* keys per word of the values tile (bf16 pairs) */
#else
#define VPACK 1
#endif

#define KB 32    /* keys per score tile: two vectors of 16 */
#define KVS 512  /* keys per softmax block (torch's flash kernel uses the same) */
#define QB 4   /* queries per score tile */
#define AHEAD 4  /* tiles between a tile's prefetch and its use */
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  /* any float address */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&f, &u, 4);
    return f;
}

static inline float exp_f32(float x) {  /* Cephes expf: ~1 ulp, vectorizable */
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return y * s;
}

/* The largest of p[0..n) (n >= 1). */
static inline float block_max(const float *p, int64_t n) {
    int64_t j = 0;
    float m = p[0];
#ifdef __AVX512F__
    if (n >= 16) {
        __m512 v = _mm512_loadu_ps(p);
        for (j = 16; j + 16 <= n; j += 16) v = _mm512_max_ps(v, _mm512_loadu_ps(p + j));
        m = _mm512_reduce_max_ps(v);
    }
#endif
    for (; j < n; j++) m = p[j] > m ? p[j] : m;
    return m;
}

/* Ask for the K and V rows of head h of up to KB keys at slots sl, into L2 (the L1 has too
   few outstanding misses to keep a stream of scattered rows going). */
static inline void prefetch_rows(const uint16_t *kpool, const uint16_t *vpool,
                                 const int64_t *sl, int64_t n, int64_t KVH, int64_t h,
                                 int64_t D) {
    n = n < KB ? n : KB;
    for (int64_t j = 0; j < n; j++) {
        int64_t off = (sl[j] * KVH + h) * D;
        for (int64_t b = 0; b < D * 2; b += 64) {
            __builtin_prefetch((const char *)(kpool + off) + b, 0, 1);
            __builtin_prefetch((const char *)(vpool + off) + b, 0, 1);
        }
    }
}

#ifdef __AVX512BF16__
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
#endif

/* Scores of the nq queries qf [nqp, D] (scaled; qh: the same queries as bfloat16 bits,
   unscaled) against nb <= KB keys at slots sl, head h, into sc[i * KVS + j]; the keys'
   values, as float32, into vf [KB, D]. */
static void score_tile(const float *qf, const uint16_t *qh, float scale, int64_t nq,
                       int64_t nqp, const uint16_t *kpool, const uint16_t *vpool,
                       const int64_t *sl, int64_t nb, int64_t KVH, int64_t h, int64_t D,
                       float *kt, const v16 *ktv, float *vf, float *sc) {
    const int64_t DV = D / 16;
    const uint16_t *kr[KB];
#ifdef __AVX512BF16__
    /* the values as [KB / 2, D] words: dim d of two consecutive keys (for p @ V in pairs) */
    uint32_t *vw = (uint32_t *)vf;
    const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                            40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33,
                                            1, 32, 0);
    const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
    for (int64_t j = 0; j < KB; j += 2) {  /* a short tile repeats its first key (unused) */
        int64_t off0 = (sl[j < nb ? j : 0] * KVH + h) * D;
        int64_t off1 = (sl[j + 1 < nb ? j + 1 : 0] * KVH + h) * D;
        kr[j] = kpool + off0;
        kr[j + 1] = kpool + off1;
        /* dim d of the two keys side by side: 32 dims of each per two shuffles */
        for (int64_t d = 0; d < D; d += 32) {
            __mmask32 m = D - d >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)0xFFFFu;
            __m512i a = _mm512_maskz_loadu_epi16(m, vpool + off0 + d);
            __m512i b = _mm512_maskz_loadu_epi16(m, vpool + off1 + d);
            _mm512_storeu_si512(vw + j / 2 * D + d, _mm512_permutex2var_epi16(a, lo_idx, b));
            if (D - d >= 32)
                _mm512_storeu_si512(vw + j / 2 * D + d + 16,
                                    _mm512_permutex2var_epi16(a, hi_idx, b));
        }
    }
#else
    for (int64_t j = 0; j < KB; j++) {  /* a short tile repeats its first key (unused) */
        int64_t off = (sl[j < nb ? j : 0] * KVH + h) * D;
        kr[j] = kpool + off;
        for (int64_t d = 0; d < D; d++) vf[j * D + d] = bf16_to_f32(vpool[off + d]);
    }
#endif
#ifdef __AVX512BF16__
    /* bf16 pairs (vdpbf16ps): K as [D / 2, KB] words (two dims of one key each); QB queries
       x KB keys in 2 * QB accumulators; exact products, summed in float32 */
    (void)qf;
    (void)ktv;
    (void)DV;
    uint32_t *kw = (uint32_t *)kt;
    for (int64_t j0 = 0; j0 < KB; j0 += 16)
        for (int64_t w0 = 0; w0 < D / 2; w0 += 16)
            transpose16(kr + j0, w0, D / 2 - w0 < 16 ? D / 2 - w0 : 16, kw + w0 * KB + j0, KB);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < nqp; i += QB) {
        __m512 s0a = _mm512_setzero_ps(), s0b = s0a, s1a = s0a, s1b = s0a;
        __m512 s2a = s0a, s2b = s0a, s3a = s0a, s3b = s0a;
        const uint16_t *q0 = qh + i * D;
        for (int64_t d2 = 0; d2 < D / 2; d2++) {
            __m512bh ka = (__m512bh)_mm512_loadu_si512(kw + d2 * KB);
            __m512bh kb = (__m512bh)_mm512_loadu_si512(kw + d2 * KB + 16);
            uint32_t w0, w1, w2, w3;
            memcpy(&w0, q0 + 2 * d2, 4);
            memcpy(&w1, q0 + D + 2 * d2, 4);
            memcpy(&w2, q0 + 2 * D + 2 * d2, 4);
            memcpy(&w3, q0 + 3 * D + 2 * d2, 4);
            __m512bh b0 = (__m512bh)_mm512_set1_epi32((int)w0);
            __m512bh b1 = (__m512bh)_mm512_set1_epi32((int)w1);
            __m512bh b2 = (__m512bh)_mm512_set1_epi32((int)w2);
            __m512bh b3 = (__m512bh)_mm512_set1_epi32((int)w3);
            s0a = _mm512_dpbf16_ps(s0a, b0, ka);
            s0b = _mm512_dpbf16_ps(s0b, b0, kb);
            s1a = _mm512_dpbf16_ps(s1a, b1, ka);
            s1b = _mm512_dpbf16_ps(s1b, b1, kb);
            s2a = _mm512_dpbf16_ps(s2a, b2, ka);
            s2b = _mm512_dpbf16_ps(s2b, b2, kb);
            s3a = _mm512_dpbf16_ps(s3a, b3, ka);
            s3b = _mm512_dpbf16_ps(s3b, b3, kb);
        }
        float *o = sc + i * KVS;
        _mm512_storeu_ps(o, _mm512_mul_ps(s0a, vscale));
        _mm512_storeu_ps(o + 16, _mm512_mul_ps(s0b, vscale));
        _mm512_storeu_ps(o + KVS, _mm512_mul_ps(s1a, vscale));
        _mm512_storeu_ps(o + KVS + 16, _mm512_mul_ps(s1b, vscale));
        _mm512_storeu_ps(o + 2 * KVS, _mm512_mul_ps(s2a, vscale));
        _mm512_storeu_ps(o + 2 * KVS + 16, _mm512_mul_ps(s2b, vscale));
        _mm512_storeu_ps(o + 3 * KVS, _mm512_mul_ps(s3a, vscale));
        _mm512_storeu_ps(o + 3 * KVS + 16, _mm512_mul_ps(s3b, vscale));
    }
    return;
#else
    (void)qh;
    (void)scale;
#endif
    if (nq <= QB) {  /* few queries: a dot product per key row, no transposed copy */
        for (int64_t j = 0; j < nb; j++) {
            float *krow = kt + j % 2 * D;
            for (int64_t d = 0; d < D; d++) krow[d] = bf16_to_f32(kr[j][d]);
            const v16 *kv = (const v16 *)krow;
            for (int64_t i = 0; i < nq; i++) {
                const v16 *qv = (const v16 *)(qf + i * D);
                v16 t = qv[0] * kv[0];
                for (int64_t dv = 1; dv < DV; dv++) t += qv[dv] * kv[dv];
                float x = 0.0f;
                for (int l = 0; l < 16; l++) x += t[l];
                sc[i * KVS + j] = x;
            }
        }
        return;
    }
    for (int64_t d = 0; d < D; d += 2) {  /* K transposed to [D, KB], two dims at a time */
        for (int64_t j = 0; j < KB; j++) {
            uint32_t w, lo, hi;
            memcpy(&w, kr[j] + d, 4);
            lo = w << 16;
            hi = w & 0xFFFF0000u;
            memcpy(kt + d * KB + j, &lo, 4);
            memcpy(kt + (d + 1) * KB + j, &hi, 4);
        }
    }
    for (int64_t i = 0; i < nqp; i += QB) {  /* QB queries x 16 keys per register tile */
        for (int c = 0; c < KB / 16; c++) {
            v16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
            const float *q0 = qf + i * D;
            for (int64_t d = 0; d < D; d++) {
                v16 k = ktv[d * (KB / 16) + c];
                s0 += q0[d] * k;
                s1 += q0[D + d] * k;
                s2 += q0[2 * D + d] * k;
                s3 += q0[3 * D + d] * k;
            }
            *(v16 *)(sc + i * KVS + c * 16) = s0;
            *(v16 *)(sc + (i + 1) * KVS + c * 16) = s1;
            *(v16 *)(sc + (i + 2) * KVS + c * 16) = s2;
            *(v16 *)(sc + (i + 3) * KVS + c * 16) = s3;
        }
    }
}

#ifndef __AVX512BF16__
/* acc [DV vectors] = acc * corr + sum_j p[j] * vf[j], four independent chains. */
static void weigh_values(const float *p, int64_t n, const v16 *vfv, int64_t DV, v16u *acc,
                         float corr) {
    int64_t dv = 0;
    for (; dv + 4 <= DV; dv += 4) {
        v16 x0 = acc[dv] * corr, x1 = acc[dv + 1] * corr;
        v16 x2 = acc[dv + 2] * corr, x3 = acc[dv + 3] * corr;
        for (int64_t j = 0; j < n; j++) {
            const v16 *vj = vfv + j * DV + dv;
            float pj = p[j];
            x0 += pj * vj[0];
            x1 += pj * vj[1];
            x2 += pj * vj[2];
            x3 += pj * vj[3];
        }
        acc[dv] = x0;
        acc[dv + 1] = x1;
        acc[dv + 2] = x2;
        acc[dv + 3] = x3;
    }
    for (; dv < DV; dv++) {
        v16 x = acc[dv] * corr;
        for (int64_t j = 0; j < n; j++) x += p[j] * vfv[j * DV + dv];
        acc[dv] = x;
    }
}
#endif

#ifdef __AVX512BF16__
/* acc_r = acc_r * corr_r + sum_j p_r[j] * v[j] for two queries (acc1 NULL: one), the weights
   and values as bf16 pairs (pw: [np] words, vw: [np, D] words), products exact, sums float32. */
static void weigh_pairs(const uint32_t *pw0, const uint32_t *pw1, int64_t np,
                        const uint32_t *vw, int64_t D, float *acc0, float corr0, float *acc1,
                        float corr1) {
    const __m512 c0 = _mm512_set1_ps(corr0), c1 = _mm512_set1_ps(corr1);
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) {
        __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(acc0 + d), c0);
        __m512 x1 = _mm512_mul_ps(_mm512_loadu_ps(acc0 + d + 16), c0);
        __m512 x2 = _mm512_mul_ps(_mm512_loadu_ps(acc0 + d + 32), c0);
        __m512 x3 = _mm512_mul_ps(_mm512_loadu_ps(acc0 + d + 48), c0);
        __m512 y0 = _mm512_setzero_ps(), y1 = y0, y2 = y0, y3 = y0;
        if (acc1) {
            y0 = _mm512_mul_ps(_mm512_loadu_ps(acc1 + d), c1);
            y1 = _mm512_mul_ps(_mm512_loadu_ps(acc1 + d + 16), c1);
            y2 = _mm512_mul_ps(_mm512_loadu_ps(acc1 + d + 32), c1);
            y3 = _mm512_mul_ps(_mm512_loadu_ps(acc1 + d + 48), c1);
        }
        for (int64_t jp = 0; jp < np; jp++) {
            const uint32_t *v = vw + jp * D + d;
            __m512bh v0 = (__m512bh)_mm512_loadu_si512(v);
            __m512bh v1 = (__m512bh)_mm512_loadu_si512(v + 16);
            __m512bh v2 = (__m512bh)_mm512_loadu_si512(v + 32);
            __m512bh v3 = (__m512bh)_mm512_loadu_si512(v + 48);
            __m512bh a = (__m512bh)_mm512_set1_epi32((int)pw0[jp]);
            __m512bh b = (__m512bh)_mm512_set1_epi32((int)pw1[jp]);
            x0 = _mm512_dpbf16_ps(x0, a, v0);
            x1 = _mm512_dpbf16_ps(x1, a, v1);
            x2 = _mm512_dpbf16_ps(x2, a, v2);
            x3 = _mm512_dpbf16_ps(x3, a, v3);
            y0 = _mm512_dpbf16_ps(y0, b, v0);
            y1 = _mm512_dpbf16_ps(y1, b, v1);
            y2 = _mm512_dpbf16_ps(y2, b, v2);
            y3 = _mm512_dpbf16_ps(y3, b, v3);
        }
        _mm512_storeu_ps(acc0 + d, x0);
        _mm512_storeu_ps(acc0 + d + 16, x1);
        _mm512_storeu_ps(acc0 + d + 32, x2);
        _mm512_storeu_ps(acc0 + d + 48, x3);
        if (acc1) {
            _mm512_storeu_ps(acc1 + d, y0);
            _mm512_storeu_ps(acc1 + d + 16, y1);
            _mm512_storeu_ps(acc1 + d + 32, y2);
            _mm512_storeu_ps(acc1 + d + 48, y3);
        }
    }
    for (; d < D; d += 16) {
        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(acc0 + d), c0);
        __m512 y = acc1 ? _mm512_mul_ps(_mm512_loadu_ps(acc1 + d), c1) : _mm512_setzero_ps();
        for (int64_t jp = 0; jp < np; jp++) {
            __m512bh v = (__m512bh)_mm512_loadu_si512(vw + jp * D + d);
            x = _mm512_dpbf16_ps(x, (__m512bh)_mm512_set1_epi32((int)pw0[jp]), v);
            y = _mm512_dpbf16_ps(y, (__m512bh)_mm512_set1_epi32((int)pw1[jp]), v);
        }
        _mm512_storeu_ps(acc0 + d, x);
        if (acc1) _mm512_storeu_ps(acc1 + d, y);
    }
}
#endif

/* q [B, H, D], pools [S, KVH, D], out [B, H, D]: bfloat16 bits; D a multiple of 16.
   seg [nseg, 4]: offset into `slots`, key count, offset into `members`, member count.
   state: float32 [B * H * (D + 2)]: accumulators [B * H, D], then the running
   max [B * H] and sum [B * H]. Returns 0, or 1 when out of memory. */
int decode_attention(const uint16_t *q, const uint16_t *kpool, const uint16_t *vpool,
                     const int64_t *slots, const int64_t *seg, const int64_t *members,
                     int64_t nseg, int64_t B, int64_t H, int64_t KVH, int64_t D, float scale,
                     float *state, uint16_t *out) {
    const int64_t G = H / KVH, DV = D / 16;
    int64_t max_nq = QB;
    for (int64_t s = 0; s < nseg; s++)
        if (seg[4 * s + 3] * G > max_nq) max_nq = seg[4 * s + 3] * G;
    max_nq = (max_nq + QB - 1) / QB * QB;
    size_t floats = max_nq * D + KB * D + KVS * D + max_nq * KVS;
    float *buf = aligned_alloc(64, ((sizeof(float) * floats + 63) / 64) * 64);
    int64_t *rows = malloc(sizeof(int64_t) * max_nq);
    uint16_t *qh = malloc(sizeof(uint16_t) * max_nq * D);
    float *corrs = malloc(sizeof(float) * max_nq);
    if (!buf || !rows || !qh || !corrs) {
        free(buf);
        free(rows);
        free(qh);
        free(corrs);
        return 1;
    }
    float *qf = buf, *kt = qf + max_nq * D, *vf = kt + KB * D, *sc = vf + KVS * D;
    const v16 *ktv = (const v16 *)kt, *vfv = (const v16 *)vf;
    float *acc = state, *mx = state + B * H * D, *sum = mx + B * H;
    for (int64_t i = 0; i < B * H * D; i++) acc[i] = 0.0f;
    for (int64_t i = 0; i < B * H; i++) {
        mx[i] = -1e30f;
        sum[i] = 0.0f;
    }
    for (int64_t s = 0; s < nseg; s++) {
        const int64_t *sl = slots + seg[4 * s], nkeys = seg[4 * s + 1];
        const int64_t *mem = members + seg[4 * s + 2], nq = seg[4 * s + 3] * G;
        const int64_t nqp = (nq + QB - 1) / QB * QB;
        for (int64_t h = 0; h < KVH; h++) {
            for (int64_t i = 0; i < nqp; i++) {  /* the segment's queries of head group h */
                int64_t row = i < nq ? mem[i / G] * H + h * G + i % G : -1;
                rows[i] = row;
                for (int64_t d = 0; d < D; d++) {
                    qh[i * D + d] = row < 0 ? 0 : q[row * D + d];
                    qf[i * D + d] = row < 0 ? 0.0f : bf16_to_f32(q[row * D + d]) * scale;
                }
            }
            for (int64_t t = 0; t < AHEAD * KB && t < nkeys; t += KB)  /* the first tiles */
                prefetch_rows(kpool, vpool, sl + t, nkeys - t, KVH, h, D);
            for (int64_t b0 = 0; b0 < nkeys; b0 += KVS) {
                int64_t nbk = nkeys - b0 < KVS ? nkeys - b0 : KVS;
                for (int64_t t0 = 0; t0 < nbk; t0 += KB) {
                    int64_t nb = nbk - t0 < KB ? nbk - t0 : KB;
                    if (b0 + t0 + AHEAD * KB < nkeys)  /* rows AHEAD tiles on, while this runs */
                        prefetch_rows(kpool, vpool, sl + b0 + t0 + AHEAD * KB,
                                      nkeys - b0 - t0 - AHEAD * KB, KVH, h, D);
                    score_tile(qf, qh, scale, nq, nqp, kpool, vpool, sl + b0 + t0, nb, KVH,
                               h, D, kt, ktv, vf + t0 * D / VPACK, sc + t0);
                }
                for (int64_t i = 0; i < nq; i++) {  /* online softmax, then p @ V */
                    float *p = sc + i * KVS;
                    int64_t row = rows[i];
                    float mb = block_max(p, nbk);
                    float m_new = mx[row] > mb ? mx[row] : mb;
                    float corr = exp_f32(mx[row] - m_new), psum = 0.0f;
                    for (int64_t j = 0; j < nbk; j++) {  /* summed in float32, the weights */
                        float e = exp_f32(p[j] - m_new);  /* rounded to bfloat16 (as torch's */
                        psum += e;                        /* flash kernel does) */
                        p[j] = round_bf16(e);
                    }
                    mx[row] = m_new;
                    sum[row] = sum[row] * corr + psum;
#ifdef __AVX512BF16__
                    corrs[i] = corr;
                    uint32_t *pw = (uint32_t *)p;  /* the weights as pairs, in place */
                    if (nbk % 2) p[nbk] = 0.0f;  /* nbk < KVS: the row has room */
                    for (int64_t j = 0; j < nbk; j += 2) {
                        uint32_t lo, hi;
                        memcpy(&lo, p + j, 4);
                        memcpy(&hi, p + j + 1, 4);
                        pw[j / 2] = lo >> 16 | (hi & 0xFFFF0000u);
                    }
                }
                const uint32_t *vw = (const uint32_t *)vf;
                const int64_t np = (nbk + 1) / 2;
                for (int64_t i = 0; i < nq; i += 2) {  /* two queries share each V load */
                    int64_t i1 = i + 1 < nq ? i + 1 : i;
                    weigh_pairs((const uint32_t *)(sc + i * KVS), (const uint32_t *)(sc + i1 * KVS),
                                np, vw, D, acc + rows[i] * D, corrs[i],
                                i1 != i ? acc + rows[i1] * D : NULL, corrs[i1]);
                }
                (void)vfv;
                (void)DV;
#else
                    (void)corrs;
                    weigh_values(p, nbk, vfv, DV, (v16u *)(acc + row * D), corr);
                }
#endif
            }
        }
    }
    for (int64_t i = 0; i < B * H; i++) {
        float inv = 1.0f / sum[i];
        for (int64_t d = 0; d < D; d++) out[i * D + d] = f32_to_bf16(acc[i * D + d] * inv);
    }
    free(buf);
    free(rows);
    free(qh);
    free(corrs);
    return 0;
}
"""


class DecodeKernel:
    """The loaded library. `__call__` attends every decoding sequence over its segments."""

    def __init__(self, library: ctypes.CDLL) -> None:
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
        """q [B, H, D] bf16 -> [B, H, D] bf16. `k_buf`/`v_buf` [S, KVH, D] bf16 (one layer of
        the pool); `segments` int64 [n, 4] rows (offset into `slots`, key count, offset into
        `members`, member count); `slots`, `members` int64. Every sequence must take part in
        at least one segment with at least one key, and every slot must be a row of the pool
        (the kernel reads what it is told to, unchecked)."""
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
    """Whether the kernel serves these tensors: CPU, bfloat16, a contiguous pool, a head
    size that is a multiple of 16."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.bfloat16
        and k_buf.dtype == torch.bfloat16
        and k_buf.is_contiguous()
        and q.shape[-1] % 16 == 0
    )


@cache
def load() -> DecodeKernel | None:
    """The kernel, built on first use; None when it cannot be built here (no C compiler, a
    build error)."""
    library = c_library.build("decode_attention", SOURCE)
    return DecodeKernel(library) if library is not None else None
