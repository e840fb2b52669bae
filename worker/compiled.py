"""Compiled layers: the model's dense per-layer functions through `torch.compile`, with a fallback.

`compile_model(model)` swaps `model.kernels` (see `worker.models.llama.DecoderLayer`) for
compiled `pre_attention` / `post_attention`. They are pure functions of tensors shared by every
layer, so each compiles once (dynamic shapes: one graph for every batch size); the attention
backend between them stays eager. Packed CPU linears stay opaque ops in the graph
(`radixray::packed_linear`, see `worker.kernels.linear`): inductor fuses the norms, RoPE, SwiGLU
and residual adds between them, keeping the eager code's bf16 roundings (`OPTIONS`).
Compilation happens at the first call. When it fails (no C++ compiler, an unsupported op, a
backend error) the call is rerun eagerly, a warning is logged and the eager function is used
from then on: a pure function can be rerun safely.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from worker.models.llama import EAGER, CausalLM, LayerKernels

logger = logging.getLogger(__name__)
# A bf16 cast inside a fused kernel is kept (inductor would otherwise skip it and stay in
# float32): the compiled layers round where the eager ones do, though their sums may run in
# another order.
OPTIONS = {"emulate_precision_casts": True}


class WithFallback:
    """Calls `compiled`; on its first exception, switches to `eager` for good."""

    def __init__(self, compiled: Callable[..., Any], eager: Callable[..., Any], name: str) -> None:
        self.compiled: Callable[..., Any] | None = compiled
        self.eager = eager
        self.name = name

    @property
    def active(self) -> bool:
        return self.compiled is not None

    def __call__(self, *args: Any) -> Any:
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as e:  # noqa: BLE001 - any compile failure means: run eagerly
                logger.warning("torch.compile of %s failed, running it eagerly: %s", self.name, e)
                self.compiled = None
        return self.eager(*args)


def compile_model(model: CausalLM) -> LayerKernels:
    """Give `model` compiled layer functions (with the fallback); returns them."""
    kernels = LayerKernels(
        *(
            WithFallback(torch.compile(fn, dynamic=True, options=OPTIONS), fn, fn.__name__)
            for fn in (EAGER.pre, EAGER.post)
        )
    )
    model.kernels = kernels
    return kernels
