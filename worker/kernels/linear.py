"""CPU linears (bfloat16, float16, float32) through oneDNN with each weight packed once, at load.

`F.linear` hands oneDNN a plain row-major weight on every call; a weight reordered once into
oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`) gives the same bits (a bias
may be added in another order) faster at decode batch sizes, by less as the rows grow
(docs/engine.md). In float32 (what CPUs without bf16 units run) `F.linear` goes to MKL, and the
packed oneDNN copy is faster still at decode sizes. oneDNN sums in another order than MKL, so
float32 results differ from HF's in the last bits (greedy output stays HF's in
test_engine_hf_identity).

On one thread, a linear over a few rows (a decode batch: the kernel's `max_rows`) goes through
a C loop instead (`FEW_ROWS`): in bfloat16 `worker.kernels.pair_gemm`, where the CPU has
AVX512-BF16 (same bits as oneDNN but for a rare last-bit rounding), in float32
`worker.kernels.f32_gemm` up to the rows where it beat oneDNN at load. Each streams a third
copy of the weight, packed for it, faster than oneDNN reads its own at those sizes; more rows,
or more threads (oneDNN uses them all, the C loops one), go to oneDNN. Over many rows (prefill
chunks) oneDNN's packed copy is not the fastest on every core: from the rows where torch's BLAS
over the dense weight beat it at load (`dense_from`), a linear is plain `F.linear`. A dtype
oneDNN cannot reorder on this CPU (bf16 without AVX512-BW/VL/DQ or AVX-NE-CONVERT) keeps plain
weights.
A float32 weight that the model's GGUF stores as quantized blocks (`pack_linears`' `quantized`)
goes, over a few rows, through `worker.kernels.quant_gemm` instead, which reads the blocks and
gives `f32_gemm`'s bits.

Callers always hand `linear` the module's own dense weight; the packed copies sit beside it
(`module.packed`, `module.few_rows` and `module.quantized`, the price: two more copies of the
linear weights in memory, and their blocks) and are found by the dense weight's address in a
registry. So the model's functions take plain tensors only, which `torch.compile` needs (an
mkldnn tensor cannot be a graph input): under compile the linear is the custom op
`radixray::packed_linear`, opaque to inductor, which fuses the norms, RoPE, SwiGLU and residual
adds around it; the op finds the packed weights at run time.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from functools import cache
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import worker.kernels.f32_gemm as f32_gemm
import worker.kernels.pair_gemm as pair_gemm
import worker.kernels.quant_gemm as quant_gemm
from worker.kernels.blocks import Blocks
from worker.kernels.calibration import (
    dense_timer,
    layer_projections,
    onednn_timer,
    rows_won,
    torch_threads,
)

PACKED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# per dtype, the C kernel for linears over a few rows on one thread: `can_pack(weight, bias)`,
# `pack(weight)` and `load()` (None where it cannot run; its `max_rows`: the most rows it takes)
FEW_ROWS = {torch.bfloat16: pair_gemm, torch.float32: f32_gemm}
BATCH_HINT = 32  # rows oneDNN tunes the layout for; any row count works
MANY_ROWS = (512, 256, 128, 64)  # the row counts `dense_from` times, from the most down
NEVER = 1 << 62  # `dense_from` where oneDNN's packed copy wins at every row count


class _Packed(NamedTuple):
    owner: weakref.ref  # the dense weight, weakly
    onednn: torch.Tensor  # oneDNN's blocked layout
    few_rows: torch.Tensor | None  # the `FEW_ROWS` kernel's layout, where one serves
    quantized: tuple[quant_gemm.QuantGemm, torch.Tensor] | None  # its blocks' kernel, layout


# dense weight's data_ptr -> its packed copies. An entry counts only while its dense weight
# lives (then no other tensor can start at that address) and has the shape asked for (a view
# at the same address, e.g. a slice, is not the packed weight).
_REGISTRY: dict[int, _Packed] = {}


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in PACKED_DTYPES
        and onednn_packs(weight.dtype)
    )


@cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN reorders a `dtype` linear weight on this CPU: its bf16 path needs
    AVX512-BW/VL/DQ or AVX-NE-CONVERT (an AVX2-only core refuses it: RuntimeError), and then
    the weight stays plain."""
    if not torch.backends.mkldnn.is_available() or not hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    ):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), BATCH_HINT)
    except RuntimeError:
        return False
    return True


