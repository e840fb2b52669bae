"""The pair-packed bf16 linear (`worker.models.pair_gemm`): one rounding of a float32 sum, any
output count, a bias; `linear` takes it for few rows on one thread only, and the engine's
greedy output is what oneDNN's linears give."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import worker.models.pair_gemm as pair_gemm
from worker.engine import Engine, EngineConfig
from worker.models.packed import linear, pack_linears
from worker.offline import run_to_completion
from worker.protocol import GenerateRequest, SamplingParams

KERNEL = pair_gemm.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no AVX512-BF16 or no C compiler here")


def within_one_rounding(out, x, w, b) -> bool:
    """Whether `out` is the exact x.w^T + b rounded once to bf16, give or take one bf16 step
    and what float32 sums of K products may drift (K * 2^-24 of the sum of |products|)."""
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    scale = x.double().abs() @ w.double().abs().T
    step = 2.0 ** torch.floor(torch.log2(exact.abs().clamp(min=1e-30))) * 2.0**-7
    drift = x.shape[-1] * 2.0**-24 * scale
    return bool(((out.double() - exact).abs() <= step + drift).all())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16, 37, 64])
@pytest.mark.parametrize(("out_features", "in_features"), [(200, 96), (64, 2), (130, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_pair_linear_rounds_a_float32_sum_once(rows, out_features, in_features, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    b = torch.randn(out_features, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    out = KERNEL(x, pair_gemm.pack(w), b, out_features)
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    # float32 sums of exact products, rounded once; and mostly the same bits as F.linear
    # (oneDNN sums the same products in the same order)
    assert within_one_rounding(out, x, w, b)
    same = (out == F.linear(x, w, b)).double().mean()
    assert same >= 0.97, same


def test_pair_linear_keeps_the_batch_shape():
    w = torch.randn(70, 32).to(torch.bfloat16)
    x = torch.randn(2, 3, 32).to(torch.bfloat16)
    out = KERNEL(x, pair_gemm.pack(w), None, 70)
    assert out.shape == (2, 3, 70)
    assert torch.equal(out[1, 2], KERNEL(x[1, 2:3], pair_gemm.pack(w), None, 70)[0])


def test_odd_inputs_and_float32_weights_are_not_pair_packed():
    assert not pair_gemm.can_pack(torch.empty(8, 7, dtype=torch.bfloat16), None)
    assert not pair_gemm.can_pack(torch.empty(8, 8), None)
    layer = nn.Linear(7, 8, dtype=torch.bfloat16)
    assert pack_linears(layer) == 1 and layer.few_rows is None  # oneDNN's copy only
    x = torch.randn(1, 7).to(torch.bfloat16)
    torch.testing.assert_close(linear(x, layer.weight, layer.bias), F.linear(x, layer.weight,
                               layer.bias), rtol=1e-2, atol=1e-2)


def test_linear_takes_the_kernel_for_few_rows_on_one_thread(monkeypatch):
    calls = []
    real = pair_gemm.PairGemm.__call__
    monkeypatch.setattr(pair_gemm.PairGemm, "__call__",
                        lambda self, x, *a: calls.append(x.shape) or real(self, x, *a))
    layer = nn.Linear(64, 128, bias=False, dtype=torch.bfloat16)
    assert pack_linears(layer) == 1 and layer.few_rows is not None
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for rows in (1, pair_gemm.MAX_ROWS, pair_gemm.MAX_ROWS + 1):
            linear(torch.randn(rows, 64).to(torch.bfloat16), layer.weight, None)
        assert calls == [(1, 64), (pair_gemm.MAX_ROWS, 64)]  # more rows: oneDNN
        torch.set_num_threads(2)  # oneDNN uses every thread, the kernel one
        linear(torch.randn(1, 64).to(torch.bfloat16), layer.weight, None)
        assert len(calls) == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_greedy_output_with_the_kernel_is_onednns(monkeypatch, page_size):
    """The same tiny bf16 model decoding with and without the kernel (one thread): the same
    tokens, step by step, mixed prefill and decode batches included, a prompt over 2k tokens
    and two behind one shared prefix among them."""
    rng = random.Random(11)
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
                monkeypatch.setattr(pair_gemm, "MAX_ROWS", 0)
            engine = Engine(EngineConfig(
                model="tiny", dtype="bfloat16", kv_tokens=8192, page_size=page_size))
            reqs = [GenerateRequest(f"p{i}", p, sp) for i, p in enumerate(prompts)]
            out = run_to_completion(engine, reqs, after_step=lambda e, s: e.check_integrity())
            outs.append([out[r.request_id].token_ids for r in reqs])
        assert outs[0] == outs[1]
    finally:
        torch.set_num_threads(before)
