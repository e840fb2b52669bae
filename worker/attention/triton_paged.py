"""A Triton paged-attention kernel (prefill, chunked prefill and decode in one launch).

Imported only by `make_attention("triton")`: it needs the `triton` package and a CUDA device
(ImportError otherwise). One program handles one sequence, one KV head and a block of
`BLOCK_M` (query, head) rows, the query heads of that KV head's group packed side by side so a
decode step loads each K/V row once per group. It walks the sequence's KV slots `BLOCK_N` at a
time, reading them from its row of a slot table (the engine's request-to-slot table itself, or
the rows a batch selected from it) and gathering K and V rows straight from the pool by slot
id (page size 1 in the kernel's eyes, so any radix-cache page size works), with an online
softmax. Every length and row is read on the device, so a decode batch's launches can be
captured once into a CUDA graph and replayed with new contents (`graph_plan`,
`worker.cuda_graphs`). The causal mask is aligned
to the end: query `i` of a sequence with `q_len` new tokens and `kv_len` in all sits at
position `kv_len - q_len + i`.
GPU-only: tested against the torch backend in tests/worker/test_attention_gpu.py.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mem_cache.kv_pool import KVPool
from worker.attention.base import AttentionBackend, AttentionBatch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    # TRITON_INTERPRET=1 runs the kernel in Triton's CPU interpreter: how CI without a GPU
    # checks the kernel's logic (slowly).
    raise ImportError("the triton attention backend needs a CUDA device")


# The slot table's row stride is the full table's in a captured pass and the batch's longest
# sequence in an eager one: not specialized on, so both run one build of the kernel (an eager
# prompt after graphs-only traffic would otherwise wait for a fresh build).
@triton.jit(do_not_specialize=["table_stride"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,
    q_indptr, kv_lens, table_rows, table, table_stride,
    sm_scale,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    seq, kv_head, m_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(q_indptr + seq)
    q_len = tl.load(q_indptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len * GROUP:
        return
    kv_len = tl.load(kv_lens + seq)
    slot_row = table + tl.load(table_rows + seq).to(tl.int64) * table_stride

    # Row r of the block is (query (m_block*BLOCK_M + r) // GROUP, head r % GROUP of this KV
    # head's group): the group's heads share every K/V load.
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    query, head = rows // GROUP, kv_head * GROUP + rows % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    m_mask, d_mask = query < q_len, offs_d < HEAD_DIM
    q_offs = (q_start + query)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = kv_len - q_len + query  # absolute positions of the queries

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    last_query = (m_block * BLOCK_M + BLOCK_M - 1) // GROUP
    kv_end = tl.minimum(kv_len, kv_len - q_len + last_query + 1)  # causal bound
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_len
        slots = tl.load(slot_row + offs_n, mask=n_mask, other=0)
        k_offs = slots[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None]
        k = tl.load(k_ptr + k_offs, mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        qk = tl.dot(q, k.to(q.dtype)) * sm_scale  # [BLOCK_M, BLOCK_N]
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp(qk - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_offs = slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :]
        v = tl.load(v_ptr + v_offs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new
    acc = acc / l_i[:, None]
    o_offs = (q_start + query)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    o_mask = m_mask[:, None] & d_mask[None, :]
    tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


class TritonPlan(NamedTuple):
    """The kernel's index tensors of one batch, on the device: query offsets (int32
    [num_seqs + 1]), KV lengths (int32 [num_seqs]), each sequence's row (int32 [num_seqs]) of
    the slot `table` (int64 [rows, W]), and the longest query."""

    q_indptr: torch.Tensor
    kv_lens: torch.Tensor
    rows: torch.Tensor
    table: torch.Tensor
    max_q_len: int


class TritonAttention(AttentionBackend):
    """Paged attention in one Triton launch per layer; index tensors built once per batch."""

    name = "triton"

    def __init__(self, block_m: int = 32, block_n: int = 64) -> None:
        self.block_m, self.block_n = block_m, block_n

    def graph_plan(self, q_indptr, kv_lens, rows, table, max_q_len: int) -> TritonPlan:
        """A captured pass's plan over tensors the caller keeps and refills, its launch grid
        sized for `max_q_len` queries a sequence (1 for a decode batch)."""
        return TritonPlan(q_indptr, kv_lens, rows, table, max_q_len)

    def forward(self, q, k, v, layer, batch, kv_pool: KVPool):
        kv_pool.set_kv(layer, batch.slot_mapping, k, v)
        plan = batch.plan.get("triton")
        if plan is None:
            plan = batch.plan["triton"] = _plan(batch, q.device)
        num_heads, head_dim = q.shape[1], q.shape[2]
        k_buf, v_buf = kv_pool.k_buffer[layer], kv_pool.v_buffer[layer]
        q = q.contiguous()
        out = torch.empty_like(q)
        kv_heads = k_buf.shape[1]
        group = num_heads // kv_heads
        num_seqs = plan.kv_lens.shape[0]
        grid = (num_seqs, kv_heads, triton.cdiv(plan.max_q_len * group, self.block_m))
        _paged_attention_kernel[grid](
            q, k_buf, v_buf, out,
            plan.q_indptr, plan.kv_lens, plan.rows, plan.table, plan.table.stride(0),
            head_dim**-0.5,
            q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
            v_buf.stride(0), v_buf.stride(1), out.stride(0), out.stride(1),
            GROUP=group, HEAD_DIM=head_dim,
            BLOCK_M=self.block_m, BLOCK_N=self.block_n,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        )  # fmt: skip
        return out


def _plan(batch: AttentionBatch, device: torch.device) -> TritonPlan:
    """The plan of one batch: its slot table (or its slot lists, padded into one) on `device`."""
    q_indptr = torch.zeros(len(batch.q_lens) + 1, dtype=torch.int32)
    q_indptr[1:] = torch.tensor(batch.q_lens).cumsum(0)
    kv_lens = torch.tensor(batch.kv_lens, dtype=torch.int32)
    n = len(batch.kv_lens)
    table = batch.slot_table
    if table is None:
        table = batch.padded_slots(list(range(n)), max(batch.kv_lens))
    rows = torch.arange(n, dtype=torch.int32)
    return TritonPlan(
        q_indptr.to(device),
        kv_lens.to(device),
        rows.to(device),
        table.to(device=device, dtype=torch.int64).contiguous(),
        max(batch.q_lens),
    )