def pack_linears(model: nn.Module, quantized: Mapping[str, Blocks] | None = None) -> int:
    """Give every `nn.Linear` of `model` whose weight `can_pack` a `packed` weight, found by
    `linear` from the dense one; returns how many got one. `quantized` (parameter name ->
    blocks: `loader.quantized_linears`) gives float32 weights their blocks' kernel too."""
    quantized = quantized or {}
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and can_pack(module.weight):
            weight = module.weight.detach()
            module.packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
            kernel = FEW_ROWS.get(weight.dtype)
            serves = (
                kernel is not None
                and kernel.can_pack(weight, module.bias)
                and kernel.load() is not None
            )
            module.few_rows = kernel.pack(weight) if serves else None
            key = f"{name}.weight" if name else "weight"  # the parameter's name in `model`
            module.quantized = _quantized(quantized.get(key), weight, module.bias)
            ptr = weight.data_ptr()
            owner = weakref.ref(module.weight, _forget(ptr))
            _REGISTRY[ptr] = _Packed(owner, module.packed, module.few_rows, module.quantized)
            if not serves or kernel.load().max_rows < pair_gemm.ANY_ROWS:  # it may serve rows
                dense_from(weight.dtype, torch.get_num_threads())  # timed at load, not mid-prefill
            count += 1
    return count


@cache
def dense_from(dtype: torch.dtype, threads: int, repeat: int = 3) -> int:
    """The fewest rows from which `linear` takes `F.linear` over the dense weight (torch's BLAS:
    MKL in float32) rather than oneDNN's packed copy, on `threads` torch threads: the last of
    `MANY_ROWS` (from 512 rows down, up to the first at which it loses) at which `F.linear`
    took less median time over a layer's projections; `NEVER` where it loses at 512.

    Which is faster over many rows depends on the core: on some MKL's float32 linears beat the
    packed copy from 64 rows on, on others the packed copy wins at 512 (docs/engine.md). Timed
    once per dtype and thread count, at load (`pack_linears`, unless the few-rows kernel takes
    every row count there)."""
    gen = torch.Generator().manual_seed(0)
    dense = layer_projections(dtype, gen)
    ours, theirs = dense_timer(dense, repeat), onednn_timer(dense, repeat)
    with torch_threads(threads):  # MKL's first calls are slower: warm both up
        warm = torch.randn(MANY_ROWS[0], dense[0].shape[1], generator=gen).to(dtype)
        ours(warm), theirs(warm)
    rows = rows_won(ours, theirs, MANY_ROWS, dtype, gen, threads)
    return rows or NEVER


def _quantized(blocks: Blocks | None, weight: torch.Tensor, bias: torch.Tensor | None):
    """(kernel, layout) for a float32 `weight` given as `blocks`, where their kernel serves."""
    if blocks is None or weight.dtype != torch.float32 or not quant_gemm.can_pack(blocks, bias):
        return None
    kernel = quant_gemm.load(blocks.bits)
    return (kernel, kernel.pack(blocks)) if kernel is not None else None


def _forget(ptr: int):
    """A weakref callback that drops the entry at `ptr` (with its packed copy) when its dense
    weight goes, unless another weight has taken the address since."""

    def callback(ref: weakref.ref) -> None:
        entry = _REGISTRY.get(ptr)
        if entry is not None and entry.owner is ref:
            del _REGISTRY[ptr]

    return callback


def packed_of(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed copy of the dense `weight`, or None."""
    entry = _entry(weight)
    return entry.onednn if entry is not None else None


def _entry(weight: torch.Tensor) -> _Packed | None:
    entry = _REGISTRY.get(weight.data_ptr())
    if entry is None:
        return None
    owner = entry.owner()
    if owner is None:  # that weight is gone: its address may now be another tensor's
        del _REGISTRY[weight.data_ptr()]
        return None
    return entry if owner.shape == weight.shape else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the packed copy of `weight` where it has one."""
    if torch.compiler.is_compiling():  # in a graph: only a weight that may have a packed copy
        maybe_packed = weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES
        return packed_linear(x, weight, bias) if maybe_packed else F.linear(x, weight, bias)
    return _packed_linear(x, weight, bias)


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    entry = _entry(weight)
    if entry is None:
        return F.linear(x, weight, bias)
    rows, threads = x.numel() // x.shape[-1], torch.get_num_threads()
    if entry.quantized is not None and x.dtype == torch.float32:
        kernel, blocks = entry.quantized
        if rows <= kernel.max_rows and threads == 1:
            return kernel(x, blocks, bias, weight.shape[0])
    module = FEW_ROWS.get(x.dtype) if entry.few_rows is not None else None
    kernel = module.load() if module is not None else None
    if (
        kernel is not None  # the weight has the layout of its dtype's kernel, which loaded
        and x.dtype == weight.dtype
        and rows <= kernel.max_rows
        and threads == 1
    ):
        return kernel(x, entry.few_rows, bias, weight.shape[0])
    if rows >= dense_from(weight.dtype, threads):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, entry.onednn, bias, "none", [], "")


def _packed_linear_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# `linear` as one op that graphs take with plain tensors (the packed copy is looked up as it
# runs). Defined through `torch.library.Library` rather than `custom_op`: ~8 us per call
# against ~40 us, and a decode step makes 4 per layer.
_LIBRARY = torch.library.Library("radixray", "DEF")
_LIBRARY.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIBRARY.impl("packed_linear", _packed_linear, "CPU")
torch.library.register_fake("radixray::packed_linear", _packed_linear_shape, lib=_LIBRARY)
packed_linear = torch.ops.radixray.packed_linear.default
