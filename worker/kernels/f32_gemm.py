"""float32 linears over a few rows (decode batches) in C, the weight packed once.

The float32 counterpart of `worker.kernels.pair_gemm`, for CPUs that serve float32 (those
without bf16 units, where `auto` keeps a float32 checkpoint's dtype). A decode step reads every
weight once: in float32, twice the bytes of bf16. oneDNN's packed float32 linear reads them at
~10-16 GB/s on one Zen 4 core at 1-8 rows, and at 2-8 GB/s on an AVX2 EPYC core at 1-32 rows,
where it is bound by its own arithmetic; this kernel keeps the stream near what the core can
read. The weight is packed once (`F32Gemm.pack`) into groups of outputs, input by input within
a group (`[O/G][K][G]`), so each input's G weights are consecutive vectors, multiplied by that
input broadcast and added into the group's float32 sums, a block of rows sharing each load:
with AVX-512 groups of 64 (four 16-float vectors) and blocks of up to 6 rows; elsewhere groups
of 8 (one 8-float vector) and blocks of up to 8 rows, so up to 8 rows take the weights from
memory once. Plain C on GCC's vector types, so it builds for any x86 or Arm CPU. Measured by
`bench/bench_linears.py --dtype float32` on SmolLM2-135M's layer shapes (one thread, 30 layers'
weights from memory): see docs/engine.md.

Each output is one float32 sum over the inputs in order, then the bias, however many rows share
the call (a row's result does not depend on the rows beside it): not oneDNN's order, so results
differ from its in the last bits.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache

import torch

import worker.kernels.build as c_library
from worker.kernels.calibration import kernel_timer, layer_weights, onednn_timer, rows_won
from worker.kernels.few_rows import C_DRIVER, C_SUMS, FewRowsLinear, output_groups

logger = logging.getLogger(__name__)

MAX_ROWS = 32  # up to this many rows a linear takes this kernel; more go to oneDNN
CALIBRATION_ROWS = (1, 2, 4, 8, 16, MAX_ROWS)  # the row counts `calibrate` times
CALIBRATION_BYTES = 64 << 20  # of distinct weights `calibrate` streams: more than a core's cache

SOURCE = (
    r"""
#include <stdint.h>
/* VW floats a vector: 16 where the core has AVX-512, 8 elsewhere (a test builds the other
   width with -DVW). A group of GROUP outputs is NB vectors; a block of up to TILE rows shares
   each weight load. The two widths' tiles fill their register files: with AVX-512 6 rows x 4
   vectors of sums and the 4 weight vectors (28 of 32). With AVX2, up to 8 rows take one
   block of 8 rows x 1 vector of sums (10 of 16 registers with the weight vector and a
   broadcast input: 8 rows a pass over memory, where blocks of 6 rows x 2 vectors ran
   SmolLM2's linears at 8 rows 1.4-1.5x oneDNN against 1.9-2x); more rows go in blocks of up
   to WIDE 6 rows x 2 groups (15 of 16 registers: 12 sums, 2 weight vectors, a broadcast),
   which load 8 vectors for 12 fused multiply-adds against 9 for 8. On a Zen 3 core, SmolLM2's
   linears at 16-64 rows with the weights in cache ran 1.14-1.16x the 8 x 1 blocks' speed, and
   from memory 0.98-1.26x at 12-32 rows but 16 (0.95-1.0x: 8 x 1 took 16 rows in two blocks);
   a 32-request decode step took 0.92x the time (bench/bench_linears.py --base-tree). */
#ifndef VW
#ifdef __AVX512F__
#define VW 16
#else
#define VW 8
#endif
#endif
#if VW == 16
#define GROUP 64
#define TILE 6
#define WIDE TILE  /* no wide blocks */
#else
#define GROUP 8
#define TILE 8
#define WIDE 6
#endif
#define NB (GROUP / VW)
/* A block of few rows takes up to GANG groups at once, so that at least 8 vectors of sums are
   in flight (each sum is a chain of FMAs, and the FMA units take a new one every half cycle
   for some 4 cycles of latency): 4 groups a row at 8 lanes. WIDE blocks take 2 groups. */
#define GANG 4
#define GANG_FEW(n) ((n) * NB >= 8 ? 1 : 8 / ((n) * NB) > GANG ? GANG : 8 / ((n) * NB))
#define GANG_OF(n, wide) ((wide) ? 2 : GANG_FEW(n))
typedef float vf __attribute__((vector_size(4 * VW)));
"""
    + C_SUMS
    + r"""
#define PF_BYTES 4096  /* software prefetch this far ahead in a group's weights */
/* an empty asm that takes v in a vector register, where one holds a vf: the compiler must
   load it there */
