"""Rotary position embedding (the "rotate half" layout HF Llama checkpoints use), with scaling.

Scaling types: `linear` (positions divided by `factor`), `llama3` (Llama 3.1's per-frequency
blend), `yarn` (NTK-by-parts blend plus an attention factor on cos/sin). `dynamic` NTK never
reaches here: `ModelConfig` serves it as plain RoPE within its original length.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class RotaryEmbedding:
    """RoPE for q [T, H, D] and k [T, KVH, D] at integer `positions` [T].

    `cos_sin(positions, dtype)` computes the angles once per forward pass (float32, T x D/2,
    cast to the activations' dtype as HF does); `apply` rotates q and k of every layer with them.
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict[str, Any] | None,
        device: torch.device,
    ) -> None:
        self.inv_freq, self.attention_factor = _inv_freq(head_dim, theta, scaling)
        self.inv_freq = self.inv_freq.to(device)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] of `positions`, in `dtype`."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        cos = (emb.cos() * self.attention_factor).to(dtype)
        sin = (emb.sin() * self.attention_factor).to(dtype)
        return cos, sin

    @staticmethod
    def apply(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def __call__(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.apply(q, k, *self.cos_sin(positions, q.dtype))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2] float32, factor on cos/sin) for one scaling config."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, scaling)
    raise ValueError(f"unsupported rope scaling type {kind!r}")


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Long wavelengths slowed by `factor`, short ones kept, a smooth blend in between."""
    factor, low, high = (
        float(s["factor"]),
        float(s["low_freq_factor"]),
        float(s["high_freq_factor"]),
    )
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn(dim: int, theta: float, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between the two."""
    factor = float(s["factor"])
    old_len = float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolate) + (1 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)
