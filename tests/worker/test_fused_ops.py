"""The C element-wise loops of a layer (`worker.kernels.fused_ops`) against torch's eager ops: in
bf16, RoPE and the residual add bit for bit, SiLU * up and the norms up to a bf16 step or two
in rare values (the exp inside SiLU and the order of a norm's sum of squares differ); in
float32 (its own build), the residual add bit for bit and the rest within float32 rounding;
and a tiny engine decoding the same tokens with and without them, in both dtypes."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from engine_kit import greedy_tokens, mixed_prompts
from hypothesis import given, settings
from hypothesis import strategies as st

import worker.kernels.fused_ops as fused_ops
from worker.engine import Engine, EngineConfig
from worker.models import llama
from worker.models.rope import RotaryEmbedding
from worker.offline import run_to_completion
from worker.protocol import GenerateRequest, SamplingParams


def load_or_skip(dtype):
    loaded = fused_ops.load(dtype)
    if loaded is None:
        pytest.skip("no C compiler here: the layer runs torch's ops")
    return loaded


@pytest.fixture(scope="module")
def ops():
    return load_or_skip(torch.bfloat16)


@pytest.fixture(scope="module")
def ops32():
    return load_or_skip(torch.float32)


def eager_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart each pair is (same-sign values; 0 where equal)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return torch.where(a == b, 0, (ia - ib).abs())


def bf16(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)


# rows of activations to norm: how many, how wide, their magnitude, the seed that draws them
ROWS = {
    "rows": st.integers(1, 70),
    "n": st.sampled_from([16, 64, 576, 1000]),
    "scale": st.sampled_from([1e-3, 1.0, 30.0]),
    "seed": st.integers(0, 2**16),
}


@settings(max_examples=40, deadline=None)
@given(**ROWS)
def test_norms_are_eagers_but_for_rare_last_bits(ops, rows, n, scale, seed):
    x, res, w = bf16(seed, rows, n, scale=scale), bf16(seed + 1, rows, n), bf16(seed + 2, n)
    # The scale's sum runs in another order: x * scale may round one bf16 step apart, and
    # the weight's product after it up to two; almost every value is eager's.
    out = ops.rms_norm(x, w, 1e-5)
    apart = ulps_apart(out, eager_norm(x, w, 1e-5))
    assert int(apart.max()) <= 2 and float((apart == 0).float().mean()) > 0.99
    total, normed = ops.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(total, x + res)  # the residual add: one rounding, as torch's
    apart = ulps_apart(normed, eager_norm(x + res, w, 1e-6))
    assert int(apart.max()) <= 2 and float((apart == 0).float().mean()) > 0.99
    assert torch.equal(x, bf16(seed, rows, n, scale=scale))  # the inputs are left as they were


def rope_both_ways(ops, qkv, num_heads, num_kv, head_dim, seed):
    """RoPE of the q and k heads of `qkv` at random positions by the loops and by torch's
    eager ops: (q, k, eager's q, eager's k)."""
    rows = qkv.shape[0]
    rope = RotaryEmbedding(head_dim, 10000.0, None, torch.device("cpu"))
    positions = torch.tensor(random.Random(seed).sample(range(100_000), rows))
    cos, sin = rope.cos_sin(positions, qkv.dtype)
    q, k = ops.rope(qkv, num_heads, num_kv, head_dim, cos, sin)
    q_size, kv_size = num_heads * head_dim, num_kv * head_dim
    want_q, want_k = RotaryEmbedding.apply(
        qkv[:, :q_size].reshape(rows, num_heads, head_dim),
        qkv[:, q_size : q_size + kv_size].reshape(rows, num_kv, head_dim),
        cos,
        sin,
    )
    return q, k, want_q, want_k


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 40),
    heads=st.sampled_from([(9, 3), (4, 4), (2, 1)]),
    head_dim=st.sampled_from([16, 64, 128]),
    seed=st.integers(0, 2**16),
)
def test_rope_is_eagers_bit_for_bit(ops, rows, heads, head_dim, seed):
    num_heads, num_kv = heads
    qkv = bf16(seed, rows, (num_heads + 2 * num_kv) * head_dim, scale=3.0)
    q, k, want_q, want_k = rope_both_ways(ops, qkv, num_heads, num_kv, head_dim, seed)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert q.is_contiguous() and k.is_contiguous()


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), m=st.sampled_from([8, 100, 1536]), seed=st.integers(0, 2**16))
def test_silu_mul_is_eagers_up_to_a_last_bit(ops, rows, m, seed):
    gate_up = bf16(seed, rows, 2 * m, scale=4.0)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = ops.silu_mul(gate_up)
    assert int(ulps_apart(got, want).max()) <= 1
    assert float((got == want).float().mean()) > 0.999


@settings(max_examples=30, deadline=None)
@given(**ROWS)
def test_float32_loops_are_eagers_within_float32_rounding(ops32, rows, n, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    x, res = torch.randn(rows, n, generator=gen) * scale, torch.randn(rows, n, generator=gen)
    w = torch.randn(n, generator=gen)
    close = {"rtol": 2e-6, "atol": 1e-6 * scale}
    torch.testing.assert_close(ops32.rms_norm(x, w, 1e-5), eager_norm(x, w, 1e-5), **close)
    total, normed = ops32.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(total, x + res)  # one rounding of one add, as torch's
    torch.testing.assert_close(normed, eager_norm(x + res, w, 1e-6), **close)
    gate_up = torch.randn(rows, 2 * n, generator=gen) * 4.0
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops32.silu_mul(gate_up), F.silu(gate) * up, rtol=2e-6, atol=1e-6)
    qkv = torch.randn(rows, (9 + 2 * 3) * 64, generator=gen) * 3.0
    q, k, want_q, want_k = rope_both_ways(ops32, qkv, 9, 3, 64, seed)
    torch.testing.assert_close(q, want_q, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(k, want_k, rtol=2e-6, atol=2e-6)


def test_special_values_pass_through(ops):
    x = torch.tensor([[float("nan")] + [1.0] * 15, [0.0] * 16], dtype=torch.bfloat16)
    out = ops.rms_norm(x, torch.ones(16, dtype=torch.bfloat16), 1e-5)
    assert bool(out[0].isnan().all())  # a NaN in a row poisons its norm, as in torch
    assert bool((out[1] == 0).all())  # a zero row stays zero (eps keeps the scale finite)
    gates = [-200.0, 200.0, -88.5, -89.5, 90.0, float("-inf"), float("inf"), float("nan")]
    gate_up = torch.tensor([gates + [1.0] * len(gates)], dtype=torch.bfloat16)
    got, want = ops.silu_mul(gate_up), F.silu(gate_up[:, : len(gates)])
    assert torch.equal(got.isnan(), want.isnan())  # silu(-inf) = -inf / inf, and NaN, are NaN
    assert torch.equal(got.nan_to_num(), want.nan_to_num())  # exp's overflow at ~88.7 as torch's


def test_serves_bf16_and_float32_cpu_activations_and_small_batches_on_many_threads(
    ops, ops32, monkeypatch
):
    assert fused_ops.serves(torch.zeros(4, 8, dtype=torch.bfloat16)) is ops
    assert fused_ops.serves(torch.zeros(4, 8)) is ops32
    assert fused_ops.serves(torch.zeros(4, 8, dtype=torch.float16)) is None
    big = torch.zeros(fused_ops.PARALLEL_ROWS + 1, 8, dtype=torch.bfloat16)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert fused_ops.serves(big) is None  # torch's ops spread a prefill over the threads
    assert fused_ops.serves(big[:4]) is ops
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert fused_ops.serves(big) is ops


def test_the_layer_takes_the_loops_in_bf16(ops, monkeypatch):
    calls = []
    for name in ("rms_norm", "add_rms_norm", "rope", "silu_mul"):
        real = getattr(type(ops), name)

        def spy(self, *args, real=real, name=name):
            calls.append(name)
            return real(self, *args)

        monkeypatch.setattr(type(ops), name, spy)
    engine = Engine(EngineConfig(model="tiny", dtype="bfloat16", kv_tokens=512))
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    run_to_completion(engine, [GenerateRequest("r", [5, 6, 7], sp)])
    layers = engine.model.config.num_layers
    passes = 2  # the prefill, one decode step
    assert calls.count("rope") == calls.count("silu_mul") == layers * passes
    assert calls.count("add_rms_norm") == layers * passes
    assert calls.count("rms_norm") == (layers + 1) * passes  # each input norm and the final one
    assert llama.rms_norm(torch.zeros(2, 4), torch.ones(4), 1e-5).dtype == torch.float32


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_greedy_output_with_the_loops_is_eagers(monkeypatch, page_size, dtype):
    """A tiny model decoding with and without the loops: the same tokens, mixed prefill and
    decode batches included."""
    prompts = mixed_prompts(5)
    config = {"model": "tiny", "dtype": dtype, "kv_tokens": 8192, "page_size": page_size}
    with_loops = greedy_tokens(prompts, **config)
    monkeypatch.setattr(fused_ops, "serves", lambda x: None)
    assert greedy_tokens(prompts, **config) == with_loops
