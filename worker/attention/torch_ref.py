"""The reference backend: each sequence's KV gathered from the pool, then SDPA (CPU and GPU,
always there). The other backends are checked against it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from mem_cache.kv_pool import KVPool
from worker.attention.base import AttentionBackend, AttentionBatch, end_aligned_mask


class TorchAttention(AttentionBackend):
    """Reference backend: gather each sequence's KV from the pool, then SDPA.

    Sequences that decode one token are attended together as one padded batch (a key padding
    mask); every other sequence gets its own call, with `is_causal` when it has no cached
    prefix and an explicit end-aligned mask when it has one.
    """

    name = "torch"

    def forward(self, q, k, v, layer, batch, kv_pool):
        kv_pool.set_kv(layer, batch.slot_mapping, k, v)
        plan = batch.plan.get("torch")
        if plan is None:
            plan = batch.plan["torch"] = _TorchPlan.build(batch, q.device)
        out = torch.empty_like(q)
        if plan.decode_rows is not None:
            out[plan.decode_rows] = _decode(q[plan.decode_rows], layer, kv_pool, plan)
        for start, q_len, slots, mask in plan.prefills:
            q_seq = q[start : start + q_len].transpose(0, 1)  # [H, q_len, D]
            k_seq = _gather(kv_pool.k_buffer[layer], slots, q.dtype).transpose(0, 1)
            v_seq = _gather(kv_pool.v_buffer[layer], slots, q.dtype).transpose(0, 1)
            o = F.scaled_dot_product_attention(
                q_seq,
                k_seq,
                v_seq,
                attn_mask=mask,
                is_causal=mask is None,
                enable_gqa=True,
            )
            out[start : start + q_len] = o.transpose(0, 1)
        return out


@dataclass
class _TorchPlan:
    """Index tensors of one batch for the torch backend, built once per forward pass."""

    decode_rows: torch.Tensor | None  # [B] token rows of the one-token sequences
    decode_slots: torch.Tensor | None  # [B, Kmax] their KV slots, padded with slot 0
    decode_mask: torch.Tensor | None  # [B, 1, 1, Kmax] True where a key is real
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]  # start, q_len, slots, mask

    @staticmethod
    def build(batch: AttentionBatch, device: torch.device) -> _TorchPlan:
        rows, decode_slots, prefills = [], [], []
        start = 0
        for i, (q_len, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens, strict=True)):
            slots = batch.slots(i).to(device)
            if q_len == 1:
                rows.append(start)
                decode_slots.append(slots)
            else:
                mask = end_aligned_mask(q_len, kv_len, device, batch.window)
                prefills.append((start, q_len, slots, mask))
            start += q_len
        if not rows:
            return _TorchPlan(None, None, None, prefills)
        padded = pad_sequence(decode_slots, batch_first=True)  # pads with slot 0
        lens = torch.tensor([s.numel() for s in decode_slots], device=device)
        mask = torch.arange(padded.shape[1], device=device)[None, :] < lens[:, None]
        mask = mask[:, None, None, :]
        rows_t = torch.tensor(rows, dtype=torch.int64, device=device)
        return _TorchPlan(rows_t, padded, mask, prefills)


def _gather(buffer: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """buffer[slots] as `dtype`, shaped slots.shape + buffer.shape[1:].

    index_select on the flattened slots: several times faster on CPU than advanced indexing.
    """
    rows = buffer.index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *buffer.shape[1:]).to(dtype)


def _decode(q: torch.Tensor, layer: int, kv_pool: KVPool, plan: _TorchPlan) -> torch.Tensor:
    """One query per sequence over its padded KV: q [B, H, D] -> [B, H, D]."""
    k = _gather(kv_pool.k_buffer[layer], plan.decode_slots, q.dtype)  # [B, Kmax, KVH, D]
    v = _gather(kv_pool.v_buffer[layer], plan.decode_slots, q.dtype)
    o = F.scaled_dot_product_attention(
        q[:, :, None, :],
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=plan.decode_mask,
        enable_gqa=True,
    )
    return o[:, :, 0, :]
