"""`ModelConfig`: what the decoder needs from an HF `config.json`, normalised.

Reads both the transformers-4 keys (`torch_dtype`, `rope_theta` + `rope_scaling`) and the
transformers-5 ones (`dtype`, `rope_parameters`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Lfm2ForCausalLM": "lfm2",
}
_MODEL_TYPES = {"gemma3_text": "gemma3", "gemma3": "gemma3", "lfm2": "lfm2"}

# `ModelConfig.layer_types` entries: a layer attends over the whole context, or over the last
# `sliding_window` keys only (Gemma 3's local layers)
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
CONV = "conv"  # LFM2's short-convolution layers, which keep a recurrent state per request

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass
class ModelConfig:
    """A Llama-family decoder's shape. Defaults are Llama's.

    `rope_scaling` is None for plain RoPE, else a dict with `rope_type` ("linear", "llama3",
    "yarn") and that type's parameters ("dynamic" NTK becomes plain RoPE up to its original
    length, where the two agree). `max_context` is the longest sequence the
    model serves exactly: `max_position_embeddings`, capped at `sliding_window` when the model
    uses one in every layer (Mistral: this decoder attends over the full context there, so
    longer would differ from HF).

    Gemma 3 (`model_type` "gemma3") interleaves layers: `layer_types[i]` is `FULL_ATTENTION` or
    `SLIDING_ATTENTION` (each query sees its last `sliding_window` keys, itself included); the
    sliding layers take RoPE base `rope_local_theta`, queries are scaled by
    `query_pre_attn_scalar ** -0.5`, and logits are soft-capped at `final_logit_softcapping`
    when set. LFM2 (`model_type` "lfm2") has `CONV` layers (`recurrent_layers`): a depthwise
    causal convolution of kernel `conv_kernel` over a gated input, whose state per request is
    its last `conv_kernel - 1` inputs. Llama-family models leave `layer_types` empty (every
    layer full).
    """

    name: str
    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_context: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    dtype: torch.dtype = torch.float32
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    conv_kernel: int = 0
    conv_bias: bool = False

    @property
    def sliding_layers(self) -> list[int]:
        """Indices of the layers that attend over a sliding window (none for Llama-family)."""
        return [i for i, t in enumerate(self.layer_types) if t == SLIDING_ATTENTION]

    @property
    def recurrent_layers(self) -> list[int]:
        """Indices of the layers that keep a recurrent state (LFM2's convolutions)."""
        return [i for i, t in enumerate(self.layer_types) if t == CONV]

    @classmethod
    def from_dir(cls, path: str | Path, name: str | None = None) -> ModelConfig:
        """Read `config.json` (and `generation_config.json` for extra EOS ids) of an HF dir."""
        path = Path(path)
        hf = json.loads((path / "config.json").read_text())
        gen_path = path / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        return cls.from_hf(hf, name or hf.get("radixray_name") or path.name, gen)

    @classmethod
    def from_hf(
        cls, hf: dict[str, Any], name: str, gen: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Normalise an HF config dict; ValueError for an architecture this decoder lacks."""
        model_type = _model_type(hf)
        if model_type == "lfm2":
            return _lfm2(hf, name, gen or {})
        num_heads = hf["num_attention_heads"]
        theta, scaling = _rope(hf)
        max_context = hf.get("max_position_embeddings", 4096)
        window = _sliding_window(hf, model_type)
        if window and model_type != "gemma3":
            max_context = min(max_context, window)
        if scaling is not None and scaling["rope_type"] == "dynamic":
            # Dynamic NTK equals plain RoPE up to the original length; beyond it the
            # frequencies would depend on the longest sequence so far, which a shared KV cache
            # cannot honour. So: plain RoPE, served up to the original length.
            max_context = min(max_context, int(scaling["original_max_position_embeddings"]))
            scaling = None
        return cls(
            name=name,
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_context=max_context,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "gemma3"),
            eos_token_ids=_eos_ids(hf, gen or {}),
            bos_token_id=hf.get("bos_token_id"),
            dtype=_dtype(hf.get("dtype") or hf.get("torch_dtype")),
            **(_gemma3(hf, window) if model_type == "gemma3" else {}),
        )


def _model_type(hf: dict[str, Any]) -> str:
    for arch in hf.get("architectures") or []:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    if hf.get("model_type") in SUPPORTED_ARCHITECTURES.values():
        return hf["model_type"]
    if hf.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[hf["model_type"]]
    raise ValueError(
        f"unsupported model: architectures={hf.get('architectures')} "
        f"model_type={hf.get('model_type')}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
    )


def _lfm2(hf: dict[str, Any], name: str, gen: dict[str, Any]) -> ModelConfig:
    """LFM2's config: its own key names, and its feed-forward width rule."""
    n, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    types = hf.get("layer_types") or [
        FULL_ATTENTION if i in (hf.get("full_attn_idxs") or range(n)) else CONV for i in range(n)
    ]
    inter = hf.get("block_ff_dim", hf["intermediate_size"])
    if hf.get("block_auto_adjust_ff_dim", True):
        inter = int(2 * inter / 3)
        multiplier = hf.get("block_ffn_dim_multiplier", 1.0)
        multiple = hf.get("block_multiple_of", 256)
        if multiplier is not None:
            inter = multiple * ((int(multiplier * inter) + multiple - 1) // multiple)
    theta, scaling = _rope(hf)
    tied = hf.get("tie_embedding", hf.get("tie_word_embeddings", True))
    return ModelConfig(
        name=name,
        model_type="lfm2",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=inter,
        num_layers=n,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("norm_eps", 1e-5),
        rope_theta=theta,
        rope_scaling=scaling,
        max_context=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(tied),
        qk_norm=True,
        eos_token_ids=_eos_ids(hf, gen),
        bos_token_id=hf.get("bos_token_id"),
        dtype=_dtype(hf.get("dtype") or hf.get("torch_dtype")),
        layer_types=list(types),
        conv_kernel=int(hf.get("conv_L_cache", 3)),
        conv_bias=bool(hf.get("conv_bias", False)),
    )


def _gemma3(hf: dict[str, Any], window: int | None) -> dict[str, Any]:
    """Gemma 3's fields of `ModelConfig` (its class docstring)."""
    if hf.get("attn_logit_softcapping") is not None:
        raise ValueError("attention logit soft-capping is not supported")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("bidirectional attention is not supported")
    num_layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if not types:
        pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
        types = [FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION
                 for i in range(num_layers)]  # fmt: skip
    if len(types) != num_layers or set(types) - {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise ValueError(f"bad layer_types {types!r}")
    local = (hf.get("rope_parameters") or {}).get(SLIDING_ATTENTION) or {}
    local_theta = local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))
    return {
        "layer_types": list(types),
        "sliding_window": window,
        "rope_local_theta": float(local_theta),
        "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar") or hf["head_dim"]),
        "final_logit_softcapping": hf.get("final_logit_softcapping"),
    }


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling`;
    per-layer-type parameters (Gemma 3) give the full-attention layers' here."""
    params = dict(hf.get("rope_parameters") or {})
    if FULL_ATTENTION in params:
        params = dict(params[FULL_ATTENTION])
    legacy = dict(hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = {**legacy, **params}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling {rope_type!r}; supported: {ROPE_TYPES}")
    scaling["rope_type"] = rope_type
    scaling.pop("type", None)
    if rope_type in ("llama3", "yarn", "dynamic"):
        scaling.setdefault(
            "original_max_position_embeddings", hf.get("max_position_embeddings", 4096)
        )
    return theta, scaling


def _sliding_window(hf: dict[str, Any], model_type: str) -> int | None:
    window = hf.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
        return None
    return int(window) if window else None


def _eos_ids(hf: dict[str, Any], gen: dict[str, Any]) -> list[int]:
    ids: list[int] = []
    for source in (hf.get("eos_token_id"), gen.get("eos_token_id")):
        for tok in source if isinstance(source, list) else [source]:
            if tok is not None and tok not in ids:
                ids.append(int(tok))
    return ids


def _dtype(value: str | None) -> torch.dtype:
    if value is None:
        return torch.float32
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {value!r}")
    return _DTYPES[name]
