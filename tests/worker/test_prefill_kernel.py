"""The C prefill-attention kernels (`worker.kernels.prefill_attention`): causal attention of a
chunk over its cached prefix and itself, read from a bf16 pool (AVX512-BF16) or a float32 pool
(any CPU, at 8 and 16 lanes) by slot, against float64 attention; the native backend taking them for
prefill chunks beside a decode batch; where they do not serve."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import worker.attention.native as native
import worker.kernels.prefill_attention as prefill_kernel
from tests.worker.attention_kit import pass_over, random_pool
from tests.worker.kernel_kit import build_without
from worker.attention.registry import make_attention

BF16 = torch.bfloat16
POOL = 3000  # slots: room for the longest prefix and chunk drawn below


@pytest.fixture(scope="module")
def kernel():
    loaded = prefill_kernel.load()
    if loaded is None:
        pytest.skip("no AVX512-BF16 CPU or no C compiler: prefill runs torch's flash kernel")
    return loaded


def reference(q: torch.Tensor, k_buf, v_buf, slots: torch.Tensor) -> torch.Tensor:
    """float64 causal attention, the mask aligned to the end: q [nq, H, D] over keys at slots."""
    nq, heads, dim = q.shape
    nk, group = slots.numel(), heads // k_buf.shape[1]
    k = k_buf[slots].double().repeat_interleave(group, 1)
    v = v_buf[slots].double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(dim)
    visible = torch.arange(nk)[None, :] <= (nk - nq + torch.arange(nq))[:, None]
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


@settings(max_examples=40, deadline=None)
@given(
    nq=st.integers(1, 150),
    # past 512 keys the softmax runs over several spans (and rescales between them)
    prefix=st.sampled_from([0, 1, 31, 32, 33, 200, 480, 511, 512, 1100]),
    heads=st.sampled_from([(3, 3), (3, 1), (2, 4), (1, 8)]),
    dim=st.sampled_from([64, 128]),
    scale=st.sampled_from([0.5, 3.0]),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_float64_causal_attention(kernel, nq, prefix, heads, dim, scale, seed):
    kvh, group = heads
    gen = torch.Generator().manual_seed(seed)
    k_buf = (torch.randn(POOL, kvh, dim, generator=gen) * scale).to(BF16)
    v_buf = torch.randn(POOL, kvh, dim, generator=gen).to(BF16)
    slots = torch.randperm(POOL, generator=gen)[: prefix + nq]  # scattered, as a pool hands out
    q = torch.randn(nq, kvh * group, dim, generator=gen).to(BF16)
    before = (k_buf.clone(), v_buf.clone())
    out = kernel(q, k_buf, v_buf, slots)
    # bfloat16 weights and output: within a few bf16 steps of the exact result
    torch.testing.assert_close(out.double(), reference(q, k_buf, v_buf, slots), atol=1.5e-2,
                               rtol=1.5e-2)  # fmt: skip
    assert torch.equal(k_buf, before[0]) and torch.equal(v_buf, before[1])  # read only


def mixed_batch(seed: int, dtype=BF16):
    """A pool and a pass as the engine builds it: a chunk of 70 tokens over 130 cached ones, a
    cold chunk of 45, two decoding sequences."""
    gen = torch.Generator().manual_seed(seed)
    pool = random_pool(gen, POOL, 3, 64, dtype)
    perm = torch.randperm(POOL, generator=gen)
    q_lens, kv_lens = [1, 70, 45, 1], [60, 200, 45, 9]
    ends = torch.tensor(kv_lens).cumsum(0).tolist()
    seq_slots = [perm[end - n : end] for end, n in zip(ends, kv_lens, strict=True)]
    return (pool, *pass_over(gen, seq_slots, q_lens, 9, pool))


@pytest.mark.parametrize("seed", [0, 1])
def test_native_backend_takes_the_kernel_for_prefill_chunks(kernel, monkeypatch, seed):
    # the timing stands in for a core where the kernel beats torch's path at any size, and one
    # without AMX tiles (there a chunk over a cached prefix goes to the decode kernel instead)
    monkeypatch.setattr(native, "kernel_queries", lambda *a: native.UNBOUNDED)
    monkeypatch.setattr(native.NativeAttention, "_segment_kernel", lambda *a: None)
    calls = []
    real = type(kernel).__call__

    def spy(self, q, *args):
        calls.append(q.shape[0])
        return real(self, q, *args)

    monkeypatch.setattr(type(kernel), "__call__", spy)
    outs = {}
    for name in ("torch", "native"):
        pool, batch, q, k, v = mixed_batch(seed)
        outs[name] = make_attention(name).forward(q, k, v, 0, batch, pool).double()
    assert sorted(calls) == [45, 70]  # each prefill chunk, once; decodes elsewhere
    torch.testing.assert_close(outs["native"], outs["torch"], atol=1.5e-2, rtol=1.5e-2)


def test_chunks_past_the_kernels_calibrated_size_take_torchs_path(kernel, monkeypatch):
    # the timing stands in for a core where torch's flash wins past a few queries (as with
    # AMX), here without the decode kernel's tiles for chunks over a cached prefix
    monkeypatch.setattr(native, "kernel_queries", lambda *a: 50)
    monkeypatch.setattr(native.NativeAttention, "_segment_kernel", lambda *a: None)
    calls = []
    real = type(kernel).__call__
    spy = lambda self, q, *a: calls.append(q.shape[0]) or real(self, q, *a)  # noqa: E731
    monkeypatch.setattr(type(kernel), "__call__", spy)
    pool, batch, q, k, v = mixed_batch(0)
    out = make_attention("native").forward(q, k, v, 0, batch, pool).double()
    assert calls == [45]  # the chunk of 70 went to torch's path
    pool, batch, q, k, v = mixed_batch(0)
    ref = make_attention("torch").forward(q, k, v, 0, batch, pool).double()
    torch.testing.assert_close(out, ref, atol=1.5e-2, rtol=1.5e-2)


def test_calibration_walks_the_chunk_sizes_until_torch_wins(kernel, monkeypatch):
    # (ours, torch's) seconds at 16 and 64 queries: the kernel wins at 16, loses at 64
    times = iter([1.0, 2.0, 3.0, 2.0])
    monkeypatch.setattr(native, "median_seconds", lambda fn, repeat: next(times))
    assert native.kernel_queries.__wrapped__(kernel, 9, 3, 64) == 16
    assert next(times, None) is None  # nothing timed past the first loss
    times = iter([1.0, 2.0] * len(native.CALIBRATION_QUERIES))
    assert native.kernel_queries.__wrapped__(kernel, 9, 3, 64) == native.UNBOUNDED


def test_where_it_does_not_serve_prefill_runs_torchs_kernel(monkeypatch):
    q = torch.zeros(4, 9, 64, dtype=BF16)
    pool = torch.zeros(10, 3, 64, dtype=BF16)
    assert prefill_kernel.supports(q, pool)
    assert prefill_kernel.supports(q.float(), pool.float())
    assert not prefill_kernel.supports(q, pool.float())  # one dtype for both
    assert not prefill_kernel.supports(q.half(), pool.half())
    assert not prefill_kernel.supports(torch.zeros(4, 9, 80, dtype=BF16),
                                       torch.zeros(10, 3, 80, dtype=BF16))  # fmt: skip
    assert not prefill_kernel.supports(torch.zeros(4, 9, 72), torch.zeros(10, 3, 72))
    assert not prefill_kernel.supports(q, pool.transpose(0, 1))  # not the pool's layout
    monkeypatch.setattr(native.prefill_kernel, "load", lambda dtype: None)
    pool_, batch, q, k, v = mixed_batch(0)
    out = native.NativeAttention().forward(q, k, v, 0, batch, pool_)
    pool2, batch2, q2, k2, v2 = mixed_batch(0)
    ref = make_attention("torch").forward(q2, k2, v2, 0, batch2, pool2)
    torch.testing.assert_close(out.double(), ref.double(), atol=1.5e-2, rtol=1.5e-2)


@pytest.fixture(scope="module")
def float32_kernels(tmp_path_factory):
    """The float32 kernel at 8 lanes (what an AVX2 core builds) and at 16 (an AVX-512 core's),
    whichever this core builds by default."""
    kernels = {}
    for width in (8, 16):
        library = build_without(prefill_kernel.F32_SOURCE, "-mno-avx512bf16",
                                tmp_path_factory.mktemp(f"vw{width}"), f"-DVW={width}")
        kernels[width] = prefill_kernel.PrefillKernel(library, torch.float32)
    return kernels


@settings(max_examples=40, deadline=None)
@given(
    width=st.sampled_from([8, 16]),
    nq=st.integers(1, 150),
    # past 512 keys the softmax runs over several spans (and rescales between them)
    prefix=st.sampled_from([0, 1, 15, 16, 17, 200, 480, 511, 512, 1100]),
    heads=st.sampled_from([(3, 3), (3, 1), (2, 4), (1, 8), (4, 5)]),
    dim=st.sampled_from([16, 48, 64, 128]),
    scale=st.sampled_from([0.5, 3.0]),
    seed=st.integers(0, 2**16),
)
def test_float32_kernel_matches_float64_causal_attention(
    float32_kernels, width, nq, prefix, heads, dim, scale, seed
):
    kvh, group = heads
    gen = torch.Generator().manual_seed(seed)
    k_buf = torch.randn(POOL, kvh, dim, generator=gen) * scale
    v_buf = torch.randn(POOL, kvh, dim, generator=gen)
    slots = torch.randperm(POOL, generator=gen)[: prefix + nq]  # scattered, as a pool hands out
    q = torch.randn(nq, kvh * group, dim, generator=gen)
    before = (k_buf.clone(), v_buf.clone())
    out = float32_kernels[width](q, k_buf, v_buf, slots)
    # float32 scores, weights and sums: within float32 rounding of the exact result
    torch.testing.assert_close(out.double(), reference(q, k_buf, v_buf, slots), atol=2e-5,
                               rtol=2e-5)  # fmt: skip
    assert torch.equal(k_buf, before[0]) and torch.equal(v_buf, before[1])  # read only


@pytest.mark.parametrize("seed", [0, 1])
def test_native_backend_takes_the_float32_kernel_for_prefill_chunks(monkeypatch, seed):
    kernel = prefill_kernel.load(torch.float32)
    if kernel is None:
        pytest.skip("no C compiler: prefill runs torch's flash kernel")
    monkeypatch.setattr(native, "kernel_queries", lambda *a: native.UNBOUNDED)  # as if it won
    calls = []
    real = type(kernel).__call__

    def spy(self, q, *args):
        calls.append((q.shape[0], q.dtype))
        return real(self, q, *args)

    monkeypatch.setattr(type(kernel), "__call__", spy)
    outs = {}
    for name in ("torch", "native"):
        pool, batch, q, k, v = mixed_batch(seed, torch.float32)
        outs[name] = make_attention(name).forward(q, k, v, 0, batch, pool).double()
    assert sorted(calls) == [(45, torch.float32), (70, torch.float32)]
    torch.testing.assert_close(outs["native"], outs["torch"], atol=2e-5, rtol=2e-5)
