"""The pair-packed bf16 linear (`worker.kernels.pair_gemm`): one rounding of a float32 sum, any
output count, a bias. When `linear` takes it, and the engine's output with it:
test_packed_linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import worker.kernels.calibration as calibration
import worker.kernels.pair_gemm as pair_gemm
from worker.kernels.linear import linear, pack_linears

VARIANTS = pair_gemm.variants()  # as built, whether or not `load` takes one on this core
KERNEL = VARIANTS.get("dpbf16")
pytestmark = pytest.mark.skipif(not VARIANTS, reason="no AVX512-BF16 or no C compiler here")


def within_one_rounding(out, x, w, b) -> bool:
    """Whether `out` is the exact x.w^T + b rounded once to bf16, give or take one bf16 step
    and what float32 sums of K products may drift (K * 2^-24 of the sum of |products|)."""
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    scale = x.double().abs() @ w.double().abs().T
    step = 2.0 ** torch.floor(torch.log2(exact.abs().clamp(min=1e-30))) * 2.0**-7
    drift = x.shape[-1] * 2.0**-24 * scale
    return bool(((out.double() - exact).abs() <= step + drift).all())


def variant_or_skip(name: str):
    if name not in VARIANTS:
        pytest.skip(f"no {name} build here (AMX: `amx_bf16` and the kernel's permission)")
    return VARIANTS[name]


@pytest.mark.parametrize("variant", ["dpbf16", "fma", "amx"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16, 37, 64, 515])
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(200, 96), (64, 2), (130, 1536), (70, 40)]
)  # (64, 2) and (70, 40): inputs past the last 32 (AMX's tile step)
@pytest.mark.parametrize("bias", [False, True])
def test_pair_linear_rounds_a_float32_sum_once(variant, rows, out_features, in_features, bias):
    kernel = variant_or_skip(variant)
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    b = torch.randn(out_features, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    out = kernel(x, pair_gemm.pack(w), b, out_features)
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    # float32 sums of exact products, rounded once; and mostly the same bits as F.linear
    # (oneDNN sums the same products in the same order)
    assert within_one_rounding(out, x, w, b)
    same = (out == F.linear(x, w, b)).double().mean()
    assert same >= 0.97, same


def test_pair_linear_keeps_the_batch_shape():
    """The leading dimensions are the rows of one call. (Against the same rows as a 2-d call,
    not a one-row call: one row sums in four interleaved partial sums (`one_row`), the tiles
    pair by pair, so their last bf16 bit differs on ~0.2% of random rows.)"""
    w = torch.randn(70, 32).to(torch.bfloat16)
    x = torch.randn(2, 3, 32).to(torch.bfloat16)
    out = KERNEL(x, pair_gemm.pack(w), None, 70)
    assert out.shape == (2, 3, 70)
    assert torch.equal(out[1, 2], KERNEL(x.reshape(6, 32), pair_gemm.pack(w), None, 70)[5])


def test_odd_inputs_and_float32_weights_are_not_pair_packed():
    assert not pair_gemm.can_pack(torch.empty(8, 7, dtype=torch.bfloat16), None)
    assert not pair_gemm.can_pack(torch.empty(8, 8), None)
    layer = nn.Linear(7, 8, dtype=torch.bfloat16)
    assert pack_linears(layer) == 1 and layer.few_rows is None  # oneDNN's copy only
    x = torch.randn(1, 7).to(torch.bfloat16)
    torch.testing.assert_close(linear(x, layer.weight, layer.bias), F.linear(x, layer.weight,
                               layer.bias), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [2, 3, 4, 7, 64, 300])
def test_the_fma_tiles_sum_as_vdpbf16ps_does(rows):
    """Products exact in float32, added in `vdpbf16ps`'s order: the same bits (no denormals
    in these inputs, which `vdpbf16ps` flushes)."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(333, 576, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    packed = pair_gemm.pack(w)
    fma, dpbf16 = (VARIANTS[name](x, packed, None, 333) for name in ("fma", "dpbf16"))
    assert torch.equal(fma, dpbf16)


def test_the_amx_tiles_give_a_row_the_same_sums_in_any_block_of_rows():
    """A row's sums do not depend on the rows beside it in its block of 16, nor on the zero rows
    that pad a short block (one row alone takes `one_row`'s order: not compared)."""
    kernel = variant_or_skip("amx")
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(130, 200, generator=gen).to(torch.bfloat16)
    x = torch.randn(38, 200, generator=gen).to(torch.bfloat16)
    packed = pair_gemm.pack(w)
    together = kernel(x, packed, None, 130)
    for size in (2, 3, 17):
        parts = [kernel(x[i : i + size], packed, None, 130) for i in range(0, 36, size)]
        parts.append(kernel(x[len(parts) * size :], packed, None, 130))
        assert torch.equal(torch.cat(parts), together)


def test_load_picks_a_variant_and_its_row_limit_by_timing():
    name, rows = pair_gemm.calibrate(VARIANTS, repeat=3)
    assert name in VARIANTS
    assert rows in (0, *pair_gemm.CALIBRATION_ROWS, pair_gemm.ANY_ROWS)
    kernel = pair_gemm.load()
    assert kernel is None or (
        kernel.max_rows in (*pair_gemm.CALIBRATION_ROWS, pair_gemm.ANY_ROWS)
        and any(kernel._fn is v._fn for v in VARIANTS.values())
    )


def fake_timings(monkeypatch, seconds):
    """Each timing `calibrate` takes (ours or oneDNN's, in the order it takes them) is the next
    of `seconds`: stands in for a core's speeds, which the test cannot choose."""
    times = iter(seconds)
    for module in (pair_gemm, calibration):  # the kernel's timings and oneDNN's
        monkeypatch.setattr(module, "median_seconds", lambda fn, repeat: next(times))
    return times


def test_calibration_walks_the_row_counts_until_oneDNN_wins(monkeypatch):
    # each variant at 16 rows (the last fastest); it at 512 rows against oneDNN (no prefill);
    # then (ours, oneDNN's) at 1, 2, 4 and 8 rows: the kernel loses from 8 rows on
    names = list(VARIANTS)
    at16 = [2.0 + len(names) - i for i in range(len(names))]
    times = fake_timings(monkeypatch, [*at16, 5.0, 4.0, 1, 2, 1, 2, 2, 3, 3, 3])
    assert pair_gemm.calibrate(VARIANTS) == (names[-1], 4)
    assert next(times, None) is None  # nothing timed past the first loss


def test_calibration_gives_every_row_to_a_kernel_that_wins_at_prefill(monkeypatch):
    names = list(VARIANTS)
    at16 = [1.0 + i for i in range(len(names))]  # the first fastest
    times = fake_timings(monkeypatch, [*at16, 8.0, 10.0])  # < 0.9 x oneDNN at 512 rows
    assert pair_gemm.calibrate(VARIANTS) == (names[0], pair_gemm.ANY_ROWS)
    assert next(times, None) is None


@pytest.mark.parametrize("rows", [0, 8])
def test_linears_take_the_kernel_only_up_to_the_rows_it_wins_at(monkeypatch, rows):
    # the timing stands in for a core where the kernel beats oneDNN up to 8 rows, or nowhere
    monkeypatch.setattr(pair_gemm, "calibrate", lambda built: ("fma", rows))
    pair_gemm.load.cache_clear()
    try:
        kernel = pair_gemm.load()
        assert (kernel is None) if rows == 0 else (kernel.max_rows == rows)
        assert VARIANTS["fma"].max_rows == pair_gemm.MAX_ROWS  # the build is left as it was
    finally:
        pair_gemm.load.cache_clear()
