"""CPU linears in bfloat16/float16 through oneDNN with each weight packed once, at load.

`F.linear` hands oneDNN a plain row-major weight on every call; a weight reordered once into
oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`) gives the same bits (a
bias may be added in another order) faster at decode batch sizes: measured on SmolLM2-135M's
shapes (one thread, bf16), 1.3-2x for the layer projections at 1-32 rows and ~1.5-2x for the
49152-row LM head, a few percent at 512 rows.
float32 stays on `F.linear`: there oneDNN rounds differently from MKL, and the float32 engine
matches HF transformers' greedy output exactly.

The packed weight sits beside the module's own (`module.packed`), which stays for everything
else that reads it (tied embeddings, state, compiled kernels): the price is a second copy of
the linear weights in memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACKED_DTYPES = (torch.bfloat16, torch.float16)
BATCH_HINT = 32  # rows oneDNN tunes the layout for; any row count works


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in PACKED_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_linears(model: nn.Module) -> int:
    """Give every `nn.Linear` of `model` whose weight `can_pack` a `packed` weight; returns
    how many got one."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and can_pack(module.weight):
            weight = module.weight.detach()
            module.packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
            count += 1
    return count


def weight_of(module: nn.Linear) -> torch.Tensor:
    """The weight to hand `linear`: the packed one where there is one."""
    return getattr(module, "packed", module.weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear`, also for a weight from `pack_linears` (an mkldnn tensor)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
