"""Linears over a GGUF's quantized blocks (`worker.kernels.quant_gemm`) and where the blocks come
from: blocks read from a GGUF's bytes give the `gguf` package's float32 values bit for bit; the
kernel over them gives `f32_gemm`'s bits over those values (any rows, both vector widths);
`loader.quantized_linears` finds a model's blocks in its GGUF (fused weights, q/k rows in HF
order) and leaves out any that are not its weights; `linear` takes them up to the calibrated
rows on one thread; and an engine on the real SmolLM2 generates the same tokens with them as
without (test_engine_hf_identity and test_gguf_model compare that engine with HF)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from torch import nn

import worker.kernels.calibration as calibration
import worker.kernels.f32_gemm as f32_gemm
import worker.kernels.linear as packed
import worker.kernels.quant_gemm as quant_gemm
from tests.smollm2_env import require_smollm2_dir
from tests.worker.kernel_kit import build_without
from worker.loader.gguf import blocks_from_raw
from worker.loader.weights import load_model, quantized_linears

F32 = f32_gemm.build()
KERNELS = {bits: quant_gemm.build(bits) for bits in (4, 8)}
pytestmark = pytest.mark.skipif(F32 is None, reason="no C compiler here")
TYPES = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}


def gguf_blocks(type_name: str, o: int, k: int, seed: int):
    """(blocks, the gguf package's float32 values) of a random [o, k] weight quantized so."""
    w = np.random.default_rng(seed).standard_normal((o, k)).astype(np.float32)
    qtype = GGMLQuantizationType[type_name]
    raw = quantize(w, qtype)
    return blocks_from_raw(type_name, raw, (o, k)), dequantize(raw, qtype).reshape(o, k)


@pytest.mark.parametrize("type_name", list(TYPES))
def test_blocks_from_gguf_bytes_are_the_gguf_packages_values(type_name):
    blocks, values = gguf_blocks(type_name, 40, 96, seed=1)
    assert blocks.bits == TYPES[type_name] and blocks.shape == (40, 96)
    assert np.array_equal(blocks.dense().numpy(), values)
    raw = quantize(np.ones((4, 64), np.float32), GGMLQuantizationType.F16)
    assert blocks_from_raw("F16", raw, (4, 64)) is None  # other types stay float32


def assert_f32_gemm_bits(kernel, type_name, rows, o, k, bias, seed):
    blocks, values = gguf_blocks(type_name, o, k, seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    b = torch.randn(o, generator=gen) if bias else None
    out = kernel(x, kernel.pack(blocks), b, o)
    expected = F32(x, F32.pack(torch.from_numpy(values)), b, o)
    assert out.shape == (rows, o)
    assert torch.equal(out, expected), f"{type_name} rows={rows} o={o} k={k}"


@pytest.mark.parametrize("type_name", list(TYPES))
def test_the_kernel_gives_f32_gemms_bits_over_the_blocks_values(type_name):
    kernel = KERNELS[TYPES[type_name]]
    for rows in (*range(1, 10), 13, 31, 32):
        assert_f32_gemm_bits(kernel, type_name, rows, 37, 96, rows % 2 == 0, rows)
    for o in (1, 8, 33, 200):
        assert_f32_gemm_bits(kernel, type_name, 3, o, 576, True, o)


@pytest.mark.parametrize("width", [8, 16])
@pytest.mark.parametrize("bits", [4, 8])
def test_either_width_gives_those_bits_too(tmp_path, width, bits):
    """Built at 8 lanes (a CPU without AVX-512) and at 16 (AVX-512's), whichever this core
    builds by default, run here: groups of that many outputs, blocks of 1-8 rows."""
    library = build_without(quant_gemm.SOURCE, f"-DVW={width}", tmp_path, f"-DBITS={bits}")
    kernel = quant_gemm.QuantGemm(library, bits, quant_gemm.MAX_ROWS)
    assert kernel.group == width
    type_name = "Q4_1" if bits == 4 else "Q8_0"
    for rows in (1, 2, 5, 8, 9, 32):
        assert_f32_gemm_bits(kernel, type_name, rows, 50, 160, True, rows)


def test_a_kernel_takes_only_blocks_of_its_bits():
    blocks, _ = gguf_blocks("Q8_0", 8, 32, seed=0)
    with pytest.raises(ValueError, match="8-bit blocks for the 4-bit kernel"):
        KERNELS[4].pack(blocks)


def test_calibration_times_each_row_count_until_the_kernel_loses(monkeypatch):
    # (ours, the float32 path's) seconds at 1, 2 and 4 rows: the kernel loses from 4 rows on
    times = iter([1.0, 2.0, 1.0, 2.0, 3.0, 2.0])
    monkeypatch.setattr(calibration, "median_seconds", lambda fn, repeat: next(times))
    monkeypatch.setattr(quant_gemm, "CALIBRATION_BYTES", 1)  # one weight a side
    monkeypatch.setattr(f32_gemm, "load", lambda: F32)
    assert quant_gemm.calibrate(KERNELS[4]) == 2
    assert next(times, None) is None  # nothing timed past the first loss


def permuted(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of a q or k projection's rows (what `gguf._unpermute` undoes)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture
def tiny_and_gguf(tmp_path):
    """The built-in tiny model with its linears quantized (Q4_1, the LM head Q8_0) into a GGUF
    laid out as llama.cpp's converter lays it out, the model holding the dequantized values."""
    model = load_model("tiny")
    cfg = model.config
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    kv = cfg.num_kv_heads * cfg.head_dim
    rows = {
        "q_proj": cfg.num_heads * cfg.head_dim,
        "k_proj": kv,
        "v_proj": kv,
        "gate_proj": cfg.intermediate_size,
        "up_proj": cfg.intermediate_size,
    }
    params = dict(model.named_parameters())
    gen = np.random.default_rng(0)
    tensors, hf = {}, {}
    for layer in range(cfg.num_layers):
        for hf_part, gguf_part in names.items():
            hf_name = f"model.layers.{layer}.{hf_part}.weight"
            part = hf_part.split(".")[1]
            param = params[model.parameter_rows(hf_name)[0]]
            w = gen.standard_normal((rows.get(part, param.shape[0]), param.shape[1])) * 0.05
            w = w.astype(np.float32)
            heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}.get(part)
            stored = permuted(w, heads) if heads else w
            raw = quantize(stored, GGMLQuantizationType.Q4_1)
            tensors[f"blk.{layer}.{gguf_part}.weight"] = (raw, GGMLQuantizationType.Q4_1)
            values = dequantize(raw, GGMLQuantizationType.Q4_1).reshape(stored.shape)
            hf[hf_name] = torch.from_numpy(permuted_back(values, heads) if heads else values)
    head = gen.standard_normal(tuple(model.lm_head.weight.shape)).astype(np.float32)
    raw = quantize(head, GGMLQuantizationType.Q8_0)
    tensors["output.weight"] = (raw, GGMLQuantizationType.Q8_0)
    hf["lm_head.weight"] = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0)
                                            .reshape(head.shape))  # fmt: skip
    with torch.no_grad():
        for hf_name, value in hf.items():
            target, start = model.parameter_rows(hf_name)
            params[target][start or 0 : (start or 0) + value.shape[0]].copy_(value)
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(path, "llama")
    for name, (raw, qtype) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, path


