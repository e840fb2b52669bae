"""Attention backends by name: the one place that knows every backend's module.

It sits above `worker.attention.base` (the interface), `worker.attention.torch_ref` (the
`torch` reference) and the backends
that implement it, so none of them imports another back; the GPU backends load only when named.
"""

from __future__ import annotations

import importlib.util

import torch

from worker.attention.base import AttentionBackend
from worker.attention.torch_ref import TorchAttention

ATTENTION_BACKENDS = ("torch", "native", "triton", "flashinfer")


def resolve_attention(name: str, device: str | torch.device) -> str:
    """The backend "auto" means on `device`: `triton` on a CUDA device where the package
    imports (a paged kernel whose decode passes can be captured into CUDA graphs; `native`
    there gathers KV with torch ops, several times slower a step), else `native`. Any
    other name is itself."""
    if name != "auto":
        return name
    if torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "native"


def make_attention(name: str = "torch") -> AttentionBackend:
    """The backend called `name`: "torch" | "native" | "triton" | "flashinfer".

    Raises ValueError for an unknown name and ImportError when a GPU backend's package or a
    CUDA device is missing.
    """
    if name == "torch":
        return TorchAttention()
    if name == "native":
        from worker.attention.native import NativeAttention

        return NativeAttention()
    if name == "triton":
        from worker.attention.triton_paged import TritonAttention

        return TritonAttention()
    if name == "flashinfer":
        from worker.attention.flashinfer_paged import FlashInferAttention

        return FlashInferAttention()
    raise ValueError(f"unknown attention backend {name!r}; choose from {ATTENTION_BACKENDS}")
