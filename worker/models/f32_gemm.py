"""float32 linears over a few rows (decode batches) in C, the weight packed once.

The float32 counterpart of `worker.models.pair_gemm`, for CPUs that serve float32 (those
without bf16 units, where `auto` keeps a float32 checkpoint's dtype). A decode step reads every
weight once: in float32, twice the bytes of bf16. oneDNN's packed float32 linear reads them at
~10-16 GB/s on one Zen 4 core at 1-8 rows; this kernel keeps the stream near the core's ~25:
the weight is packed once (`pack`) into groups of 64 outputs, input by input within a group
(`[O/64][K][64]`), so each input's 64 weights are four consecutive 64-byte vectors, multiplied
by that input broadcast and added into the group's float32 sums. With AVX-512 a block of up
to 6 rows shares each load (24 sums in registers); elsewhere vectors are 8 floats and a row
goes alone (its 8 sums and the weights fill AVX2's 16 registers). Plain C on GCC's vector
types, so it builds for any x86 or Arm CPU. Measured by `bench/bench_linears.py --dtype
float32` on SmolLM2-135M's layer shapes (one thread, 30 layers' weights from memory): see
docs/engine.md.

Each output is one float32 sum over the inputs in order, then the bias, however many rows share
the call (a row's result does not depend on the rows beside it): not oneDNN's order, so results
differ from its in the last bits.
"""

from __future__ import annotations

import logging
from functools import cache

import torch

import worker.models.c_library as c_library
from worker.models.few_rows import (
    FewRowsLinear,
    median_seconds,
    one_thread,
    onednn_timer,
    output_groups,
)

logger = logging.getLogger(__name__)

MAX_ROWS = 32  # up to this many rows a linear takes this kernel; more go to oneDNN
CALIBRATION_ROWS = (1, 2, 4, 8, 16, MAX_ROWS)  # the row counts `calibrate` times
GROUP = 64  # outputs per group of the packed layout (4 vectors of 16, or 8 of 8)

SOURCE = r"""
#include <stdint.h>
/* VW floats a vector: 16 where the core has AVX-512, 8 elsewhere (a test builds the other
   width with -DVW). A group's 64 outputs are NB vectors. */
#ifndef VW
#ifdef __AVX512F__
#define VW 16
#else
#define VW 8
#endif
#endif
#if VW == 16
#define TILE 6  /* rows per block: 6 x 4 sums and the 4 weight vectors in 32 registers */
#else
#define TILE 1  /* a row's 8 sums, each weight vector loaded where it is used: 16 registers */
#endif
#define NB (64 / VW)
typedef float vf __attribute__((vector_size(4 * VW)));
#define PF_INPUTS 16  /* software prefetch this many inputs' weights (256 bytes each) ahead */

/* n (1..TILE) rows at once: each weight load serves them all. One row has only its sums in
   flight, which still retire a 64-byte vector a cycle or so: far more than memory gives. */
static void rows_block(const float *x, int64_t k, const float *wg, int n, vf *res) {
    vf acc[TILE][NB] = {{0}};
    for (int64_t p = 0; p < k; p++) {
        const vf *w = (const vf *)(wg + p * 64);
        /* four cache lines PF_INPUTS inputs ahead (a prefetch past the end never faults): the
           hardware prefetchers alone leave part of one core's read bandwidth unused */
        for (int b = 0; b < 4; b++) __builtin_prefetch(wg + (p + PF_INPUTS) * 64 + 16 * b);
        vf wv[NB];
        for (int b = 0; b < NB; b++) wv[b] = w[b];
        for (int i = 0; i < TILE; i++) {
            if (i >= n) break;
            float xv = x[i * k + p];
            for (int b = 0; b < NB; b++) acc[i][b] += xv * wv[b];
        }
    }
    for (int i = 0; i < n; i++)
        for (int b = 0; b < NB; b++) res[i * NB + b] = acc[i][b];
}

/* out[rows, o] = x[rows, k] . w^T (+ bias): x float32 row-major, w packed as
   [ceil(o/64)][k][64] float32 (outputs past o are zero), bias float32 [o] or NULL. */
void f32_linear(const float *x, const float *w, const float *bias, float *out, int64_t rows,
                int64_t k, int64_t o) {
    int64_t groups = (o + 63) / 64;
    vf res[TILE * NB];
    for (int64_t g = 0; g < groups; g++) {
        const float *wg = w + g * k * 64, *bg = bias ? bias + g * 64 : 0;
        int64_t valid = o - g * 64 < 64 ? o - g * 64 : 64;
        for (int64_t r = 0; r < rows;) {
            int64_t n = rows - r >= TILE ? TILE : rows - r;
            rows_block(x + r * k, k, wg, (int)n, res);
            for (int64_t i = 0; i < n; i++) {
                const float *s = (const float *)(res + i * NB);
                float *dst = out + (r + i) * o + g * 64;
                for (int64_t j = 0; j < valid; j++) dst[j] = s[j] + (bg ? bg[j] : 0.0f);
            }
            r += n;
        }
    }
}
"""


class F32Gemm(FewRowsLinear):
    """The loaded library: `__call__` is the linear over a weight made by `pack`."""

    dtype = torch.float32


def can_pack(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """A CPU float32 [O, K] weight (and a contiguous float32 bias, if any)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[O, K] -> the kernel's layout `[ceil(O/64), K, 64]`, outputs past O zero."""
    return output_groups(weight, GROUP).transpose(1, 2).contiguous()


@cache
def build() -> F32Gemm | None:
    """The kernel as built here, taking up to `MAX_ROWS` rows; None where it cannot be built (no
    C compiler). `load` decides whether, and up to how many rows, linears take it."""
    library = c_library.build("f32_linear", SOURCE)
    return F32Gemm(library.f32_linear, MAX_ROWS) if library is not None else None


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
    `kernel` takes less median time than oneDNN's packed linear over a layer-sized float32
    linear; 0 if it loses at one row.

    Built for AVX-512 (blocks of 6 rows) on a Zen 4 core it ran SmolLM2's layers 1.6-2.1x as
    fast as oneDNN at 1-2 rows and 1.04-1.2x at 32 (docs/engine.md); on an AMD EPYC with AVX2
    only, at 8 lanes a row at a time, 1.19-1.40x at one row and 0.98-1.19x at 8 with the
    weights streamed from memory (`bench/bench_linears.py --dtype float32`), and here, over one
    weight the cache holds, it wins at one row only (16-lane vectors there, as once built, lost
    at every row count: 0.53-0.70x at one row). Timed on one thread, as it runs."""
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(1536, 576, generator=gen)
    w = pack(dense)
    onednn = onednn_timer(dense, repeat)
    best = 0
    with one_thread():
        for rows in CALIBRATION_ROWS:
            x = torch.randn(rows, 576, generator=gen)
            if median_seconds(lambda x=x: kernel(x, w, None, 1536), repeat) >= onednn(x):
                break
            best = rows
    return best
