"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) over a paged KV pool.

Differences between the families are flags in `ModelConfig`: `qkv_bias` (Qwen2), `qk_norm`
(Qwen3: RMSNorm over each head of q and k before RoPE), `o_bias`/`mlp_bias` (Llama's
`attention_bias`/`mlp_bias`), tied embeddings, RoPE scaling. q/k/v and gate/up are fused into
one matmul each; `load_weights` maps HF's separate tensors into the fused ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import worker.kernels.fused_ops as fused_ops
from mem_cache.kv_pool import KVPool
from worker.attention.base import AttentionBackend, AttentionBatch
from worker.attention.registry import make_attention
from worker.kernels.linear import linear
from worker.models.config import ModelConfig
from worker.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 like HF, returned in the input dtype."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ops = fused_ops.serves(x) if x.dim() == 2 and x.is_contiguous() else None
    if ops is not None:
        return ops.rms_norm(x, weight, eps)
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer = layer
        self.backend = backend
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias, dtype=cfg.dtype
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias, dtype=cfg.dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype) if cfg.qk_norm else None


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(
            cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias, dtype=cfg.dtype
        )
        self.down_proj = nn.Linear(
            cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, dtype=cfg.dtype
        )


class DecoderLayer(nn.Module):
    """One block. Its dense work is two pure functions of tensors, `pre_attention` and
    `post_attention` (the same code for every layer, so `torch.compile` compiles each once);
    between them the attention backend writes and reads the KV pool."""

    def __init__(self, cfg: ModelConfig, layer: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.self_attn = Attention(cfg, layer, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.mlp = MLP(cfg)

    def forward(
        self, x, rope, batch, kv_pool, kernels: LayerKernels, rows: list[int] | None = None
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; `rope` is the (cos, sin) of the tokens' positions.

        With `rows`, only those rows' outputs are made, in that order ([len(rows), hidden]):
        every token's K/V still goes into the pool, then attention and the MLP run for those
        rows alone (the model's last layer, whose other rows nothing reads)."""
        a, m, c = self.self_attn, self.mlp, self.cfg
        q_norm = a.q_norm.weight if a.q_norm is not None else None
        k_norm = a.k_norm.weight if a.k_norm is not None else None
        q, k, v = kernels.pre(
            x, self.input_layernorm.weight, a.qkv_proj.weight, a.qkv_proj.bias, q_norm, k_norm,
            *rope, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps,
        )  # fmt: skip
        if rows is not None and rows != list(range(x.shape[0])):
            kv_pool.set_kv(a.layer, batch.slot_mapping, k, v)
            if not rows:  # a chunk that samples nothing: its K/V was all it had to leave
                return x[:0]
            index = torch.tensor(rows, dtype=torch.int64, device=x.device)
            x, q, k, v = x[index], q[index], k[index], v[index]
            batch = batch.rows_only(rows)
        out = a.backend.forward(q, k, v, a.layer, batch, kv_pool)
        return kernels.post(
            x, out.reshape(x.shape[0], -1), a.o_proj.weight, a.o_proj.bias,
            self.post_attention_layernorm.weight, m.gate_up_proj.weight, m.gate_up_proj.bias,
            m.down_proj.weight, m.down_proj.bias, c.rms_norm_eps,
        )  # fmt: skip


def pre_attention(
    x: torch.Tensor,
    norm_w: torch.Tensor,
    qkv_w: torch.Tensor,
    qkv_b: torch.Tensor | None,
    q_norm_w: torch.Tensor | None,
    k_norm_w: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input norm, fused q/k/v projection, optional per-head q/k norm, RoPE:
    x [T, hidden] -> q [T, H, D], k and v [T, KVH, D]."""
    qkv = linear(rms_norm(x, norm_w, eps), qkv_w, qkv_b)
    ops = fused_ops.serves(qkv)
    if ops is not None and q_norm_w is None and qkv.is_contiguous() and cos.is_contiguous():
        q, k = ops.rope(qkv, num_heads, num_kv_heads, head_dim, cos, sin)
        v = qkv[:, (num_heads + num_kv_heads) * head_dim :]
        return q, k, v.reshape(-1, num_kv_heads, head_dim)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(-1, num_heads, head_dim)
    k = k.reshape(-1, num_kv_heads, head_dim)
    v = v.reshape(-1, num_kv_heads, head_dim)
    if q_norm_w is not None:
        q, k = rms_norm(q, q_norm_w, eps), rms_norm(k, k_norm_w, eps)
    q, k = RotaryEmbedding.apply(q, k, cos, sin)
    return q, k, v


def post_attention(
    x: torch.Tensor,
    attn: torch.Tensor,
    o_w: torch.Tensor,
    o_b: torch.Tensor | None,
    norm_w: torch.Tensor,
    gate_up_w: torch.Tensor,
    gate_up_b: torch.Tensor | None,
    down_w: torch.Tensor,
    down_b: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """Output projection and residual, post-attention norm, SwiGLU MLP and residual."""
    ops = fused_ops.serves(x)
    if ops is not None and x.is_contiguous():
        x, h = ops.add_rms_norm(x, linear(attn, o_w, o_b), norm_w, eps)
        return x + linear(ops.silu_mul(linear(h, gate_up_w, gate_up_b)), down_w, down_b)
    x = x + linear(attn, o_w, o_b)
    gate, up = linear(rms_norm(x, norm_w, eps), gate_up_w, gate_up_b).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, down_w, down_b)


class LayerKernels(NamedTuple):
    """The two dense functions of a layer: `pre_attention`/`post_attention` or compiled ones."""

    pre: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    post: Callable[..., torch.Tensor]


EAGER = LayerKernels(pre_attention, post_attention)


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm, LM head. Parameter names follow HF's except for
    the fused `qkv_proj` / `gate_up_proj`.

    Build it under `torch.device("meta")` and fill it with `load_weights` (what `load_model`
    does), or build it on a real device for tests.
    """

    def __init__(self, config: ModelConfig, attention: str = "torch") -> None:
        super().__init__()
        self.config = config
        self.backend = make_attention(attention)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=config.dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.backend) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.lm_head = nn.Linear(
            config.hidden_size, config.vocab_size, bias=False, dtype=config.dtype
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope: RotaryEmbedding | None = None
        self.kernels = EAGER  # the engine may swap in compiled ones (worker.compiled)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_pool: KVPool,
        logits_rows: list[int] | torch.Tensor | None,
    ) -> torch.Tensor:
        """input_ids/positions [T] of the new tokens -> float32 logits [S, vocab] of the
        tokens at `logits_rows` (rows of the flattened batch, usually each sequence's last;
        None: every row; an int64 tensor on the device: those rows, chosen after the last
        layer ran for every row, as a CUDA graph that replays with other rows needs).

        Writes every layer's K/V of the new tokens into `kv_pool` at `batch.slot_mapping`. The
        last layer runs attention and the MLP for the logits rows only (a prompt chunk's other
        tokens need only their K/V there): a cold prompt of ~500 tokens skips ~1/30 of its
        linears.
        """
        x = self.embed_tokens(input_ids)
        rope = self._rope(input_ids.device).cos_sin(positions, x.dtype)
        *body, last = self.layers
        for layer in body:
            x = layer(x, rope, batch, kv_pool, self.kernels)
        if isinstance(logits_rows, torch.Tensor):
            x = last(x, rope, batch, kv_pool, self.kernels).index_select(0, logits_rows)
        else:
            x = last(x, rope, batch, kv_pool, self.kernels, logits_rows)
        x = self.norm(x)
        return linear(x, self.lm_head.weight, self.lm_head.bias).to(torch.float32)

    def _rope(self, device: torch.device) -> RotaryEmbedding:
        # Built lazily, outside any meta-device context, on the device the inputs live on.
        if self.rope is None or self.rope.inv_freq.device != device:
            cfg = self.config
            self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)
        return self.rope

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the parameters; ValueError if any parameter stays unset.

        Separate q/k/v and gate/up tensors land in their slice of the fused parameter.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            target = _fused_target(hf_name, self.config)
            if target is None:
                continue
            name, start = target
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name} has no parameter {name}")
            param = params[name]
            rows = tensor.shape[0]
            dest = param.data if start is None else param.data[start : start + rows]
            if dest.shape != tensor.shape:
                raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(name if start is None else f"{name}@{start}")
        self._check_loaded(loaded)

    def parameter_rows(self, hf_name: str) -> tuple[str, int | None] | None:
        """(our parameter name, row offset in it or None) of an HF tensor; None: not ours."""
        return _fused_target(hf_name, self.config)

    def _check_loaded(self, loaded: set[str]) -> None:
        tied = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        if tied and "lm_head.weight" not in loaded:
            self.lm_head.weight = self.embed_tokens.weight
        expected = set()
        for name, _ in self.named_parameters():
            if name in tied:
                continue
            for start in _fused_starts(name, self.config):
                expected.add(name if start is None else f"{name}@{start}")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")


def _fused_target(hf_name: str, cfg: ModelConfig) -> tuple[str, int | None] | None:
    """(our parameter name, row offset in it or None) for one HF tensor name; None to skip."""
    name = hf_name.removeprefix("model.")
    if "rotary_emb" in name:
        return None
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    offsets = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", q),
        "v_proj": ("qkv_proj", q + kv),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", cfg.intermediate_size),
    }
    for part, (fused, start) in offsets.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), start
    return name, None


def _fused_starts(name: str, cfg: ModelConfig) -> list[int | None]:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if ".qkv_proj." in name:
        return [0, q, q + kv]
    if ".gate_up_proj." in name:
        return [0, cfg.intermediate_size]
    return [None]
