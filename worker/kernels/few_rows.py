"""What the few-rows C linears share (`pair_gemm` in bfloat16, `f32_gemm` in float32): the call
over a weight packed in the kernel's layout, and that layout's groups of outputs.

Each kernel's library exports `fn(x, w, bias, out, rows, k, o)`: `x` [rows, k] and `out`
[rows, o] row-major in the kernel's dtype, `w` the weight in the kernel's layout (outputs in
groups, the last padded with zero outputs), `bias` [o] or NULL.
"""

from __future__ import annotations

import copy
import ctypes

import torch


class FewRowsLinear:
    """A loaded kernel: `__call__` is the linear over a weight its module's `pack` made."""

    dtype: torch.dtype  # of x, the weight, the bias and the output: set by each kernel

    def __init__(self, fn: ctypes._CFuncPtr, max_rows: int) -> None:
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
        self._fn = fn
        self.max_rows = max_rows  # linears over more rows go to oneDNN (`linear.linear`)

    def up_to(self, rows: int) -> FewRowsLinear:
        """The same kernel, taking linears of at most `rows` rows."""
        limited = copy.copy(self)
        limited.max_rows = rows
        return limited

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
    ) -> torch.Tensor:
        """x [..., K] (any rows; `linear` sends it at most `max_rows`) -> [..., out_features]."""
        k = x.shape[-1]
        x2 = x.reshape(-1, k).contiguous()
        out = torch.empty((*x.shape[:-1], out_features), dtype=self.dtype)
        self._fn(
            x2.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
            out.data_ptr(), x2.shape[0], k, out_features,
        )  # fmt: skip
        return out


def output_groups(weight: torch.Tensor, group: int) -> torch.Tensor:
    """[O, K] -> [ceil(O / group), group, K]: the outputs in groups, the last padded with zero
    outputs (a view of `weight` where O is a multiple of `group`)."""
    o, k = weight.shape
    padded = -(-o // group) * group
    w = weight.detach()
    if padded != o:
        w = torch.cat([w, w.new_zeros(padded - o, k)])
    return w.view(padded // group, group, k)
