/* float32, for any CPU, on float_vectors.h (VW lanes). Per KV head the chunk's keys are
   packed transposed in blocks of KB (`[blocks][D][KB]`, zero past nk) so that a score tile is SR
   rows x two vectors of keys, each dim of a block loaded once for the SR rows; the values are
   read where they lie in the pool. Spans of SB keys as in the bf16 kernel: the span's scores up
   to each row tile's diagonal, then per row the exact softmax against the running max (e^x as
   exp_f32's polynomial on VW lanes), then p.V a row tile at a time. Every sum float32. */
#include "float_vectors.h"

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
