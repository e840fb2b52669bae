"""Linears with oneDNN-packed weights give F.linear's bits (without a bias), and the engine's
greedy output does not change with them."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from worker.engine import Engine, EngineConfig
from worker.models.packed import can_pack, linear, pack_linears
from worker.offline import run_to_completion
from worker.protocol import GenerateRequest, SamplingParams

pytestmark = pytest.mark.skipif(
    not can_pack(torch.empty(1, dtype=torch.bfloat16)), reason="no oneDNN bf16 linear here"
)


@pytest.mark.parametrize("rows", [1, 5, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_gives_f_linear_bits(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    layer = nn.Linear(96, 200, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(200, 96, generator=gen))
    assert pack_linears(layer) == 1 and layer.packed.is_mkldnn
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
    out, ref = linear(x, layer.packed, layer.bias), F.linear(x, layer.weight, layer.bias)
    if bias:  # the bias may be added in another order: a rounding step apart at most
        torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(out, ref)


def test_float32_weights_stay_unpacked():
    layer = nn.Linear(8, 8)
    assert pack_linears(layer) == 0 and not hasattr(layer, "packed")


def test_engine_greedy_output_is_the_same_with_packed_weights():
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 40, 17)]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = []
    for pack in (False, True):
        engine = Engine(
            EngineConfig(model="tiny", dtype="bfloat16", kv_tokens=1024, pack_weights=pack)
        )
        assert any(hasattr(m, "packed") for m in engine.model.modules()) == pack
        reqs = [GenerateRequest(f"p{i}", p, sp) for i, p in enumerate(prompts)]
        out = run_to_completion(engine, reqs, after_step=lambda e, s: e.check_integrity())
        outs.append([out[r.request_id].token_ids for r in reqs])
    assert outs[0] == outs[1]
