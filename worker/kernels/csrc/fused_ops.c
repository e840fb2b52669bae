/* RMSNorm, RoPE and SwiGLU loops (worker/kernels/fused_ops.py says how they round); built once
   for bfloat16 and once with -DELEM_F32 for float32. */
#include "bf16_scalars.h"
#include "element.h"


/* rows x n: out = w * A(x * rsqrt(mean(x^2) + eps)), A the activations' rounding (to bf16;
   none in float32). With res: x = A(x + res) first, stored to sum. Every row is n contiguous
   values; x, res, sum, out rows are n apart. */
void rms_norm(const elem_t *x, const elem_t *res, elem_t *sum, const elem_t *w, elem_t *out,
              int64_t rows, int64_t n, float eps) {
    float buf[n];
    for (int64_t r = 0; r < rows; r++) {
        const elem_t *xr = x + r * n;
        float ss = 0.0f;
        if (res) {
            const elem_t *rr = res + r * n;
            elem_t *sr = sum + r * n;
            for (int64_t i = 0; i < n; i++) {
                elem_t s = E_STORE(E_LOAD(xr[i]) + E_LOAD(rr[i]));
                sr[i] = s;
                buf[i] = E_LOAD(s);
            }
        } else {
            for (int64_t i = 0; i < n; i++) buf[i] = E_LOAD(xr[i]);
        }
        for (int64_t i = 0; i < n; i++) ss += buf[i] * buf[i];
        float scale = 1.0f / __builtin_sqrtf(ss / (float)n + eps);
        elem_t *o = out + r * n;
        for (int64_t i = 0; i < n; i++)
            o[i] = E_STORE(E_LOAD(w[i]) * E_ROUND(buf[i] * scale));
    }
}

/* One head x [d] rotated by cos/sin [d] into o (rotate half: o = x * cos + [-x2, x1] * sin). */
static inline void rotate(const elem_t *restrict x, const elem_t *restrict c,
                          const elem_t *restrict s, elem_t *restrict o, int64_t half) {
    for (int64_t i = 0; i < half; i++)
        o[i] = E_STORE(E_ROUND(E_LOAD(x[i]) * E_LOAD(c[i])) +
                       E_ROUND(-E_LOAD(x[i + half]) * E_LOAD(s[i])));
    for (int64_t i = half; i < 2 * half; i++)
        o[i] = E_STORE(E_ROUND(E_LOAD(x[i]) * E_LOAD(c[i])) +
                       E_ROUND(E_LOAD(x[i - half]) * E_LOAD(s[i])));
}

/* The rotate-half RoPE of the q and k heads of rows of the fused projection qkv (row stride
   ld: H query heads, then KVH key heads, of d each), at cos/sin [rows, d], into q [rows, H, d]
   and k [rows, KVH, d]. */
void rope(const elem_t *qkv, int64_t ld, int64_t rows, int64_t H, int64_t KVH, int64_t d,
          const elem_t *cos, const elem_t *sin, elem_t *q, elem_t *k) {
    for (int64_t r = 0; r < rows; r++) {
        const elem_t *c = cos + r * d, *s = sin + r * d;
        for (int64_t h = 0; h < H; h++)
            rotate(qkv + r * ld + h * d, c, s, q + (r * H + h) * d, d / 2);
        for (int64_t h = 0; h < KVH; h++)
            rotate(qkv + r * ld + (H + h) * d, c, s, k + (r * KVH + h) * d, d / 2);
    }
}

/* out [rows, m] = A(A(silu(gate)) * up), gate and up the halves of gu [rows, 2m]. */
void silu_mul(const elem_t *gu, elem_t *out, int64_t rows, int64_t m) {
    for (int64_t r = 0; r < rows; r++) {
        const elem_t *restrict g = gu + r * 2 * m, *restrict u = g + m;
        elem_t *restrict o = out + r * m;
        for (int64_t i = 0; i < m; i++) {
            float x = E_LOAD(g[i]);
            o[i] = E_STORE(E_ROUND(x / (1.0f + exp_f32(-x))) * E_LOAD(u[i]));
        }
    }
}
