"""The float32 few-rows linear (`worker.models.f32_gemm`): float32 sums of any shape against
float64, as built here (AVX-512: blocks of 6 rows) and for a CPU without AVX-512 (blocks of 2);
`linear` takes it for few float32 rows on one thread only, and the engine's greedy output is
what oneDNN's linears give."""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import worker.models.c_library as c_library
import worker.models.f32_gemm as f32_gemm
from worker.engine import Engine, EngineConfig
from worker.models.packed import linear, pack_linears
from worker.offline import run_to_completion
from worker.protocol import GenerateRequest, SamplingParams

KERNEL = f32_gemm.load()
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
    out = kernel(x, f32_gemm.pack(w), b, out_features)
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


def test_the_build_without_avx512_is_a_float32_sum_too(tmp_path):
    """The kernel as built for a CPU without AVX-512 (blocks of 2 rows on 8-float vectors),
    run here."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    source, library = tmp_path / "kernel.c", tmp_path / "kernel.so"
    source.write_text(f32_gemm.SOURCE)
    build = [compiler, *c_library.FLAGS, "-mno-avx512f", str(source), "-o", str(library)]
    if subprocess.run(build, capture_output=True).returncode != 0:
        pytest.skip("this compiler cannot build for x86 without AVX-512")
    kernel = f32_gemm.F32Gemm(ctypes.CDLL(str(library)))
    for rows in (1, 2, 3, 5, 32):
        check(kernel, rows, 200, 96, rows % 2 == 1, rows)
        check(kernel, rows, 70, 1536, False, rows)


def test_f32_linear_keeps_the_batch_shape():
    w = torch.randn(70, 32)
    x = torch.randn(2, 3, 32)
    out = KERNEL(x, f32_gemm.pack(w), None, 70)
    assert out.shape == (2, 3, 70)
    assert torch.equal(out[1, 2], KERNEL(x[1, 2:3], f32_gemm.pack(w), None, 70)[0])


def test_linear_takes_the_kernel_for_few_float32_rows_on_one_thread(monkeypatch):
    calls = []
    real = f32_gemm.F32Gemm.__call__
    monkeypatch.setattr(
        f32_gemm.F32Gemm, "__call__", lambda self, x, *a: calls.append(x.shape) or real(self, x, *a)
    )
    layer = nn.Linear(64, 128)
    assert pack_linears(layer) == 1 and layer.few_rows is not None
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for rows in (1, f32_gemm.MAX_ROWS, f32_gemm.MAX_ROWS + 1):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(
                linear(x, layer.weight, layer.bias), F.linear(x, layer.weight, layer.bias)
            )
        assert calls == [(1, 64), (f32_gemm.MAX_ROWS, 64)]  # more rows: oneDNN
        torch.set_num_threads(2)  # oneDNN uses every thread, the kernel one
        linear(torch.randn(1, 64), layer.weight, None)
        assert len(calls) == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_greedy_output_with_the_kernel_is_onednns(monkeypatch, page_size):
    """The same tiny float32 model decoding with and without the kernel (one thread): the
    same tokens, mixed prefill and decode batches included, a prompt over 2k tokens and two
    behind one shared prefix among them."""
    rng = random.Random(12)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 40, 17, 3, 2100)]
    shared = [rng.randrange(3, 1000) for _ in range(300)]
    prompts += [shared + [rng.randrange(3, 1000) for _ in range(n)] for n in (7, 30)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outs = []
        for use in (True, False):
            if not use:
                monkeypatch.setattr(f32_gemm, "MAX_ROWS", 0)
            engine = Engine(
                EngineConfig(model="tiny", dtype="float32", kv_tokens=8192, page_size=page_size)
            )
            reqs = [GenerateRequest(f"p{i}", p, sp) for i, p in enumerate(prompts)]
            out = run_to_completion(engine, reqs, after_step=lambda e, s: e.check_integrity())
            outs.append([out[r.request_id].token_ids for r in reqs])
        assert outs[0] == outs[1]
    finally:
        torch.set_num_threads(before)
