"""bfloat16 linears over a few rows (decode batches) in C, the weight packed in pairs once.

A decode step multiplies a handful of rows by every weight of the model once: the work is
reading the weights. oneDNN's packed linear reads them well below what the core can stream at
a few rows. This kernel is a plain dot-product loop that keeps the stream
going: the weight is packed once (`pack`) into groups of 64 outputs, and within a group pair by
pair (`[O/64][K/2][64][2]`, pairs of consecutive inputs), so one 64-byte load holds 16 outputs'
pair and `vdpbf16ps` (AVX512-BF16) multiplies it with the input's pair broadcast: products exact,
sums in float32, one rounding to bfloat16 at the end. The sums run in the order oneDNN's bf16
kernels take (pair after pair), so the outputs are oneDNN's bits but for a rare last-bit
rounding (`bench/bench_linears.py` counts them). It gains most at a few rows; from a few dozen
rows on the work is arithmetic and both run near the core's bf16 peak (docs/engine.md).

Not every core with AVX512-BF16 issues `vdpbf16ps` at full rate. A second build of the tiles
(`pair_linear_fma`) widens each weight pair to float32 once per tile of rows and multiplies with
float32 FMAs, in the same order, to the same sums; from `WIDE_MIN` rows on (prefill chunks) it
widens each group of 64 outputs' weights once per call into a buffer that stays in L2, and five
rows at a time take only FMAs against it. Where the CPU has AMX (and Linux grants the
process its tile state) a third build (`pair_linear_amx`) multiplies 16 rows at a time in AMX
tiles, the pair layout being the layout of AMX's weight tile. `load` times the builds and
oneDNN (`calibrate`) and takes the fastest up to the most rows it beats oneDNN at (all rows,
prefill chunks too, where it beats oneDNN at their size); more rows than that stay on oneDNN.
On a core with AMX, oneDNN's tiles beat the vdpbf16ps and FMA builds from a few rows on; the
AMX build beats oneDNN over more rows, streaming the weights faster.

Built at first use by `worker.kernels.build` where the CPU has AVX512-BF16; `load()` returns
None elsewhere, and linears stay on oneDNN.
"""

from __future__ import annotations

import logging
from functools import cache

import torch

import worker.kernels.build as builder
from worker.kernels.calibration import (
    kernel_timer,
    layer_weights,
    median_seconds,
    onednn_timer,
    rows_won,
    torch_threads,
)
from worker.kernels.few_rows import FewRowsLinear, output_groups

logger = logging.getLogger(__name__)

MAX_ROWS = 64  # up to this many rows a linear may take this kernel; more go to oneDNN
ANY_ROWS = 1 << 40  # `max_rows` of a kernel that takes prefill chunks too (`calibrate`)
DECODE_ROWS, PREFILL_ROWS = 16, 512  # the row counts `calibrate` picks the variant and prefill at
CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, MAX_ROWS)  # the row counts `calibrate` walks against oneDNN
CALIBRATION_BYTES = 64 << 20  # of distinct weights that walk streams: more than a core's cache
GROUP = 64  # outputs per group of the packed layout (4 vectors of 16)

SOURCE = "pair_linear.c"  # in csrc/


class PairGemm(FewRowsLinear):
    """The loaded library: `__call__` is the linear over a weight made by `pack` (x [..., K]
    bf16, K even)."""

    dtype = torch.bfloat16


def can_pack(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """A CPU bf16 [O, K] weight with K even (and a bf16 bias, if any)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[1] % 2 == 0
        and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[O, K] -> the kernel's layout `[ceil(O/64), K/2, 64, 2]`, outputs past O zero."""
    groups = output_groups(weight, GROUP)
    g, _, k = groups.shape
    return groups.view(g, GROUP, k // 2, 2).transpose(1, 2).contiguous()


@cache
def variants() -> dict[str, PairGemm]:
    """Both builds of the kernel by the instruction its tiles multiply with (`dpbf16`, `fma`),
    built on first use; empty where the CPU lacks AVX512-BF16 or no build."""
    library = builder.build("pair_linear", SOURCE)
    if library is None or not library.pair_linear_available():
        return {}
    built = {"dpbf16": PairGemm(library.pair_linear, MAX_ROWS),
             "fma": PairGemm(library.pair_linear_fma, MAX_ROWS)}  # fmt: skip
    if library.pair_linear_amx_available():
        built["amx"] = PairGemm(library.pair_linear_amx, MAX_ROWS)
    return built


@cache
def load() -> PairGemm | None:
    """The faster variant on this core, taking linears of up to the most rows it beats oneDNN at
    (`calibrate`); built and timed on first use. None where the CPU lacks AVX512-BF16, no build,
    or oneDNN wins at one row."""
    built = variants()
    if not built:
        return None
    name, rows = calibrate(built)
    if rows == 0:
        logger.info("bf16 linears: oneDNN (the C kernel is slower on this core)")
        return None
    logger.info("bf16 linears: %s tiles up to %s rows", name, "any" if rows == ANY_ROWS else rows)
    return built[name].up_to(rows)


def calibrate(built: dict[str, PairGemm], repeat: int = 7) -> tuple[str, int]:
    """(the variant with the least median time over a layer-sized linear of `DECODE_ROWS`
    rows, the most rows it should take: `ANY_ROWS` where it beats oneDNN's packed linear at
    `PREFILL_ROWS` rows by 10%, else the most of `CALIBRATION_ROWS` (in order, up to the first
    it loses) at which it beats oneDNN over weights read from memory, 0 if it loses at one).

    Which variant that is depends on the core: `vdpbf16ps` does twice the multiply-adds of a
    float32 FMA per instruction, but not every core issues it as often: on some the pair
    kernel runs near the core's bf16 peak, on others the FMA tiles win; with AMX oneDNN's tiles
    are fast from a few rows on (figures: docs/engine.md, `bench/bench_linears.py --variant`).
    Timed on one thread, as the kernel runs."""
    gen = torch.Generator().manual_seed(0)
    dense = layer_weights(torch.bfloat16, 0, gen)[0]
    o, k = dense.shape
    w = pack(dense)
    with torch_threads(1):
        x = torch.randn(DECODE_ROWS, k, generator=gen).to(torch.bfloat16)
        times = {name: median_seconds(lambda kernel=kernel: kernel(x, w, None, o), repeat)
                 for name, kernel in built.items()}  # fmt: skip
        name = min(times, key=times.__getitem__)
        kernel = built[name]
        x = torch.randn(PREFILL_ROWS, k, generator=gen).to(torch.bfloat16)
        ours = median_seconds(lambda: kernel(x, w, None, o), repeat)
        if ours < 0.9 * onednn_timer([dense], repeat)(x):
            return name, ANY_ROWS
    dense = layer_weights(torch.bfloat16, CALIBRATION_BYTES, gen)
    ours = kernel_timer(kernel, [pack(w) for w in dense], repeat)
    return name, rows_won(ours, onednn_timer(dense, repeat), CALIBRATION_ROWS, torch.bfloat16, gen)
