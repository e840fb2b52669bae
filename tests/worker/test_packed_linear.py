"""Linears with oneDNN-packed weights give F.linear's bits (without a bias), and the engine's
greedy output does not change with them, eager or compiled; `linear` takes a dtype's few-rows
kernel (`packed.FEW_ROWS`) for few rows on one thread only, and the engine's greedy output with
it is oneDNN's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from engine_kit import greedy_tokens, mixed_prompts
from torch import nn

import worker.kernels.calibration as calibration
import worker.kernels.f32_gemm as f32_gemm
import worker.kernels.linear as packed
import worker.kernels.pair_gemm as pair_gemm
from worker.engine import Engine, EngineConfig
from worker.kernels.linear import can_pack, linear, pack_linears, packed_of
from worker.offline import Completion, run_to_completion
from worker.protocol import GenerateRequest, SamplingParams

# oneDNN's bf16 linear needs AVX512-BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only core has none
needs_bf16 = pytest.mark.skipif(
    not can_pack(torch.empty(1, dtype=torch.bfloat16)), reason="no oneDNN bf16 linear here"
)
pytestmark = pytest.mark.skipif(
    not can_pack(torch.empty(1, dtype=torch.float32)), reason="no oneDNN linear here"
)
BF16 = pytest.param(torch.bfloat16, marks=needs_bf16)
# With AMX, oneDNN's bf16 linears over many rows sum in its tiles' order, not pair after pair
AMX = Path("/proc/cpuinfo").exists() and "amx_bf16" in Path("/proc/cpuinfo").read_text()


@needs_bf16
@pytest.mark.parametrize("rows", [1, 5, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_gives_f_linear_bits(monkeypatch, rows, bias):
    monkeypatch.setattr(pair_gemm, "load", lambda: None)  # oneDNN's packed copy alone
    gen = torch.Generator().manual_seed(rows)
    layer = nn.Linear(96, 200, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(200, 96, generator=gen))
    assert pack_linears(layer) == 1 and layer.packed.is_mkldnn
    assert packed_of(layer.weight) is layer.packed
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
    out, ref = linear(x, layer.weight, layer.bias), F.linear(x, layer.weight, layer.bias)
    assert torch.equal(torch.ops.radixray.packed_linear(x, layer.weight, layer.bias), out)
    if bias:  # the bias may be added in another order: a rounding step apart at most
        torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(out, ref)


@needs_bf16
def test_only_the_live_weight_itself_finds_its_packed_copy():
    layer = nn.Linear(64, 48, bias=False, dtype=torch.bfloat16)
    pack_linears(layer)
    assert packed_of(layer.weight[:16]) is None  # same address, another tensor
    alias = layer.weight.detach()
    assert packed_of(alias) is layer.packed  # the same weight, another view of it
    del layer  # the weight is gone: its address may be another tensor's from now on
    assert alias.data_ptr() not in packed._REGISTRY  # nor is its packed copy kept
    assert packed_of(alias) is None
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert torch.equal(linear(x, alias, None), F.linear(x, alias))


def test_float32_weights_are_packed_too():
    layer = nn.Linear(64, 32)
    assert pack_linears(layer) == 1 and packed_of(layer.weight) is layer.packed
    # and in the float32 few-rows kernel's layout, where it builds
    assert (layer.few_rows is not None) == (f32_gemm.load() is not None)
    for rows in (1, 7, 300):
        x = torch.randn(rows, 64)
        got = linear(x, layer.weight, layer.bias)
        # oneDNN and the kernel sum in other orders than F.linear (MKL): float32 rounding apart
        torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_linear_takes_the_few_rows_kernel_for_few_rows_on_one_thread(monkeypatch, dtype):
    module = packed.FEW_ROWS[dtype]
    kernel = module.load()
    if kernel is None:
        pytest.skip(f"{module.__name__} cannot run here")
    calls = []
    real = type(kernel).__call__
    monkeypatch.setattr(type(kernel), "__call__",
                        lambda self, x, *a: calls.append(x.shape) or real(self, x, *a))  # fmt: skip
    layer = nn.Linear(64, 128, dtype=dtype)
    assert pack_linears(layer) == 1 and layer.few_rows is not None
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {}
    # where the kernel takes prefill chunks too (pair_gemm.calibrate), a limit to test
    monkeypatch.setattr(kernel, "max_rows", min(kernel.max_rows, module.MAX_ROWS))
    limit = kernel.max_rows
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for rows in (1, limit, limit + 1):
            x = torch.randn(rows, 64).to(dtype)
            want = F.linear(x, layer.weight, layer.bias)
            torch.testing.assert_close(linear(x, layer.weight, layer.bias), want, **tol)
        assert calls == [(1, 64), (limit, 64)]  # more rows: oneDNN
        torch.set_num_threads(2)  # oneDNN uses every thread, the kernel one
        linear(torch.randn(1, 64).to(dtype), layer.weight, None)
        assert len(calls) == 2
    finally:
        torch.set_num_threads(before)


def test_linear_takes_f_linear_over_the_dense_weight_from_the_calibrated_rows(monkeypatch):
    monkeypatch.setattr(f32_gemm, "load", lambda: None)  # no few-rows kernel: oneDNN below
    monkeypatch.setattr(packed, "dense_from", lambda dtype, threads: 64)
    layer = nn.Linear(64, 96)
    assert pack_linears(layer) == 1
    onednn = torch.ops.mkldnn._linear_pointwise
    real, calls = F.linear, []
    monkeypatch.setattr(F, "linear", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    for rows in (1, 63, 64, 300):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        got = linear(x, layer.weight, layer.bias)
        if rows < 64:  # the packed copy's own bits
            assert torch.equal(got, onednn(x, layer.packed, layer.bias, "none", [], ""))
        else:
            assert torch.equal(got, real(x, layer.weight, layer.bias))
    assert calls == [64, 300]


def test_dense_from_walks_down_the_row_counts_until_onednn_wins(monkeypatch):
    # a warm-up each (dense, oneDNN), then (dense, oneDNN) seconds at 512, 256 and 128 rows:
    # F.linear wins down to 256 rows and loses at 128
    times = iter([9.0, 9.0, 1.0, 2.0, 1.0, 2.0, 2.0, 1.0])
    monkeypatch.setattr(calibration, "median_seconds", lambda fn, repeat: next(times))
    assert packed.MANY_ROWS[:3] == (512, 256, 128)
    assert packed.dense_from.__wrapped__(torch.float32, 1) == 256
    assert next(times, None) is None  # nothing timed past the first loss
    times = iter([9.0, 9.0, 2.0, 1.0])  # oneDNN wins at 512: never F.linear
    monkeypatch.setattr(calibration, "median_seconds", lambda fn, repeat: next(times))
    assert packed.dense_from.__wrapped__(torch.float32, 1) == packed.NEVER


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=needs_bf16), "float32"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_greedy_output_with_the_few_rows_kernel_is_onednns(monkeypatch, page_size, dtype):
    """The same tiny model decoding with and without its dtype's few-rows kernel (one thread,
    this folder's conftest): the same tokens, mixed prefill and decode batches included."""
    module = packed.FEW_ROWS[getattr(torch, dtype)]
    # float32: the kernel as built, on every few-row linear, where `load` would leave it too
    kernel = f32_gemm.build() if module is f32_gemm else module.load()
    if kernel is None:
        pytest.skip(f"{module.__name__} cannot run here")
    if module is f32_gemm:
        monkeypatch.setattr(kernel, "max_rows", f32_gemm.MAX_ROWS)
        monkeypatch.setattr(f32_gemm, "load", lambda: kernel)
    prompts = mixed_prompts(11)
    config = {"model": "tiny", "dtype": dtype, "kv_tokens": 8192, "page_size": page_size}
    with_kernel = greedy_tokens(prompts, **config)
    monkeypatch.setattr(kernel, "max_rows", 0)
    assert greedy_tokens(prompts, **config) == with_kernel


