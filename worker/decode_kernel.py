"""A CPU decode-attention kernel in C that reads the bfloat16 KV pool in place, built at first use.

Torch's CPU flash kernel is tuned for long query blocks; a decode step hands it one query per
sequence (a few query heads per KV head), and then its fixed cost per (sequence, head) and its
per-key work dominate, and the KV has to be gathered out of the pool first. This kernel walks
*segments*: a list of key slots (read straight from the pool, no gather) and the sequences whose
queries attend to them, for every KV head. Each query keeps an online-softmax state (running
max, sum, float32 accumulator) across the segments it takes part in, so a group's shared prefix
(one segment, all its members' queries) and each member's own keys (one segment each) need no
separate merge, mask or padding. Scores, softmax and the weighted sum are float32; the output is
rounded to bfloat16 once.

The source is compiled with the system C compiler (`cc -O3 -march=native`, about a second) into
`kernels/` of the model cache (`$RADIXRAY_CACHE`, default ~/.cache/radixray/models), keyed by
source, flags and the CPU's instruction set, and loaded with ctypes (which releases the GIL
during the call). `load()` returns None when there is no compiler or the build fails; the
`native` backend then keeps its pure-torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from worker.models.builtin import cache_root

logger = logging.getLogger(__name__)

# Reassociation (to vectorize the sums and maxima), but not -ffast-math: with GCC < 13 a shared
# library built with it sets flush-to-zero for the whole process when it is loaded.
FLAGS = [
    "-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
    "-fassociative-math", "-ffp-contract=fast", "-fPIC", "-shared", "-std=c11",
]  # fmt: skip

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KB 32    /* keys per score tile: two vectors of 16 */
#define KVS 512  /* keys per softmax block (torch's flash kernel uses the same) */
#define QB 4   /* queries per score tile */
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

/* Scores of the nq queries qf [nqp, D] (scaled) against nb <= KB keys at slots sl, head h,
   into sc[i * KVS + j]; the keys' values, as float32, into vf [KB, D]. */
static void score_tile(const float *qf, int64_t nq, int64_t nqp, const uint16_t *kpool,
                       const uint16_t *vpool, const int64_t *sl, int64_t nb, int64_t KVH,
                       int64_t h, int64_t D, float *kt, const v16 *ktv, float *vf, float *sc) {
    const int64_t DV = D / 16;
    const uint16_t *kr[KB];
    for (int64_t j = 0; j < KB; j++) {  /* a short tile repeats its first key (unused) */
        int64_t off = (sl[j < nb ? j : 0] * KVH + h) * D;
        kr[j] = kpool + off;
        for (int64_t d = 0; d < D; d++) vf[j * D + d] = bf16_to_f32(vpool[off + d]);
    }
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
    if (!buf || !rows) {
        free(buf);
        free(rows);
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
                for (int64_t d = 0; d < D; d++)
                    qf[i * D + d] = row < 0 ? 0.0f : bf16_to_f32(q[row * D + d]) * scale;
            }
            for (int64_t b0 = 0; b0 < nkeys; b0 += KVS) {
                int64_t nbk = nkeys - b0 < KVS ? nkeys - b0 : KVS;
                for (int64_t t0 = 0; t0 < nbk; t0 += KB) {
                    int64_t nb = nbk - t0 < KB ? nbk - t0 : KB;
                    score_tile(qf, nq, nqp, kpool, vpool, sl + b0 + t0, nb, KVH, h, D, kt, ktv,
                               vf + t0 * D, sc + t0);
                }
                for (int64_t i = 0; i < nq; i++) {  /* online softmax, then p @ V */
                    float *p = sc + i * KVS;
                    int64_t row = rows[i];
                    float mb = p[0];
                    for (int64_t j = 1; j < nbk; j++) mb = p[j] > mb ? p[j] : mb;
                    float m_new = mx[row] > mb ? mx[row] : mb;
                    float corr = exp_f32(mx[row] - m_new), psum = 0.0f;
                    for (int64_t j = 0; j < nbk; j++) {  /* summed in float32, the weights */
                        float e = exp_f32(p[j] - m_new);  /* rounded to bfloat16 (as torch's */
                        psum += e;                        /* flash kernel does) */
                        p[j] = round_bf16(e);
                    }
                    mx[row] = m_new;
                    sum[row] = sum[row] * corr + psum;
                    weigh_values(p, nbk, vfv, DV, (v16u *)(acc + row * D), corr);
                }
            }
        }
    }
    for (int64_t i = 0; i < B * H; i++) {
        float inv = 1.0f / sum[i];
        for (int64_t d = 0; d < D; d++) out[i * D + d] = f32_to_bf16(acc[i * D + d] * inv);
    }
    free(buf);
    free(rows);
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
    """The kernel, built on first use (cached on disk by source, flags and CPU); None when it
    cannot be built here (no C compiler, not x86-64/aarch64 Linux or macOS, a build error)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.info("no C compiler: the CPU decode kernel is off (pure-torch attention)")
        return None
    key = hashlib.sha256((SOURCE + " ".join(FLAGS) + _cpu()).encode()).hexdigest()
    directory = cache_root() / "kernels"
    library = directory / f"decode_attention_{key[:16]}.so"
    try:
        if not library.exists():
            _build(compiler, directory, library)
        return DecodeKernel(ctypes.CDLL(str(library)))
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("CPU decode kernel unavailable, using pure-torch attention: %s", e)
        return None


def _cpu() -> str:
    """The machine and its instruction-set flags: `-march=native` builds for this CPU, and a
    cache directory shared between nodes must not hand one CPU's build to another (an
    instruction the other lacks would kill the process)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine() + " " + (flags or platform.processor())


def _build(compiler: str, directory: Path, library: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        source = Path(tmp) / "decode_attention.c"
        source.write_text(SOURCE)
        built = Path(tmp) / library.name
        subprocess.run(
            [compiler, *FLAGS, str(source), "-o", str(built)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(built, library)  # atomic: concurrent builders never load a partial file
