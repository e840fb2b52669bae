"""A CPU prefill-attention kernel in C for bfloat16 (AVX512-BF16), over the KV pool in place.

A prefill chunk of `nq` tokens attends causally to `nk` keys: its cached prefix and itself,
query i seeing keys 0 .. nk - nq + i (the mask aligned to the end). Torch's CPU flash kernel
does this at ~40 GFLOP/s on one Zen 4 core in bf16 and needs the prefix gathered out of the
pool first. Here, per KV head, the chunk's keys are read from the pool by slot once and packed
into pair words (K as `[blocks][D/2][32]`, two dims of a key per word; V as `[keys/2][D]`, a
dim of two consecutive keys per word); then blocks of queries (each query head of the group a
row) walk the key blocks up to their diagonal with an online softmax: scores as `vdpbf16ps`
over pairs (products exact, sums float32) times the scale, the running max and sum in float32,
the weights rounded to bf16 (as torch's flash kernel rounds them) and multiplied with V pairs,
the output rounded once. Keys past a row's diagonal get no weight.

Built at first use by `worker.models.c_library` where the CPU has AVX512-BF16; `load()` returns
None elsewhere (or without a compiler), and prefill keeps torch's flash kernel.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

import worker.models.c_library as c_library

ROWS = 48  # query rows (tokens x query heads of a KV head) per block, about

SOURCE = c_library.AVX512_EXP + r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512BF16__
#include <immintrin.h>

#define KB 32  /* keys per block */

static inline __m512 dp(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* Scores of 8 query rows (qw: [8][D2] pair words) against one packed key block (kw:
   [D2][32] words), times scale, into s [8][32]. */
static inline void score8(const uint32_t *qw, int64_t D2, const uint32_t *kw, float scale,
                          float *s) {
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
        _mm512_storeu_ps(s + r * KB, _mm512_mul_ps(a[r][0], sc));
        _mm512_storeu_ps(s + r * KB + 16, _mm512_mul_ps(a[r][1], sc));
    }
}

/* acc[r] = acc[r] * corr[r] + p[r] . V for 4 rows: pw [4][16] pair words of weights, vw
   [16][D] pair words of values, acc [4][D] float32 (D a multiple of 64). */
static inline void weigh4(const uint32_t *pw, const uint32_t *vw, int64_t D, float *acc,
                          const float *corr) {
    for (int64_t d = 0; d < D; d += 64) {
        __m512 x[4][4];
        for (int r = 0; r < 4; r++) {
            __m512 c = _mm512_set1_ps(corr[r]);
            for (int u = 0; u < 4; u++)
                x[r][u] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d + 16 * u), c);
        }
        for (int jp = 0; jp < KB / 2; jp++) {
            const uint32_t *v = vw + jp * D + d;
            __m512i v0 = _mm512_loadu_si512(v), v1 = _mm512_loadu_si512(v + 16);
            __m512i v2 = _mm512_loadu_si512(v + 32), v3 = _mm512_loadu_si512(v + 48);
            for (int r = 0; r < 4; r++) {
                __m512i b = _mm512_set1_epi32((int)pw[r * (KB / 2) + jp]);
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
    float *s = aligned_alloc(64, (size_t)rows * KB * 4 + 64);
    uint32_t *pw = aligned_alloc(64, (size_t)rows * (KB / 2) * 4 + 64);
    float *acc = aligned_alloc(64, (size_t)rows * D * 4 + 64);
    float *mx = malloc(rows * 4), *sum = malloc(rows * 4), *corr = malloc(rows * 4);
    if (!kp || !vp || !qw || !s || !pw || !acc || !mx || !sum || !corr) {
        free(kp); free(vp); free(qw); free(s); free(pw); free(acc); free(mx); free(sum);
        free(corr);
        return 1;
    }
    for (int64_t h = 0; h < KVH; h++) {
        /* this head's keys and values, packed in pairs; keys past nk are zero */
        memset(kp, 0, (size_t)nblk * D2 * KB * 4);
        memset(vp, 0, (size_t)nblk * (KB / 2) * D * 4);
        for (int64_t j = 0; j < nk; j++) {
            const uint32_t *kr = (const uint32_t *)(kpool + (slots[j] * KVH + h) * D);
            uint32_t *kb = kp + (j / KB) * D2 * KB + j % KB;
            for (int64_t w = 0; w < D2; w++) kb[w * KB] = kr[w];
            const uint16_t *vr = vpool + (slots[j] * KVH + h) * D;
            uint16_t *vb = (uint16_t *)(vp + (j / 2) * D) + j % 2;
            for (int64_t d = 0; d < D; d++) vb[2 * d] = vr[d];
        }
        for (int64_t i0 = 0; i0 < nq; i0 += qi) {
            const int64_t ni = nq - i0 < qi ? nq - i0 : qi, used = ni * G;
            /* row r: query i0 + r / G, head h * G + r % G; padding rows are zero */
            memset(qw, 0, (size_t)rows * D2 * 4);
            for (int64_t r = 0; r < used; r++)
                memcpy(qw + r * D2, q + ((i0 + r / G) * H + h * G + r % G) * D, D * 2);
            for (int64_t r = 0; r < rows; r++) {
                mx[r] = -1e30f;
                sum[r] = 0.0f;
            }
            memset(acc, 0, (size_t)rows * D * 4);
            const int64_t last = nk - nq + i0 + ni - 1;  /* the block's last visible key */
            for (int64_t b = 0; b * KB <= last; b++) {
                for (int64_t r = 0; r < rows; r += 8)
                    score8(qw + r * D2, D2, kp + b * D2 * KB, scale, s + r * KB);
                for (int64_t r = 0; r < rows; r++) {
                    int64_t vis = r < used ? nk - nq + i0 + r / G - b * KB + 1 : 0;
                    vis = vis > KB ? KB : vis;
                    if (vis <= 0) {  /* nothing of this block is visible to the row */
                        corr[r] = 1.0f;
                        memset(pw + r * (KB / 2), 0, KB * 2);
                        continue;
                    }
                    __mmask16 m0 = vis >= 16 ? 0xFFFF : (__mmask16)((1u << vis) - 1u);
                    __mmask16 m1 = vis >= 32 ? 0xFFFF
                                 : vis > 16 ? (__mmask16)((1u << (vis - 16)) - 1u) : 0;
                    __m512 s0 = _mm512_loadu_ps(s + r * KB), s1 = _mm512_loadu_ps(s + r * KB + 16);
                    __m512 lo = _mm512_set1_ps(-1e30f);
                    float bm = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(lo, m0, s0),
                                                                  _mm512_mask_mov_ps(lo, m1, s1)));
                    float m_new = mx[r] > bm ? mx[r] : bm;
                    __m512 mn = _mm512_set1_ps(m_new);
                    __m512 e0 = _mm512_maskz_mov_ps(m0, exp16(_mm512_sub_ps(s0, mn)));
                    __m512 e1 = _mm512_maskz_mov_ps(m1, exp16(_mm512_sub_ps(s1, mn)));
                    corr[r] = _mm512_cvtss_f32(exp16(_mm512_set1_ps(mx[r] - m_new)));
                    sum[r] = sum[r] * corr[r] + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
                    mx[r] = m_new;
                    /* the weights as bf16, in key order: word jp is keys 2jp, 2jp + 1 */
                    _mm512_storeu_si512(pw + r * (KB / 2), (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
                }
                for (int64_t r = 0; r < rows; r += 4)
                    weigh4(pw + r * (KB / 2), vp + b * (KB / 2) * D, D, acc + r * D, corr + r);
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


class PrefillKernel:
    """The loaded library: `__call__` attends one prefill chunk over its keys in the pool."""

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.prefill_attention
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
        """q [nq, H, D] bf16 -> [nq, H, D] bf16, causal and aligned to the end over the keys at
        `slots` (int64 [nk], nk >= nq: the cached prefix, then the chunk's own, already written
        to `k_buf`/`v_buf` [S, KVH, D] bf16). Slots are read unchecked."""
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
    """Whether the kernel serves these tensors: CPU, bfloat16 queries and pool, a contiguous
    pool, a head size that is a multiple of 64."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.bfloat16
        and k_buf.dtype == torch.bfloat16
        and k_buf.is_contiguous()
        and q.shape[-1] % 64 == 0
    )


@cache
def load() -> PrefillKernel | None:
    """The kernel, built on first use; None where the CPU lacks AVX512-BF16 or no build."""
    library = c_library.build("prefill_attention", SOURCE)
    if library is None or not library.prefill_attention_available():
        return None
    return PrefillKernel(library)
