"""Timing at load: up to how many rows (or queries) one path beats another on this core.

Which of two paths serves a linear, or an attention chunk, depends on the core: the same kernel
beats oneDNN at one row on one CPU and loses on the next, and torch's BLAS beats oneDNN's
packed weights over many rows on one and loses on another (docs/engine.md). So each choice is
made where it runs, once per process: both paths timed as they run, at a list of sizes in
order, until the first size at which the path being tried loses (`most_won`). The callers:
`f32_gemm`, `pair_gemm` and `quant_gemm` (their few-rows kernels against the float32 path or
oneDNN), `linear` (torch's BLAS against oneDNN over many rows) and `worker.attention.native` (the
prefill kernel against torch's attention).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F

# a layer-sized weight ([out, in]): what the few-rows linears are timed over
LAYER_OUT, LAYER_IN = 1536, 576
# SmolLM2-135M's projections of its 576 hidden dims (qkv, o, gate_up): a layer's linears over
# many rows, where one weight alone times within the noise
LAYER_PROJECTIONS = (960, 576, 3072)

Timer = Callable[[torch.Tensor], float]  # x -> median seconds a weight of one path over x


def median_seconds(fn: Callable[[], object], repeat: int) -> float:
    """Median wall seconds of `repeat` calls of `fn`, after one to warm up."""
    fn()  # warm
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Torch on `threads` threads inside: a path is timed on the threads it runs on (the
    few-rows kernels on one: one engine a core)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def most_won(
    sizes: Sequence[int], ours: Callable[[int], float], theirs: Callable[[int], float]
) -> int:
    """The last of `sizes` (walked in order, up to the first at which `ours(size)` is not below
    `theirs(size)`) at which ours took less time; 0 where it loses at the first. Each size is
    timed ours first, and nothing is timed past the first loss."""
    best = 0
    for size in sizes:
        if ours(size) >= theirs(size):
            break
        best = size
    return best


def layer_weights(
    dtype: torch.dtype, memory_bytes: int, gen: torch.Generator
) -> list[torch.Tensor]:
    """Distinct layer-sized `dtype` weights, `memory_bytes` of them (at least one): a pass over
    more than a core's cache reads them from memory, as a decode step does."""
    count = max(1, memory_bytes // (LAYER_OUT * LAYER_IN * dtype.itemsize))
    return [torch.randn(LAYER_OUT, LAYER_IN, generator=gen).to(dtype) for _ in range(count)]


def layer_projections(dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    """`LAYER_PROJECTIONS`' weights in `dtype`, [out, LAYER_IN] each."""
    return [torch.randn(o, LAYER_IN, generator=gen).to(dtype) for o in LAYER_PROJECTIONS]


def per_weight(call: Callable[[torch.Tensor, torch.Tensor], object],
               weights: Sequence[torch.Tensor], repeat: int) -> Timer:
    """`call(x, w)` over each of `weights` in turn: the median seconds of a pass, per weight."""
    return lambda x: median_seconds(lambda: [call(x, w) for w in weights], repeat) / len(weights)


def kernel_timer(
    kernel: Callable[..., torch.Tensor], layouts: Sequence[torch.Tensor], repeat: int
) -> Timer:
    """A few-rows kernel (`few_rows.FewRowsLinear`, `quant_gemm.QuantGemm`) over each of
    `layouts` (layer-sized weights in its layout) in turn."""
    return per_weight(lambda x, w: kernel(x, w, None, LAYER_OUT), layouts, repeat)


def onednn_timer(weights: Sequence[torch.Tensor], repeat: int) -> Timer:
    """oneDNN's linear over each of `weights` ([O, K]) in turn, packed as `linear.pack_linears`
    packs them: what the other paths are measured against."""
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights]  # linear.BATCH_HINT
    return per_weight(
        lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), onednn, repeat)


def dense_timer(weights: Sequence[torch.Tensor], repeat: int) -> Timer:
    """`F.linear` over each of the dense `weights` in turn (torch's BLAS: MKL in float32)."""
    return per_weight(F.linear, weights, repeat)


def rows_won(
    ours: Timer,
    theirs: Timer,
    rows: Sequence[int],
    dtype: torch.dtype,
    gen: torch.Generator,
    threads: int = 1,
) -> int:
    """`most_won` over `rows`: ours against theirs, a weight each, over [n, LAYER_IN] `dtype`
    inputs of each row count n, on `threads` torch threads."""

    def timed(path: Timer) -> Callable[[int], float]:
        return lambda n: path(inputs[n])

    inputs = {n: torch.randn(n, LAYER_IN, generator=gen).to(dtype) for n in rows}
    with torch_threads(threads):
        return most_won(rows, timed(ours), timed(theirs))
