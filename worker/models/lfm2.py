"""LFM2's decoder: short gated convolutions interleaved with full-attention layers.

As transformers' `Lfm2ForCausalLM`: each layer is either attention (q/k normed per head, RoPE)
or a short convolution block (`ShortConv`: in_proj to B, C, x; a depthwise causal convolution
of kernel `conv_kernel` over B * x; C times its output; out_proj), then a SwiGLU MLP, both
pre-normed with residuals; the final norm is HF's `embedding_norm`.

The attention layers keep their K/V in the engine's pool (`kv_pool.full`, as Llama's layers);
the convolutions keep per-request state: the last `conv_kernel - 1` inputs of every conv layer,
in `kv_pool.conv[slot]` (a `RecurrentKVPool`), the slot of each sequence given by
`batch.states`. A sequence's chunk reads the state after its tokens so far and leaves the one
after its new tokens; a new sequence starts from a zeroed slot (the engine's `KVMemory`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from worker.attention.base import AttentionBatch
from worker.attention.hybrid_pool import RecurrentKVPool
from worker.attention.registry import make_attention
from worker.kernels.linear import linear
from worker.models.config import FULL_ATTENTION, ModelConfig
from worker.models.llama import RMSNorm, rms_norm
from worker.models.rope import RotaryEmbedding


class ShortConv(nn.Module):
    def __init__(self, cfg: ModelConfig, conv_layer: int) -> None:
        super().__init__()
        h, dtype = cfg.hidden_size, cfg.dtype
        self.conv_layer = conv_layer
        self.in_proj = nn.Linear(h, 3 * h, bias=cfg.conv_bias, dtype=dtype)
        self.conv = nn.Conv1d(h, h, cfg.conv_kernel, groups=h, bias=cfg.conv_bias, dtype=dtype)
        self.out_proj = nn.Linear(h, h, bias=cfg.conv_bias, dtype=dtype)

    def forward(self, x: torch.Tensor, batch: AttentionBatch, pool: RecurrentKVPool):
        b, c, u = linear(x, self.in_proj.weight, self.in_proj.bias).chunk(3, dim=-1)
        u = (b * u).transpose(0, 1)  # [hidden, T]
        state = pool.conv[:, self.conv_layer]  # [slots, hidden, kernel - 1]
        keep = state.shape[-1]
        out = torch.empty_like(u)
        start = 0
        for i, q_len in enumerate(batch.q_lens):
            slot = int(batch.states[i])
            ext = torch.cat((state[slot], u[:, start : start + q_len]), dim=-1)
            state[slot] = ext[:, -keep:]
            out[:, start : start + q_len] = F.conv1d(
                ext[None], self.conv.weight, self.conv.bias, groups=ext.shape[0]
            )[0]
            start += q_len
        y = c * out.transpose(0, 1)
        return linear(y.contiguous(), self.out_proj.weight, self.out_proj.bias)


class Lfm2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, kv_layer: int) -> None:
        super().__init__()
        self.kv_layer = kv_layer
        h, d, dtype = cfg.hidden_size, cfg.head_dim, cfg.dtype
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False, dtype=dtype)
        self.out_proj = nn.Linear(cfg.num_heads * d, h, bias=False, dtype=dtype)
        self.q_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.k_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype)


class Lfm2Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: bool, index: int) -> None:
        super().__init__()
        self.cfg = cfg
        if attention:
            self.self_attn = Lfm2Attention(cfg, index)
        else:
            self.conv = ShortConv(cfg, index)
        self.is_attention = attention
        h, eps, dtype = cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype
        self.operator_norm = RMSNorm(h, eps, dtype)
        self.ffn_norm = RMSNorm(h, eps, dtype)
        self.w1 = nn.Linear(h, cfg.intermediate_size, bias=False, dtype=dtype)
        self.w3 = nn.Linear(h, cfg.intermediate_size, bias=False, dtype=dtype)
        self.w2 = nn.Linear(cfg.intermediate_size, h, bias=False, dtype=dtype)

    def forward(self, x, rope, batch: AttentionBatch, pool: RecurrentKVPool, backend):
        c = self.cfg
        h = rms_norm(x, self.operator_norm.weight, c.rms_norm_eps)
        if self.is_attention:
            a = self.self_attn
            q = linear(h, a.q_proj.weight, None).reshape(-1, c.num_heads, c.head_dim)
            k = linear(h, a.k_proj.weight, None).reshape(-1, c.num_kv_heads, c.head_dim)
            v = linear(h, a.v_proj.weight, None).reshape(-1, c.num_kv_heads, c.head_dim)
            q = rms_norm(q, a.q_layernorm.weight, c.rms_norm_eps)
            k = rms_norm(k, a.k_layernorm.weight, c.rms_norm_eps)
            q, k = RotaryEmbedding.apply(q, k, *rope)
            out = backend.forward(q, k, v, a.kv_layer, batch, pool.full)
            h = linear(out.reshape(x.shape[0], -1), a.out_proj.weight, None)
        else:
            h = self.conv(h, batch, pool)
        x = x + h
        h = rms_norm(x, self.ffn_norm.weight, c.rms_norm_eps)
        gate = linear(h, self.w1.weight, None)
        return x + linear(F.silu(gate) * linear(h, self.w3.weight, None), self.w2.weight, None)


class Lfm2LM(nn.Module):
    """`CausalLM`'s interface over a `RecurrentKVPool`, with `batch.states` set."""

    def __init__(self, config: ModelConfig, attention: str = "torch") -> None:
        super().__init__()
        self.config = config
        self.backend = make_attention(attention)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=config.dtype)
        counts = {True: 0, False: 0}
        layers = []
        for kind in config.layer_types:
            is_attention = kind == FULL_ATTENTION
            layers.append(Lfm2Layer(config, is_attention, counts[is_attention]))
            counts[is_attention] += 1
        self.layers = nn.ModuleList(layers)
        self.embedding_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False,
                                 dtype=config.dtype)  # fmt: skip
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope: RotaryEmbedding | None = None

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_pool: RecurrentKVPool,
        logits_rows: list[int] | torch.Tensor | None,
    ) -> torch.Tensor:
        """As `CausalLM.forward`; the conv layers also advance each sequence's state."""
        cfg = self.config
        x = self.embed_tokens(input_ids)
        if self.rope is None or self.rope.inv_freq.device != x.device:
            self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, x.device)
        rope = self.rope.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, batch, kv_pool, self.backend)
        if logits_rows is not None:
            if not isinstance(logits_rows, torch.Tensor):
                logits_rows = torch.tensor(logits_rows, dtype=torch.int64, device=x.device)
            x = x.index_select(0, logits_rows)
        x = self.embedding_norm(x)
        return linear(x, self.lm_head.weight, None).to(torch.float32)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (the names are HF's less `model.`, the feed-forward's
        `feed_forward.` dropped); ValueError if any parameter stays unset."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.").replace("feed_forward.", "")
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name} has no parameter {name}")
            if params[name].shape != tensor.shape:
                raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} mismatch")
            params[name].data.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")

    def parameter_rows(self, hf_name: str) -> tuple[str, int | None] | None:
        return hf_name.removeprefix("model.").replace("feed_forward.", ""), None
