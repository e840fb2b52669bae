"""The `native` backend: torch ops that read the paged KV pool in place through the slot table.

The engine's default. It gives what the reference `torch` backend gives, with less work:

- Decode: every sequence that decodes one token is attended in one call. Its K/V rows are
  gathered once per layer, straight into head-major order `[B, KVH, Kmax, D]`, into a
  workspace that lives as long as the backend (a fresh multi-MB tensor per layer costs more in
  page faults than the copy itself). The query heads of each KV head's group stand side by
  side as that head's "queries" (`[B, KVH, G, D]`), so one SDPA with a key-length mask covers
  the batch without repeating K/V per query head. The slot table is built once per pass.
- Prefill without a cached prefix attends over its own new K/V (`is_causal`), no gather.
- Prefill over a cached prefix (CPU): the chunk attends to the prefix (gathered, no mask) and
  to itself (causal) in two calls that also return the log-sum-exp of their scores; the two
  partial results are merged exactly by their log-sum-exp. No `[q_len, kv_len]` mask is
  built. Other devices use the end-aligned mask as the reference does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.attention import AttentionBackend, AttentionBatch, end_aligned_mask


class NativeAttention(AttentionBackend):
    name = "native"

    def __init__(self) -> None:
        self._workspace: torch.Tensor | None = None  # [2, n, D]: gathered decode K and V

    def forward(self, q, k, v, layer, batch, kv_pool):
        k_buf, v_buf = kv_pool.k_buffer[layer], kv_pool.v_buffer[layer]
        k_buf.index_copy_(0, batch.slot_mapping, k.to(k_buf.dtype))
        v_buf.index_copy_(0, batch.slot_mapping, v.to(v_buf.dtype))
        plan = batch.plan.get("native")
        if plan is None:
            plan = batch.plan["native"] = _NativePlan.build(batch, kv_pool.num_kv_heads)
        if plan.all_decode:
            return self._decode(q, k_buf, v_buf, plan)
        out = torch.empty_like(q)
        if plan.decode_rows is not None:
            out[plan.decode_rows] = self._decode(q[plan.decode_rows], k_buf, v_buf, plan)
        same_dtype = k_buf.dtype == q.dtype
        for start, q_len, prefix_slots in plan.prefills:
            end = start + q_len
            out[start:end] = _prefill(
                q[start:end], k[start:end], v[start:end], prefix_slots, k_buf, v_buf, same_dtype
            )
        return out

    def _decode(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, plan: _NativePlan
    ) -> torch.Tensor:
        """One query per sequence: q [B, H, D] -> [B, H, D]."""
        b, heads, dim = q.shape
        kv_heads, kmax = plan.num_kv_heads, plan.kmax
        n = plan.head_index.numel()
        ws = self._workspace
        if ws is None or ws.shape[1] < n or ws.dtype != k_buf.dtype or ws.device != q.device:
            ws = self._workspace = torch.empty((2, n, dim), dtype=k_buf.dtype, device=q.device)
        k = torch.index_select(k_buf.view(-1, dim), 0, plan.head_index, out=ws[0, :n])
        v = torch.index_select(v_buf.view(-1, dim), 0, plan.head_index, out=ws[1, :n])
        shape = (b, kv_heads, kmax, dim)
        o = F.scaled_dot_product_attention(
            q.view(b, kv_heads, heads // kv_heads, dim),
            k.view(shape).to(q.dtype),
            v.view(shape).to(q.dtype),
            attn_mask=plan.decode_mask,
        )
        return o.reshape(b, heads, dim)


@dataclass
class _NativePlan:
    """Index tensors of one batch, built once per forward pass and shared by every layer."""

    all_decode: bool  # every sequence decodes one token: the output is the decode output
    decode_rows: torch.Tensor | None  # [B] token rows of the decoding sequences (mixed batch)
    head_index: torch.Tensor | None  # [B * KVH * Kmax] rows of the pool viewed as [size*KVH, D]
    decode_mask: torch.Tensor | None  # [B, 1, 1, Kmax] True where a key is real
    kmax: int
    num_kv_heads: int
    prefills: list[tuple[int, int, torch.Tensor | None]]  # start, q_len, cached-prefix slots

    @staticmethod
    def build(batch: AttentionBatch, num_kv_heads: int) -> _NativePlan:
        device = batch.slot_mapping.device
        decode_seqs, rows, prefills = [], [], []
        start = 0
        for i, (q_len, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens, strict=True)):
            if q_len == 1:
                decode_seqs.append(i)
                rows.append(start)
            else:
                prefix = kv_len - q_len
                prefills.append((start, q_len, batch.slots(i)[:prefix] if prefix else None))
            start += q_len
        if not decode_seqs:
            return _NativePlan(False, None, None, None, 0, num_kv_heads, prefills)
        kv_lens = [batch.kv_lens[i] for i in decode_seqs]
        kmax = max(kv_lens)
        table = batch.padded_slots(decode_seqs, kmax)  # [B, Kmax], padding: any valid slot
        heads = torch.arange(num_kv_heads, device=device)
        head_index = (table[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)
        lens = torch.tensor(kv_lens, device=device)
        mask = (torch.arange(kmax, device=device)[None, :] < lens[:, None])[:, None, None, :]
        all_decode = not prefills
        decode_rows = None if all_decode else torch.tensor(rows, device=device)
        return _NativePlan(all_decode, decode_rows, head_index, mask, kmax, num_kv_heads, prefills)


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_slots: torch.Tensor | None,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    same_dtype: bool,
) -> torch.Tensor:
    """One chunk's attention: q [q_len, H, D], its new k/v [q_len, KVH, D], over its cached
    prefix (slots, or None) and itself, causal and aligned to the end -> [q_len, H, D]."""
    q_len = q.shape[0]
    qh = q.transpose(0, 1)[None]  # [1, H, q_len, D]
    if not same_dtype:  # attend over the pool's rounding of the new K/V, as the reference does
        k, v = k.to(k_buf.dtype).to(q.dtype), v.to(v_buf.dtype).to(q.dtype)
    kh, vh = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if prefix_slots is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        return o[0].transpose(0, 1)
    kp = k_buf.index_select(0, prefix_slots).to(q.dtype).transpose(0, 1)[None]
    vp = v_buf.index_select(0, prefix_slots).to(q.dtype).transpose(0, 1)[None]
    if q.device.type != "cpu":
        kv_len = prefix_slots.numel() + q_len
        mask = end_aligned_mask(q_len, kv_len, q.device)
        k_all, v_all = torch.cat((kp, kh), dim=2), torch.cat((vp, vh), dim=2)
        o = F.scaled_dot_product_attention(qh, k_all, v_all, attn_mask=mask, enable_gqa=True)
        return o[0].transpose(0, 1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o_prefix, lse_prefix = flash(qh, kp, vp, 0.0, False)  # every prefix key is visible
    o_self, lse_self = flash(qh, kh, vh, 0.0, True)  # q_len == its own keys: plain causal
    top = torch.maximum(lse_prefix, lse_self)
    w_prefix = (lse_prefix - top).exp()[..., None]
    w_self = (lse_self - top).exp()[..., None]
    o = (o_prefix.float() * w_prefix + o_self.float() * w_self) / (w_prefix + w_self)
    return o[0].transpose(0, 1).to(q.dtype)
