"""float32 linears over a few rows whose weights are read as a GGUF stores them (Q4_0, Q4_1,
Q8_0 blocks), each weight recomputed in registers with the bits the GGUF's dequantizer gives.

A GGUF model's float32 weights are its quantized blocks dequantized (`worker.loader.gguf`):
every weight of a block of 32 inputs is d * q + m, with d and m float16 and q a 4-bit (Q4_1;
Q4_0 is q - 8, so m = -8d) or 8-bit (Q8_0, m = 0) integer. d * q is exact in float32 (an 11-bit
significand times at most 8 bits), so one fused multiply-add, fma(q, d, m), rounds it once as
the `gguf` package's numpy `d * q + m` does: the same float32 weight. A decode step over one
request reads each weight once and does two flops with it, so the float32 weights (540 MB a
step for SmolLM2-135M) bound it by memory; their blocks are 0.75 bytes a weight in this
layout (4-bit) or 1.125 (8-bit).

The layout (`pack`) is `f32_gemm`'s, groups of VW outputs (one vector), over blocks of 32
inputs: a block of a group is d and m as float32 vectors (m absent at 8 bits), then the quants
as 32-bit lanes, one lane an output: at 4 bits 8 inputs a lane (input i of the 8 in bits 4i),
at 8 bits 4 (input i in byte i). Each input's VW weights come out of a shift, a mask, a
conversion and the fused multiply-add, and go into the rows' sums as `f32_gemm`'s do: one
float32 sum of fused multiply-adds over the inputs in order (csrc/few_rows_sums.h), so a linear
here gives the bits `f32_gemm` gives over the dequantized weight.

`linear.linear` takes this kernel for a weight whose blocks the engine loaded from the model's
GGUF (`loader.quantized_linears`, which checks each against the dense weight; `pack_linears`
keeps them in the weight's registry entry), up to the rows where it beat the float32 path at
load (`calibrate`), on one thread.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache

import numpy as np
import torch

import worker.kernels.build as builder
import worker.kernels.f32_gemm as f32_gemm
from worker.kernels.blocks import BLOCK, Blocks
from worker.kernels.calibration import (
    LAYER_IN,
    LAYER_OUT,
    kernel_timer,
    onednn_timer,
    rows_won,
)
from worker.kernels.few_rows import FewRowsLinear

logger = logging.getLogger(__name__)

MAX_ROWS = 32
CALIBRATION_ROWS = (1, 2, 4, 8, 16, MAX_ROWS)
CALIBRATION_BYTES = 64 << 20  # of distinct weights each side streams: more than a core's cache

SOURCE = "quant_linear.c"  # in csrc/


class QuantGemm(FewRowsLinear):
    """One build (4 or 8 bits): `__call__` is the linear over blocks its `pack` laid out."""

    dtype = torch.float32

    def __init__(self, library: ctypes.CDLL, bits: int, max_rows: int) -> None:
        super().__init__(getattr(library, f"q{bits}_linear"), max_rows)
        library.quant_group.restype = ctypes.c_int
        self.bits = bits
        self.group = library.quant_group()  # outputs a group: VW

    def pack(self, blocks: Blocks) -> torch.Tensor:
        """`blocks` -> [ceil(O/G), K/32, vectors a block, G] 32-bit words (outputs past O zero):
        d (and m) as float32, then the quants, PER_LANE inputs a lane."""
        if blocks.bits != self.bits:
            raise ValueError(f"{blocks.bits}-bit blocks for the {self.bits}-bit kernel")
        (o, k), g = blocks.shape, self.group
        padded = -(-o // g) * g
        nb = k // BLOCK

        def grouped(a: np.ndarray) -> np.ndarray:  # [O, ...] -> [O/G, G, ...], zeros past O
            a = np.concatenate([a, np.zeros((padded - o, *a.shape[1:]), a.dtype)])
            return a.reshape(padded // g, g, *a.shape[1:])

        # a lane's inputs in its 4 bytes, first input lowest: at 4 bits two a byte (the first
        # in the low nibble), at 8 bits one a byte; the bytes read as little-endian words
        q = grouped(blocks.q).view(np.uint8)
        if blocks.bits == 4:
            q = q[..., 0::2] | (q[..., 1::2] << 4)
        words = np.ascontiguousarray(q).view("<u4").reshape(padded // g, g, nb, -1)
        scales = [blocks.d] if blocks.m is None else [blocks.d, blocks.m]
        scales = [grouped(s).view(np.uint32)[..., None] for s in scales]  # [O/G, G, nb, 1]
        out = np.concatenate([*scales, words], axis=-1)  # [O/G, G, nb, vectors]
        # a copy in torch's memory, aligned for the kernel's whole-vector loads (numpy's is not)
        layout = torch.from_numpy(out.transpose(0, 2, 3, 1))
        return layout.clone(memory_format=torch.contiguous_format)


def can_pack(blocks: Blocks, bias: torch.Tensor | None) -> bool:
    """Whole blocks of inputs (and a contiguous float32 bias, if any)."""
    return blocks.shape[1] % BLOCK == 0 and (
        bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
    )


@cache
def build(bits: int) -> QuantGemm | None:
    """The `bits` kernel as built here, up to `MAX_ROWS` rows; None without a C compiler."""
    library = builder.build(f"q{bits}_linear", SOURCE, (f"BITS={bits}",))
    return QuantGemm(library, bits, MAX_ROWS) if library is not None else None


@cache
def load(bits: int) -> QuantGemm | None:
    """The `bits` kernel where it beats the float32 path on this core, its `max_rows` the most
    rows it does (`calibrate`); None where it loses at one row, or cannot be built."""
    kernel = build(bits)
    if kernel is None:
        return None
    rows = calibrate(kernel)
    if rows == 0:
        logger.info("%d-bit GGUF linears: the float32 path (the C kernel is slower)", bits)
        return None
    logger.info("%d-bit GGUF linears: from their blocks up to %d rows", bits, rows)
    return kernel.up_to(rows)


def random_blocks(bits: int, shape: tuple[int, int], gen: np.random.Generator) -> Blocks:
    """Blocks of `shape` with random quants and float16 scales, as a GGUF holds them."""
    o, k = shape
    d = (gen.standard_normal((o, k // BLOCK)) * 0.01).astype(np.float16).astype(np.float32)
    if bits == 8:
        return Blocks(8, gen.integers(-128, 128, (o, k), dtype=np.int8), d, None)
    m = (gen.standard_normal((o, k // BLOCK)) * 0.1).astype(np.float16).astype(np.float32)
    return Blocks(4, gen.integers(0, 16, (o, k), dtype=np.uint8), d, m)


def calibrate(kernel: QuantGemm, repeat: int = 5) -> int:
    """The most rows (of `CALIBRATION_ROWS`, in order, up to the first it loses) at which
    `kernel` takes less median time a weight than the float32 path those rows take (`f32_gemm`
    where it serves them, else oneDNN's packed linear); 0 if it loses at one row.

    Each side streams `CALIBRATION_BYTES` of distinct 1536x576 weights in its own layout, so
    that they come from memory as in a decode step; compared per weight. On one thread, as it
    runs."""
    blocks = random_blocks(kernel.bits, (LAYER_OUT, LAYER_IN), np.random.default_rng(0))
    packed = kernel.pack(blocks)
    copies = max(1, CALIBRATION_BYTES // packed.nbytes)
    ours = kernel_timer(kernel, [packed.clone() for _ in range(copies)], repeat)
    dense = [blocks.dense() for _ in range(max(1, CALIBRATION_BYTES // (LAYER_OUT * LAYER_IN * 4)))]
    onednn = onednn_timer(dense, repeat)
    f32 = f32_gemm.load()
    f32_path = None if f32 is None else kernel_timer(f32, [f32.pack(w) for w in dense], repeat)

    def theirs(x: torch.Tensor) -> float:  # the float32 path those rows take
        served = f32_path is not None and x.shape[0] <= f32.max_rows
        return f32_path(x) if served else onednn(x)

    return rows_won(ours, theirs, CALIBRATION_ROWS, torch.float32, torch.Generator().manual_seed(0))
