"""What the few-rows C linears share (`pair_gemm` in bfloat16, `f32_gemm` in float32): the call
over a weight packed in the kernel's layout, and that layout's groups of outputs.

Each kernel's library exports `fn(x, w, bias, out, rows, k, o)`: `x` [rows, k] and `out`
[rows, o] row-major in the kernel's dtype, `w` the weight in the kernel's layout (outputs in
groups, the last padded with zero outputs), `bias` [o] or NULL.
"""

from __future__ import annotations

import copy
import ctypes
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch


class FewRowsLinear:
    """A loaded kernel: `__call__` is the linear over a weight its module's `pack` made."""

    dtype: torch.dtype  # of x, the weight, the bias and the output: set by each kernel

    def __init__(self, fn: ctypes._CFuncPtr, max_rows: int) -> None:
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
        self._fn = fn
        self.max_rows = max_rows  # linears over more rows go to oneDNN (`packed.linear`)

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


def median_seconds(fn, repeat: int) -> float:
    """Median wall seconds of `repeat` calls of `fn`, after one to warm up."""
    fn()  # warm
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


@contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread inside: the kernels are timed as they run (one engine a core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def onednn_timer(weights: Sequence[torch.Tensor], repeat: int) -> Callable[[torch.Tensor], float]:
    """x -> median seconds of oneDNN's packed linear over x with each of `weights` ([O, K],
    packed as `packed.pack_linears` packs them) in turn: what a kernel must beat to be used."""
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights]  # packed.BATCH_HINT
    return lambda x: median_seconds(
        lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in onednn],
        repeat)


def rows_won(
    kernel: FewRowsLinear,
    pack: Callable[[torch.Tensor], torch.Tensor],
    dtype: torch.dtype,
    rows: Sequence[int],
    memory_bytes: int,
    repeat: int,
    gen: torch.Generator,
) -> int:
    """The most of `rows` (in order, up to the first at which it loses) at which `kernel` takes
    less median time than oneDNN's packed linear, on one thread, over `memory_bytes` of distinct
    layer-sized (1536x576) `dtype` weights, so that they come from memory as in a decode step; 0
    where it loses at the first. `pack` puts a weight in the kernel's layout."""
    o, k = 1536, 576
    count = max(1, memory_bytes // (o * k * dtype.itemsize))
    dense = [torch.randn(o, k, generator=gen).to(dtype) for _ in range(count)]
    packed = [pack(w) for w in dense]
    onednn = onednn_timer(dense, repeat)
    best = 0
    with one_thread():
        for n in rows:
            x = torch.randn(n, k, generator=gen).to(dtype)
            ours = median_seconds(lambda x=x: [kernel(x, w, None, o) for w in packed], repeat)
            if ours >= onednn(x):
                break
            best = n
    return best
