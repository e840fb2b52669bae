"""Turn a Llama-family GGUF file (llama.cpp's format) into an HF model directory.

The weights are dequantized with the `gguf` package's numpy dequantizers and written as float32
safetensors under their HF names; the loader casts them to the dtype the engine asks for. The
config, the tokenizer and its chat template come from the GGUF metadata through transformers'
own GGUF readers (`AutoConfig` / `AutoTokenizer` with `gguf_file=`), so they are exactly what
HF transformers makes of the same file. No HF model is built on the way: the tensors go from
the GGUF straight to safetensors.

llama.cpp stores the q and k projections of `llama` models with the rows of each head
interleaved for its rotary kernel; `_unpermute` puts them back in HF's order.

`quantized_tensors` reads the linears' blocks as the file stores them (Q4_0, Q4_1, Q8_0:
`Blocks`), for the kernel that computes from them (`worker.kernels.quant_gemm`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from worker.kernels.blocks import BLOCK, Blocks
from worker.loader.gguf_transformers import ARCHITECTURES as OTHER_ARCHITECTURES
from worker.loader.gguf_transformers import convert_with_transformers
from worker.loader.shards import save_shards

ARCHITECTURES = ("llama",)  # Llama 2/3, Mistral and SmolLM GGUFs all say "llama"

# GGUF tensor name inside block N -> HF name inside `model.layers.N.`
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def convert_gguf(gguf_file: str | Path, dest: str | Path) -> None:
    """Write the HF directory of `gguf_file` into the existing folder `dest`.

    ValueError for a GGUF of an architecture other than `ARCHITECTURES`.
    """
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig  # heavy: here only

    gguf_file, dest = Path(gguf_file), Path(dest)
    reader = GGUFReader(gguf_file)
    arch = reader.fields["general.architecture"].contents()
    if arch in OTHER_ARCHITECTURES:
        convert_with_transformers(gguf_file, arch, dest)
        return
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{gguf_file.name}: GGUF architecture {arch!r} is not supported (supported: "
            f"{', '.join([*ARCHITECTURES, *OTHER_ARCHITECTURES])}); use an HF model directory "
            "instead"
        )
    with tempfile.TemporaryDirectory(prefix="radixray-gguf-") as alone:
        # transformers reads the folder too: tokenizer files beside the GGUF would override its
        # metadata (and drop its chat template), so it sees the GGUF alone.
        os.symlink(gguf_file.resolve(), Path(alone) / gguf_file.name)
        config = AutoConfig.from_pretrained(alone, gguf_file=gguf_file.name)
        tokenizer = AutoTokenizer.from_pretrained(alone, gguf_file=gguf_file.name)
    config.dtype = torch.float32
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(dest)
    GenerationConfig.from_model_config(config).save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    tensors = hf_tensors(reader, config.num_attention_heads, config.num_key_value_heads)
    save_shards(tensors, dest)


def hf_tensors(
    reader: GGUFReader, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor of a `llama` GGUF, q/k rows in HF order."""
    for t in reader.tensors:
        array = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        name = _hf_name(t.name)
        if name.endswith("q_proj.weight"):
            array = _unpermute(array, num_heads)
        elif name.endswith("k_proj.weight"):
            array = _unpermute(array, num_kv_heads)
        yield name, torch.from_numpy(np.array(array, dtype=np.float32, order="C"))  # a copy


def quantized_tensors(
    gguf_file: str | Path, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, Blocks]]:
    """(HF name, blocks) for every 2-d tensor of a `llama` GGUF stored as Q4_0, Q4_1 or Q8_0,
    q/k rows in HF order (`hf_tensors`' tensors are these blocks' `dense()`). ValueError for a
    file the `gguf` package cannot read (not a GGUF, or one cut short)."""
    try:
        reader = GGUFReader(gguf_file)
    except (IndexError, ValueError) as e:  # a cut file fails on an index, or on a reshape
        raise ValueError(f"{gguf_file}: not a GGUF file that can be read ({e})") from e
    for t in reader.tensors:
        if len(t.shape) != 2:
            continue
        blocks = blocks_from_raw(t.tensor_type.name, t.data, (int(t.shape[1]), int(t.shape[0])))
        if blocks is None:
            continue
        name = _hf_name(t.name)
        rows = np.arange(blocks.shape[0])
        if name.endswith("q_proj.weight"):
            blocks = blocks.rows(_unpermute(rows, num_heads))
        elif name.endswith("k_proj.weight"):
            blocks = blocks.rows(_unpermute(rows, num_kv_heads))
        yield name, blocks


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in a llama GGUF")


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of a q or k projection (rows = heads x dim)."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def blocks_from_raw(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> Blocks | None:
    """The blocks of a GGUF tensor of type `type_name` ("Q4_0", "Q4_1", "Q8_0"; None for any
    other) from its raw bytes, as a weight of `shape` [O, K]."""
    o, k = shape
    layouts = {"Q4_0": (18, 0), "Q4_1": (20, 2), "Q8_0": (34, 0)}  # block bytes, m's bytes
    if type_name not in layouts or k % BLOCK:
        return None
    size, m_bytes = layouts[type_name]
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(o, k // BLOCK, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    quants = blocks[..., 2 + m_bytes :]
    if type_name == "Q8_0":
        return Blocks(8, quants.copy().view(np.int8).reshape(o, k), d, None)
    q = np.concatenate([quants & 15, quants >> 4], axis=-1).reshape(o, k)  # low nibbles first
    if type_name == "Q4_0":  # d * (q - 8) = fma(q, d, -8d): -8d and the sum are exact
        return Blocks(4, q, d, -8.0 * d)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return Blocks(4, q, d, m)