@needs_bf16
@pytest.mark.skipif(AMX, reason="with AMX oneDNN's prefill sums differ and the kernel never "
                    "takes prefill (pair_gemm.calibrate); test_pair_gemm checks its rounding")
@pytest.mark.parametrize("variant", ["dpbf16", "fma"])
def test_engine_greedy_output_with_either_bf16_kernel_on_every_linear_is_onednns(
    monkeypatch, variant
):
    """Each bf16 variant taking every linear, prefill chunks included (what `pair_gemm.load`
    picks on a core where it beats oneDNN at their size): oneDNN's tokens."""
    kernel = pair_gemm.variants().get(variant)
    if kernel is None:
        pytest.skip("pair_gemm cannot run here")
    prompts = mixed_prompts(11)
    config = {"model": "tiny", "dtype": "bfloat16", "kv_tokens": 8192, "page_size": 16}
    monkeypatch.setattr(kernel, "max_rows", 0)
    monkeypatch.setattr(pair_gemm, "load", lambda: kernel)
    onednn = greedy_tokens(prompts, **config)
    monkeypatch.setattr(kernel, "max_rows", pair_gemm.ANY_ROWS)
    assert greedy_tokens(prompts, **config) == onednn


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=needs_bf16), "float32"])
def test_engine_greedy_output_is_the_same_with_packed_weights(dtype):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 40, 17)]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = []
    for pack in (False, True):
        engine = Engine(EngineConfig(model="tiny", dtype=dtype, kv_tokens=1024, pack_weights=pack))
        assert any(hasattr(m, "packed") for m in engine.model.modules()) == pack
        reqs = [GenerateRequest(f"p{i}", p, sp) for i, p in enumerate(prompts)]
        out = run_to_completion(engine, reqs, after_step=lambda e, s: e.check_integrity())
        outs.append([out[r.request_id].token_ids for r in reqs])
    assert outs[0] == outs[1]


