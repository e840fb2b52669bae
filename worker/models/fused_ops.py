"""A layer's element-wise work in C for bfloat16 on CPU: RMSNorm (after the residual add),
RoPE, SwiGLU.

Between its linears a decoder layer runs some thirty small torch ops (casts, powers, means,
products, concatenations), each a dispatch and an allocation: at decode batch sizes their fixed
cost, not their arithmetic, is the time (several ms of a SmolLM2 step). Here each of the four
pieces is one C loop over the rows, and it rounds where torch's eager ops round, so the results
are eager's bits but for the order of a norm's sum of squares and the exp inside SiLU:

- `rms_norm`: `weight * bf16(x32 * rsqrt(mean(x32^2) + eps))`, optionally after `x = bf16(x +
  residual)` (the residual add before the post-attention norm, whose sum it also returns).
- `rope`: the rotate-half rotation `bf16(bf16(x * cos) + bf16(rotate_half(x) * sin))` of q and
  k, read straight out of the fused qkv projection, written contiguous.
- `silu_mul`: `bf16(bf16(silu(gate)) * up)` from the fused gate/up projection.

Built at first use by `worker.models.c_library` (plain C that the compiler vectorizes for this
CPU); `serves(x)` is false when it cannot be built, for another dtype or device, inside a
`torch.compile` graph (inductor fuses the same ops there), or when torch runs several threads
over a batch of many rows (torch's ops use them, these loops one); the layer then runs torch.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

import worker.models.c_library as c_library

PARALLEL_ROWS = 64  # with several torch threads, batches of more rows stay on torch's ops

SOURCE = c_library.BF16_SCALARS + r"""
/* rows x n: out = w * bf16(x * rsqrt(mean(x^2) + eps)). With res: x = bf16(x + res) first,
   stored to sum. Every row is n contiguous values; x, res, sum, out rows are n apart. */
void rms_norm(const uint16_t *x, const uint16_t *res, uint16_t *sum, const uint16_t *w,
              uint16_t *out, int64_t rows, int64_t n, float eps) {
    float buf[n];
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * n;
        float ss = 0.0f;
        if (res) {
            const uint16_t *rr = res + r * n;
            uint16_t *sr = sum + r * n;
            for (int64_t i = 0; i < n; i++) {
                uint16_t s = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(rr[i]));
                sr[i] = s;
                buf[i] = bf16_to_f32(s);
            }
        } else {
            for (int64_t i = 0; i < n; i++) buf[i] = bf16_to_f32(xr[i]);
        }
        for (int64_t i = 0; i < n; i++) ss += buf[i] * buf[i];
        float scale = 1.0f / __builtin_sqrtf(ss / (float)n + eps);
        uint16_t *o = out + r * n;
        for (int64_t i = 0; i < n; i++)
            o[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(buf[i] * scale));
    }
}

/* One head x [d] rotated by cos/sin [d] into o (rotate half: o = x * cos + [-x2, x1] * sin). */
static inline void rotate(const uint16_t *restrict x, const uint16_t *restrict c,
                          const uint16_t *restrict s, uint16_t *restrict o, int64_t half) {
    for (int64_t i = 0; i < half; i++)
        o[i] = f32_to_bf16(round_bf16(bf16_to_f32(x[i]) * bf16_to_f32(c[i])) +
                           round_bf16(-bf16_to_f32(x[i + half]) * bf16_to_f32(s[i])));
    for (int64_t i = half; i < 2 * half; i++)
        o[i] = f32_to_bf16(round_bf16(bf16_to_f32(x[i]) * bf16_to_f32(c[i])) +
                           round_bf16(bf16_to_f32(x[i - half]) * bf16_to_f32(s[i])));
}

/* The rotate-half RoPE of the q and k heads of rows of the fused projection qkv (row stride
   ld: H query heads, then KVH key heads, of d each), at cos/sin [rows, d], into q [rows, H, d]
   and k [rows, KVH, d]. */
void rope(const uint16_t *qkv, int64_t ld, int64_t rows, int64_t H, int64_t KVH, int64_t d,
          const uint16_t *cos, const uint16_t *sin, uint16_t *q, uint16_t *k) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *c = cos + r * d, *s = sin + r * d;
        for (int64_t h = 0; h < H; h++)
            rotate(qkv + r * ld + h * d, c, s, q + (r * H + h) * d, d / 2);
        for (int64_t h = 0; h < KVH; h++)
            rotate(qkv + r * ld + (H + h) * d, c, s, k + (r * KVH + h) * d, d / 2);
    }
}

/* out [rows, m] = bf16(bf16(silu(gate)) * up), gate and up the halves of gu [rows, 2m]. */
void silu_mul(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t m) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *restrict g = gu + r * 2 * m, *restrict u = g + m;
        uint16_t *restrict o = out + r * m;
        for (int64_t i = 0; i < m; i++) {
            float x = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(round_bf16(x / (1.0f + exp_f32(-x))) * bf16_to_f32(u[i]));
        }
    }
}
"""

_P = ctypes.c_void_p
_I = ctypes.c_int64


class FusedOps:
    """The loaded library's three loops, over torch tensors."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._norm = library.rms_norm
        self._norm.restype = None
        self._norm.argtypes = [_P] * 5 + [_I, _I, ctypes.c_float]
        self._rope = library.rope
        self._rope.restype = None
        self._rope.argtypes = [_P, _I, _I, _I, _I, _I, _P, _P, _P, _P]
        self._silu = library.silu_mul
        self._silu.restype = None
        self._silu.argtypes = [_P, _P, _I, _I]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, n] contiguous -> the normed rows [T, n]."""
        out = torch.empty_like(x)
        self._norm(x.data_ptr(), None, None, weight.data_ptr(), out.data_ptr(), x.shape[0],
                   x.shape[1], eps)  # fmt: skip
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, its normed rows), both [T, n]; x and residual contiguous."""
        total, out = torch.empty_like(x), torch.empty_like(x)
        self._norm(x.data_ptr(), residual.data_ptr(), total.data_ptr(), weight.data_ptr(),
                   out.data_ptr(), x.shape[0], x.shape[1], eps)  # fmt: skip
        return total, out

    def rope(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv [T, (H + 2 KVH) * D] contiguous, cos/sin [T, 1, D] contiguous -> the rotated
        q [T, H, D] and k [T, KVH, D]."""
        rows = qkv.shape[0]
        q = qkv.new_empty((rows, num_heads, head_dim))
        k = qkv.new_empty((rows, num_kv_heads, head_dim))
        self._rope(qkv.data_ptr(), qkv.shape[1], rows, num_heads, num_kv_heads, head_dim,
                   cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr())  # fmt: skip
        return q, k

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2m] contiguous -> silu(gate) * up [T, m]."""
        rows, m = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty((rows, m))
        self._silu(gate_up.data_ptr(), out.data_ptr(), rows, m)
        return out


def serves(x: torch.Tensor) -> FusedOps | None:
    """The loops, where they serve the activations `x` [T, n] (see the module docstring)."""
    if (
        x.dtype != torch.bfloat16
        or x.device.type != "cpu"
        or torch.compiler.is_compiling()
        or (x.shape[0] > PARALLEL_ROWS and torch.get_num_threads() > 1)
    ):
        return None
    return load()


@cache
def load() -> FusedOps | None:
    """The loops, built on first use; None when they cannot be built here."""
    library = c_library.build("fused_ops", SOURCE)
    return FusedOps(library) if library is not None else None
