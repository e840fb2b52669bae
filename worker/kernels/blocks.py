"""Quantized weights as GGUF stores them (Q4_0, Q4_1, Q8_0): the input of `quant_gemm`, read by
`worker.loader.gguf`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32  # inputs a block of the quantized types `Blocks` holds


@dataclass(frozen=True)
class Blocks:
    """A weight [O, K] as quantized blocks of 32 inputs: `q` [O, K] the quants (uint8 0..15 at
    4 bits, int8 at 8), `d` and `m` [O, K / 32] float32 (m None at 8 bits, where it is 0)."""

    bits: int
    q: np.ndarray
    d: np.ndarray
    m: np.ndarray | None

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    def dense(self) -> torch.Tensor:
        """The float32 weights: d * q + m (d * q is exact, so this is fma's one rounding)."""
        o, k = self.shape
        w = self.q.reshape(o, k // BLOCK, BLOCK).astype(np.float32)
        w *= self.d[..., None]
        if self.m is not None:
            w += self.m[..., None]
        return torch.from_numpy(w.reshape(o, k))

    def rows(self, rows: np.ndarray) -> Blocks:
        """These blocks with their output rows reordered (`rows` indexes them)."""
        m = self.m[rows] if self.m is not None else None
        return Blocks(self.bits, self.q[rows], self.d[rows], m)

    @staticmethod
    def stack(parts: list[Blocks]) -> Blocks | None:
        """Parts' rows one after the other (a fused weight); None if their bits differ."""
        if len({p.bits for p in parts}) != 1:
            return None
        q = np.concatenate([p.q for p in parts])
        d = np.concatenate([p.d for p in parts])
        m = None if parts[0].m is None else np.concatenate([p.m for p in parts])
        return Blocks(parts[0].bits, q, d, m)
