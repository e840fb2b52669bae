"""The float32 few-rows linear (`worker.kernels.f32_gemm`): float32 sums of any shape against
float64, as built here and at both vector widths (AVX-512's 16 lanes, groups of 64 outputs and
blocks of up to 6 rows; 8 lanes elsewhere, groups of 8 and one block of up to 8 rows, or blocks
of up to 6 rows over 2 groups in a call of more rows), a row's result whatever rows share the
call: the same bits alone as in a wide block. When `linear` takes it, and the engine's output
with it: test_packed_linear."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import worker.kernels.calibration as calibration
import worker.kernels.f32_gemm as f32_gemm
from tests.worker.kernel_kit import build_without

KERNEL = f32_gemm.build()  # as built, whether or not `load` takes it on this core
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C compiler here")


def within_float32_sums(out, x, w, b) -> bool:
    """Whether `out` is x.w^T + b up to what float32 sums of K products may drift
    (K * 2^-24 of the sum of |products|, and a float32 rounding of the result)."""
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    scale = x.double().abs() @ w.double().abs().T + (b.double().abs() if b is not None else 0.0)
    bound = (x.shape[-1] + 2) * 2.0**-24 * scale + 1e-30
    return bool(((out.double() - exact).abs() <= bound).all())


def check(kernel, rows, out_features, in_features, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, in_features, generator=gen)
    out = kernel(x, kernel.pack(w), b, out_features)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    assert within_float32_sums(out, x, w, b)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, f32_gemm.MAX_ROWS),
    out_features=st.integers(1, 200),
    in_features=st.integers(1, 300),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_f32_linear_is_a_float32_sum_for_any_shape(rows, out_features, in_features, bias, seed):
    check(KERNEL, rows, out_features, in_features, bias, seed)


def test_f32_linear_over_a_long_input():
    for rows in (1, 2, 6, 7, 32):
        check(KERNEL, rows, 130, 1536, True, rows)


@pytest.mark.parametrize("width", [8, 16])
def test_either_width_is_a_float32_sum_too(tmp_path, width):
    """The kernel at 8 lanes (a CPU without AVX-512) and at 16 (AVX-512's), whichever this
    core builds by default, run here: every block size of either (rows 1-8, then blocks
    split evenly: wide ones at 8 lanes), a group cut short by the outputs."""
    library = build_without(f32_gemm.SOURCE, f"-DVW={width}", tmp_path)
    kernel = f32_gemm.F32Gemm(library, f32_gemm.MAX_ROWS)
    assert kernel.group == {8: 8, 16: 64}[width]
    for rows in (*range(1, 10), 13, 31, 32):
        check(kernel, rows, 200, 96, rows % 2 == 1, rows)
        check(kernel, rows, 70, 1536, False, rows)
    assert_rows_alone_as_together(kernel)


def test_f32_linear_keeps_the_batch_shape():
    w = torch.randn(70, 32)
    x = torch.randn(2, 3, 32)
    out = KERNEL(x, f32_gemm.pack(w), None, 70)
    assert out.shape == (2, 3, 70)
    assert torch.equal(out[1, 2], KERNEL(x[1, 2:3], f32_gemm.pack(w), None, 70)[0])


def assert_rows_alone_as_together(kernel):
    """Each row's bits the same alone as among others (a batch's rows never change a
    request's greedy tokens): every block size either width makes, the groups taken 1-4 at
    once."""
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(100, 200, generator=gen), torch.randn(32, 200, generator=gen)
    packed = kernel.pack(w)
    alone = torch.cat([kernel(x[i : i + 1], packed, None, 100) for i in range(32)])
    for rows in (2, 3, 5, 7, 8, 9, 17, 32):
        assert torch.equal(kernel(x[:rows], packed, None, 100), alone[:rows])


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    assert_rows_alone_as_together(KERNEL)


@pytest.mark.parametrize("rows", [0, 8])
def test_linears_take_the_kernel_only_up_to_the_rows_it_wins_at(monkeypatch, rows):
    # the timing stands in for a core where the kernel beats oneDNN up to 8 rows, or nowhere
    monkeypatch.setattr(f32_gemm, "calibrate", lambda kernel: rows)
    f32_gemm.load.cache_clear()
    try:
        kernel = f32_gemm.load()
        assert (kernel is None) if rows == 0 else (kernel.max_rows == rows)
        assert KERNEL.max_rows == f32_gemm.MAX_ROWS  # the build itself is left as it was
    finally:
        f32_gemm.load.cache_clear()


def test_calibration_times_each_row_count_until_the_kernel_loses(monkeypatch):
    # (ours, oneDNN's) seconds at 1, 2 and 4 rows: the kernel loses from 4 rows on
    times = iter([1.0, 2.0, 1.0, 2.0, 3.0, 2.0])
    # the kernel's timings and oneDNN's (`calibration.rows_won`)
    monkeypatch.setattr(calibration, "median_seconds", lambda fn, repeat: next(times))
    assert f32_gemm.calibrate(KERNEL) == 2
    assert next(times, None) is None  # nothing timed past the first loss
