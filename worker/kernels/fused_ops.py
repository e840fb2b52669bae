"""A layer's element-wise work in C for bfloat16 and float32 on CPU: RMSNorm (after the residual
add), RoPE, SwiGLU.

Between its linears a decoder layer runs some thirty small torch ops (casts, powers, means,
products, concatenations), each a dispatch and an allocation: at decode batch sizes their fixed
cost, not their arithmetic, is the time (several ms of a SmolLM2 step). Here each of the four
pieces is one C loop over the rows. In bfloat16 it rounds where torch's eager ops round, so the
results are eager's bits but for the order of a norm's sum of squares and the exp inside SiLU:

- `rms_norm`: `weight * bf16(x32 * rsqrt(mean(x32^2) + eps))`, optionally after `x = bf16(x +
  residual)` (the residual add before the post-attention norm, whose sum it also returns).
- `rope`: the rotate-half rotation `bf16(bf16(x * cos) + bf16(rotate_half(x) * sin))` of q and
  k, read straight out of the fused qkv projection, written contiguous.
- `silu_mul`: `bf16(bf16(silu(gate)) * up)` from the fused gate/up projection.

The float32 build (`load(torch.float32)`, the same source with `ELEM_F32`) computes the same
formulas without the roundings, so its results are within float32 rounding of eager's (the
compiler may fuse a product into an add, the norm's sum and the exp run in their own order).
A float32 decode step is faster with them (docs/engine.md, "Float32 decode").

Built at first use by `worker.kernels.build` (plain C that the compiler vectorizes for this
CPU), once per dtype; `serves(x)` is None when they cannot be built, for another dtype or
device, inside a `torch.compile` graph (inductor fuses the same ops there), or when torch runs
several threads over a batch of many rows (torch's ops use them, these loops one); the layer
then runs torch.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

import worker.kernels.build as builder

PARALLEL_ROWS = 64  # with several torch threads, batches of more rows stay on torch's ops

SOURCE = "fused_ops.c"  # in csrc/

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
        x.dtype not in builder.ELEMENT_DTYPES
        or x.device.type != "cpu"
        or torch.compiler.is_compiling()
        or (x.shape[0] > PARALLEL_ROWS and torch.get_num_threads() > 1)
    ):
        return None
    return load(x.dtype)


@cache
def load(dtype: torch.dtype = torch.bfloat16) -> FusedOps | None:
    """The loops for activations of `dtype`, built on first use; None when they cannot be
    built here."""
    library = builder.build_for("fused_ops", SOURCE, dtype)
    return FusedOps(library) if library is not None else None