#if VW == 16 && defined(__AVX512F__)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#elif VW == 8 && defined(__AVX__)
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define IN_REGISTER(v) (void)0
#endif

int f32_group(void) { return GROUP; }

/* n rows against ng groups from g0, a WIDE block or not (n, ng, wide constants where it is
   inlined: the sums stay in registers); then each row's sums of each group (those below o)
   plus the bias to `out`. */
static inline __attribute__((always_inline)) void rows_block(
    const float *x, int64_t k, const float *w, int64_t g0, const int ng, const int n,
    const int wide, const float *bias, float *out, int64_t o) {
    vf acc[GANG][TILE][NB];
    for (int g = 0; g < ng; g++)
        for (int i = 0; i < n; i++)
            for (int b = 0; b < NB; b++) acc[g][i][b] = (vf){0};
    const float *wg = w + g0 * k * GROUP;
    for (int64_t p = 0; p < k; p++) {
        if (!wide) {  /* few rows: each group's weights, then its sums */
            float xv[TILE];
            for (int i = 0; i < n; i++) xv[i] = x[i * k + p];
            for (int g = 0; g < ng; g++) {
                const float *wp = wg + (g * k + p) * GROUP;
                /* the hardware prefetchers alone leave part of one core's read bandwidth
                   unused; a prefetch past the end never faults */
                for (int b = 0; b < GROUP; b += 16)
                    __builtin_prefetch((const char *)(wp + b) + PF_BYTES);
                vf wv[NB];
                for (int b = 0; b < NB; b++) wv[b] = ((const vf *)wp)[b];
                for (int i = 0; i < n; i++) {
                    vf xi = (vf){0} + xv[i];  /* the input broadcast */
                    for (int b = 0; b < NB; b++) acc[g][i][b] = FMA(acc[g][i][b], xi, wv[b]);
                }
            }
            continue;
        }
        /* a WIDE block computes more than it reads: the first group's prefetch is enough
           (with one for each group, blocks of 6 rows x 2 groups ran ~1.5x slower on a Zen 3
           core). Every group's weights of input p go to registers, each loaded once: left to
           itself, GCC folded the load into each row's FMA and spilled sums of the 6 x 2 tile. */
        for (int b = 0; b < GROUP; b += 16)
            __builtin_prefetch((const char *)(wg + p * GROUP + b) + PF_BYTES);
        vf wv[GANG][NB];
        for (int g = 0; g < ng; g++)
            for (int b = 0; b < NB; b++) {
                wv[g][b] = ((const vf *)(wg + (g * k + p) * GROUP))[b];
                IN_REGISTER(wv[g][b]);
            }
        for (int i = 0; i < n; i++) {
            vf xi = (vf){0} + x[i * k + p];
            for (int g = 0; g < ng; g++)
                for (int b = 0; b < NB; b++) acc[g][i][b] = FMA(acc[g][i][b], xi, wv[g][b]);
        }
    }
    store_sums(acc, g0, ng, n, bias, out, o);
}

#define LINEAR f32_linear
"""
    + C_DRIVER
)


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
    """[O, K] in the layout of the kernel built here (`packed.pack_linears` calls it only where
    `load` gave a kernel)."""
    kernel = build()
    if kernel is None:
        raise RuntimeError("no float32 few-rows kernel here (no C compiler)")
    return kernel.pack(weight)


@cache
def build() -> F32Gemm | None:
    """The kernel as built here, taking up to `MAX_ROWS` rows; None where it cannot be built (no
    C compiler). `load` decides whether, and up to how many rows, linears take it."""
    library = c_library.build("f32_linear", SOURCE)
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
    memory as in a decode step: over one weight the cache holds, the two ran within noise of
    each other at 4-32 rows on an AVX2 EPYC, and calibration took the kernel up to 4, 8 or 32
    rows from one load to the next, where from memory it is 1.18-1.29x oneDNN at 32. Built for
    AVX-512 (blocks of 6 rows) on a Zen 4 core it ran SmolLM2's layers 1.6-2.1x as fast as
    oneDNN at 1-2 rows and 1.04-1.2x at 32 (docs/engine.md); on that EPYC (groups of 8
    outputs, blocks of 8 rows) 1.81-2.01x at 1 and 8 rows (`bench/bench_linears.py --dtype
    float32`). Timed on one thread, as it runs; ~1 s at load, ~200 MB while it runs."""
    gen = torch.Generator().manual_seed(0)
    dense = layer_weights(torch.float32, CALIBRATION_BYTES, gen)
    ours = kernel_timer(kernel, [kernel.pack(w) for w in dense], repeat)
    return rows_won(ours, onednn_timer(dense, repeat), CALIBRATION_ROWS, torch.float32, gen)
