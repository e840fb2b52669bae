"""float32 linears over a few rows (decode batches) in C, the weight packed once.

The float32 counterpart of `worker.kernels.pair_gemm`, for CPUs that serve float32 (those
without bf16 units, where `auto` keeps a float32 checkpoint's dtype). A decode step reads every
weight once: in float32, twice the bytes of bf16. oneDNN's packed float32 linear reads them well
below what the core can stream at a few rows, bound by its own arithmetic; this kernel keeps the
stream near what the core can read. The weight is packed once (`F32Gemm.pack`) into groups of
outputs, input by input within a group (`[O/G][K][G]`), so each input's G weights are
consecutive vectors, multiplied by that input broadcast and added into the group's float32 sums,
a block of rows sharing each load: with AVX-512 groups of 64 (four 16-float vectors) and blocks
of up to 6 rows; elsewhere groups of 8 (one 8-float vector) and blocks of up to 8 rows, so up to
8 rows take the weights from memory once. Plain C on GCC's vector types, so it builds for any
x86 or Arm CPU. Measured by `bench/bench_linears.py --dtype float32` on SmolLM2-135M's layer
shapes (one thread, 30 layers' weights from memory): see docs/engine.md.

Each output is one float32 sum over the inputs in order, then the bias, however many rows share
the call (a row's result does not depend on the rows beside it): not oneDNN's order, so results
differ from its in the last bits.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache

import torch

import worker.kernels.build as builder
from worker.kernels.calibration import kernel_timer, layer_weights, onednn_timer, rows_won
from worker.kernels.few_rows import FewRowsLinear, output_groups

logger = logging.getLogger(__name__)

MAX_ROWS = 32  # up to this many rows a linear takes this kernel; more go to oneDNN
CALIBRATION_ROWS = (1, 2, 4, 8, 16, MAX_ROWS)  # the row counts `calibrate` times
CALIBRATION_BYTES = 64 << 20  # of distinct weights `calibrate` streams: more than a core's cache

SOURCE = "f32_linear.c"  # in csrc/


class F32Gemm(FewRowsLinear):
    """The loaded library: `__call__` is the linear over a weight made by its `pack`."""

    dtype = torch.float32

    def __init__(self, library: ctypes.CDLL, max_rows: int) -> None:
        super().__init__(library.f32_linear, max_rows)
        library.f32_group.restype = ctypes.c_int
        self.group = library.f32_group()  # outputs per group of its layout: 64 or 8 (SOURCE)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[O, K] -> this build's layout `[ceil(O/G), K, G]`, outputs past O zero."""
        return output_groups(weight, self.group).transpose(1, 2).contiguous()


def can_pack(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """A CPU float32 [O, K] weight (and a contiguous float32 bias, if any)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[O, K] in the layout of the kernel built here (`linear.pack_linears` calls it only where
    `load` gave a kernel)."""
    kernel = build()
    if kernel is None:
        raise RuntimeError("no float32 few-rows kernel here (no C compiler)")
    return kernel.pack(weight)


@cache
def build() -> F32Gemm | None:
    """The kernel as built here, taking up to `MAX_ROWS` rows; None where it cannot be built (no
    C compiler). `load` decides whether, and up to how many rows, linears take it."""
    library = builder.build("f32_linear", SOURCE)
    return F32Gemm(library, MAX_ROWS) if library is not None else None


@cache
def load() -> F32Gemm | None:
    """The kernel where it beats oneDNN's packed linear on this core, its `max_rows` the most
    rows it does (`calibrate`); None where it does not at one row, or cannot be built."""
    kernel = build()
    if kernel is None:
        return None
    rows = calibrate(kernel)
    if rows == 0:
        logger.info("float32 linears: oneDNN (the C kernel is slower on this core)")
        return None
    logger.info("float32 linears: C kernel up to %d rows", rows)
    return kernel.up_to(rows)


def calibrate(kernel: F32Gemm, repeat: int = 5) -> int:
    """The most rows (of `CALIBRATION_ROWS`, in order, up to the first it loses) at which
    `kernel` takes less median time than oneDNN's packed linear over layer-sized float32
    linears; 0 if it loses at one row.

    A pass goes over `CALIBRATION_BYTES` of distinct 1536x576 weights, so that they come from
    memory as in a decode step: over one weight the cache holds, the two run within noise of
    each other and the choice would change from one load to the next (figures:
    docs/engine.md, `bench/bench_linears.py --dtype float32`). Timed on one thread, as it
    runs."""
    gen = torch.Generator().manual_seed(0)
    dense = layer_weights(torch.float32, CALIBRATION_BYTES, gen)
    ours = kernel_timer(kernel, [kernel.pack(w) for w in dense], repeat)
    return rows_won(ours, onednn_timer(dense, repeat), CALIBRATION_ROWS, torch.float32, gen)
