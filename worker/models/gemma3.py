"""Gemma 3's text decoder over two paged KV pools: full-attention layers and sliding-window ones.

Differences from the Llama family (`llama.py`), each as transformers' `Gemma3ForCausalLM` does it:
embeddings scaled by sqrt(hidden); RMSNorms multiply by `1 + weight` (the loader adds the 1 as
it copies a norm weight in, so `rms_norm` serves both families); q and k normed per head; norms
after attention and after the MLP as well as before; a tanh-GELU gated MLP; queries scaled by
`query_pre_attn_scalar ** -0.5`; optional final logit soft-capping; and two kinds of layers
(`ModelConfig.layer_types`): full attention with RoPE base `rope_theta`, and sliding-window
attention (each query sees its last `sliding_window` keys) with base `rope_local_theta`.

The full layers keep their K/V in `kv_pool.full` at the batch's slots; the sliding layers keep
theirs in `kv_pool.window` (a `HybridKVPool`), at the slots of `batch.sliding`, which lists for
each sequence only the keys its queries can see (the window behind its first new token, then
the new tokens). A sliding layer's chunk whose queries see different windows goes through the
reference `torch` backend, which applies the window as a band mask; decode steps, and chunks
inside the first window, go through the model's backend like full layers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from worker.attention.base import AttentionBackend, AttentionBatch
from worker.attention.hybrid_pool import HybridKVPool
from worker.attention.registry import make_attention
from worker.kernels.linear import linear
from worker.models.config import SLIDING_ATTENTION, ModelConfig
from worker.models.llama import RMSNorm, _fused_starts, _fused_target, pre_attention, rms_norm
from worker.models.rope import RotaryEmbedding

_NORMS = ("norm.weight", "layernorm.weight", "q_norm.weight", "k_norm.weight")


class GemmaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, kv_layer: int, sliding: bool) -> None:
        super().__init__()
        self.layer, self.kv_layer, self.sliding = layer, kv_layer, sliding
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=False,
                                  dtype=cfg.dtype)  # fmt: skip
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False, dtype=cfg.dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype)


class GemmaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False,
                                      dtype=cfg.dtype)  # fmt: skip
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False,
                                   dtype=cfg.dtype)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up_proj.weight, None).chunk(2, dim=-1)
        return linear(F.gelu(gate, approximate="tanh") * up, self.down_proj.weight, None)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, kv_layer: int, sliding: bool) -> None:
        super().__init__()
        self.cfg = cfg
        dim, eps, dtype = cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype
        self.input_layernorm = RMSNorm(dim, eps, dtype)
        self.self_attn = GemmaAttention(cfg, layer, kv_layer, sliding)
        self.post_attention_layernorm = RMSNorm(dim, eps, dtype)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps, dtype)
        self.mlp = GemmaMLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(dim, eps, dtype)
        # scores are q.k / sqrt(head_dim) in every backend: scale q to make them q.k * scalar^-0.5
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        self.q_scale = math.sqrt(cfg.head_dim / scalar)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: AttentionBatch,
        kv_pool: HybridKVPool,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        a, c = self.self_attn, self.cfg
        q, k, v = pre_attention(
            x, self.input_layernorm.weight, a.qkv_proj.weight, None, a.q_norm.weight,
            a.k_norm.weight, *rope, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps,
        )  # fmt: skip
        if self.q_scale != 1.0:
            q = q * self.q_scale
        pool = kv_pool.window if a.sliding else kv_pool.full
        out = backend.forward(q, k, v, a.kv_layer, batch, pool)
        h = linear(out.reshape(x.shape[0], -1), a.o_proj.weight, None)
        x = x + rms_norm(h, self.post_attention_layernorm.weight, c.rms_norm_eps)
        h = self.mlp(rms_norm(x, self.pre_feedforward_layernorm.weight, c.rms_norm_eps))
        return x + rms_norm(h, self.post_feedforward_layernorm.weight, c.rms_norm_eps)


class Gemma3LM(nn.Module):
    """Embeddings, decoder layers, final norm, tied LM head; `CausalLM`'s interface, with a
    `HybridKVPool` for the pool and `batch.sliding` set when the model has sliding layers."""

    def __init__(self, config: ModelConfig, attention: str = "torch") -> None:
        super().__init__()
        self.config = config
        self.backend = make_attention(attention)
        # the band-masked path for sliding chunks (the reference backend's own when it is it)
        self.band_backend = self.backend if attention == "torch" else make_attention("torch")
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=config.dtype)
        counts = {True: 0, False: 0}
        layers = []
        for i, kind in enumerate(config.layer_types):
            sliding = kind == SLIDING_ATTENTION
            layers.append(GemmaDecoderLayer(config, i, counts[sliding], sliding))
            counts[sliding] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False,
                                 dtype=config.dtype)  # fmt: skip
        self.lm_head.weight = self.embed_tokens.weight  # Gemma 3 ties them
        self.ropes: dict[bool, RotaryEmbedding] = {}

    @property
    def num_full_layers(self) -> int:
        return self.config.layer_types.count("full_attention")

    @property
    def num_sliding_layers(self) -> int:
        return self.config.layer_types.count(SLIDING_ATTENTION)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_pool: HybridKVPool,
        logits_rows: list[int] | torch.Tensor | None,
    ) -> torch.Tensor:
        """As `CausalLM.forward`: float32 logits [S, vocab] of the rows `logits_rows` (None:
        every row); every layer's K/V of the new tokens goes into its pool."""
        cfg = self.config
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(cfg.hidden_size**0.5, dtype=x.dtype)
        ropes = {s: self._rope(s, x.device).cos_sin(positions, x.dtype) for s in (False, True)}
        sliding = batch.sliding
        sliding_backend = self.backend
        if sliding is not None and sliding.needs_band():
            sliding_backend = self.band_backend
        for layer in self.layers:
            if layer.self_attn.sliding:
                x = layer(x, ropes[True], sliding, kv_pool, sliding_backend)
            else:
                x = layer(x, ropes[False], batch, kv_pool, self.backend)
        if logits_rows is not None:
            if not isinstance(logits_rows, torch.Tensor):
                logits_rows = torch.tensor(logits_rows, dtype=torch.int64, device=x.device)
            x = x.index_select(0, logits_rows)
        x = self.norm(x)
        logits = linear(x, self.lm_head.weight, None).to(torch.float32)
        cap = cfg.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def _rope(self, sliding: bool, device: torch.device) -> RotaryEmbedding:
        rope = self.ropes.get(sliding)
        if rope is None or rope.inv_freq.device != device:
            cfg = self.config
            theta = cfg.rope_local_theta if sliding else cfg.rope_theta
            scaling = None if sliding else cfg.rope_scaling
            rope = self.ropes[sliding] = RotaryEmbedding(cfg.head_dim, theta, scaling, device)
        return rope

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (norm weights as 1 + w); ValueError if any stays unset."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            target = _fused_target(hf_name, self.config)
            if target is None:
                continue
            name, start = target
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name} has no parameter {name}")
            dest = params[name].data
            if start is not None:
                dest = dest[start : start + tensor.shape[0]]
            if dest.shape != tensor.shape:
                raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != {tuple(dest.shape)}")
            if name.endswith(_NORMS):
                tensor = 1.0 + tensor.to(torch.float32)
            dest.copy_(tensor)
            loaded.add(name if start is None else f"{name}@{start}")
        self.lm_head.weight = self.embed_tokens.weight
        expected = {
            name if start is None else f"{name}@{start}"
            for name, _ in self.named_parameters()
            if name != "lm_head.weight"
            for start in _fused_starts(name, self.config)
        }
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")

    def parameter_rows(self, hf_name: str) -> tuple[str, int | None] | None:
        """(our parameter name, row offset in it or None) of an HF tensor; None: not ours."""
        return _fused_target(hf_name, self.config)