def permuted_back(w: np.ndarray, heads: int) -> np.ndarray:
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_a_models_blocks_are_found_in_its_gguf(tiny_and_gguf, caplog):
    model, path = tiny_and_gguf
    found = quantized_linears(path, model)
    layers = model.config.num_layers
    expected = {f"layers.{i}.{part}.weight" for i in range(layers)
                for part in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                             "mlp.down_proj")} | {"lm_head.weight"}  # fmt: skip
    params = dict(model.named_parameters())
    assert set(found) == {name for name in expected if name in params} and len(found) > 10
    for name, blocks in found.items():  # fused parts stacked, q/k rows in HF order
        assert torch.equal(blocks.dense(), params[name].detach()), name
        assert blocks.bits == (8 if name == "lm_head.weight" else 4)
    with torch.no_grad():
        params["layers.1.self_attn.o_proj.weight"][0, 0] += 1.0  # no longer the GGUF's
    with caplog.at_level(logging.WARNING):
        again = quantized_linears(path, model)
    assert set(again) == set(found) - {"layers.1.self_attn.o_proj.weight"}
    assert "not its weights" in caplog.text
    broken = path.parent / "broken.gguf"  # a model file cut short: no blocks, the float32 path
    broken.write_bytes(path.read_bytes()[:300])
    with caplog.at_level(logging.WARNING):
        assert quantized_linears(broken, model) == {}
    assert "no GGUF blocks" in caplog.text


def test_linear_takes_the_blocks_up_to_the_rows_calibrated_on_one_thread(monkeypatch):
    blocks, values = gguf_blocks("Q4_1", 48, 64, seed=2)
    layer = nn.Linear(64, 48, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(values))
    monkeypatch.setattr(quant_gemm, "load", lambda bits: KERNELS[bits].up_to(4))
    rows_seen = []
    real_call = quant_gemm.QuantGemm.__call__

    def spy(self, x, *args):
        rows_seen.append(x.reshape(-1, x.shape[-1]).shape[0])
        return real_call(self, x, *args)

    monkeypatch.setattr(quant_gemm.QuantGemm, "__call__", spy)
    packed.pack_linears(layer, {"weight": blocks})
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for rows in (1, 4, 5):
            x = torch.randn(rows, 64)
            out = packed.linear(x, layer.weight, None)
            assert torch.allclose(out, x @ layer.weight.T, atol=1e-5)
        torch.set_num_threads(2)  # oneDNN uses every thread, the kernel one
        packed.linear(torch.randn(2, 64), layer.weight, None)
    finally:
        torch.set_num_threads(threads)
    assert rows_seen == [1, 4]  # 5 rows, and 2 threads, go to the float32 path


@pytest.fixture(scope="module")
def smollm2_engines():
    from worker.engine import Engine, EngineConfig

    path = require_smollm2_dir()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:  # both kernels at every row count they take
        mp.setattr(quant_gemm, "load", lambda bits: quant_gemm.build(bits))
        mp.setattr(f32_gemm, "load", lambda: F32)
        engines = [Engine(EngineConfig(model=str(path), dtype="float32", kv_tokens=2048,
                                       gguf_blocks=on)) for on in (True, False)]  # fmt: skip
        yield engines
    torch.set_num_threads(threads)


def test_smollm2_generates_the_same_with_its_gguf_blocks(smollm2_engines):
    from worker.offline import run_to_completion
    from worker.protocol import GenerateRequest, SamplingParams

    with_blocks, without = smollm2_engines
    entries = [packed._entry(m.weight) for m in with_blocks.model.modules()
               if isinstance(m, nn.Linear)]  # fmt: skip
    assert entries and all(e is not None and e.quantized is not None for e in entries)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (7, 30, 65, 3)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = []
    for engine in smollm2_engines:
        reqs = [GenerateRequest(f"r{i}", p, sp) for i, p in enumerate(prompts)]
        out = run_to_completion(engine, reqs, after_step=lambda e, s: e.check_integrity())
        outs.append([out[r.request_id].token_ids for r in reqs])
    assert outs[0] == outs[1] and all(len(t) == 12 for t in outs[0])