def engine_greedy(prompts: list[list[int]], **config) -> tuple[Engine, list[Completion]]:
    engine = Engine(EngineConfig(model="tiny", dtype="bfloat16", kv_tokens=1024, **config))
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
    reqs = [GenerateRequest(f"p{i}", p, sp) for i, p in enumerate(prompts)]
    out = run_to_completion(engine, reqs, after_step=lambda e, s: e.check_integrity())
    return engine, [out[r.request_id] for r in reqs]


TIE = 0.1  # logprob: a few bf16 roundings apart (bf16 steps of a logit near 4 are 0.03)


@needs_bf16
def test_compiled_layers_with_packed_weights_give_the_eager_output(monkeypatch):
    """Under torch.compile the linears are the `radixray::packed_linear` op on the dense
    weights, finding the packed ones as they run; the rest of the layer is fused around them,
    rounding where the eager code rounds. Its sums may run in another order (the CPU's vector
    width decides): every token is eager's, up to a near-tie, after which the texts part."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 40, 17)]
    _, eager = engine_greedy(prompts)
    found = []
    lookup = packed._entry
    monkeypatch.setattr(packed, "_entry", lambda w: found.append(lookup(w)) or found[-1])
    engine, compiled = engine_greedy(prompts, compile=True)
    assert all(k.active for k in engine.model.kernels)  # compiled for real, no fallback
    assert found and all(e is not None and e.onednn.is_mkldnn for e in found)
    for e, c in zip(eager, compiled, strict=True):
        for i, (te, tc) in enumerate(zip(e.token_ids, c.token_ids, strict=True)):
            best = dict(e.top_logprobs[i])
            if te != tc:  # a near-tie in eager's own distribution
                assert tc in best and best[te] - best[tc] <= TIE, (i, e.top_logprobs[i], tc)
                break
            assert abs(e.logprobs[i] - c.logprobs[i]) <= TIE


@needs_bf16
def test_a_failed_compile_falls_back_to_eager_packed_linears(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    rng = random.Random(6)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (9, 30)]
    _, eager = engine_greedy(prompts)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: broken)
    engine, out = engine_greedy(prompts, compile=True)
    assert [c.token_ids for c in out] == [c.token_ids for c in eager]  # eager: the same bits
    assert not any(k.active for k in engine.model.kernels)
    assert any(hasattr(m, "packed") for m in engine.model.modules())
    assert "running it eagerly" in caplog.text
