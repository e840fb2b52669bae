"""The flashinfer backend: batch prefill/append attention over the pool as pages of one slot.

Imported only by `make_attention("flashinfer")` (ImportError without flashinfer or CUDA).
The pool's `[size, KVH, D]` buffers are viewed as flashinfer's NHD paged cache
`[size, 1, KVH, D]` (page size 1), so each sequence's KV slots are its page indices. With
`causal=True` flashinfer aligns the mask to the end when a sequence has fewer queries than
keys, which is the contract of `AttentionBackend`. GPU-only: tested against the torch backend
in tests/worker/test_attention_gpu.py.
"""

from __future__ import annotations

import flashinfer
import torch

from mem_cache.kv_pool import KVPool
from worker.attention.base import AttentionBackend, AttentionBatch

if not torch.cuda.is_available():
    raise ImportError("the flashinfer attention backend needs a CUDA device")

WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferAttention(AttentionBackend):
    """One flashinfer prefill wrapper, planned once per batch and run once per layer."""

    name = "flashinfer"

    def __init__(self) -> None:
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._planned_for: AttentionBatch | None = None

    def forward(self, q, k, v, layer, batch, kv_pool: KVPool):
        kv_pool.set_kv(layer, batch.slot_mapping, k, v)
        if self._planned_for is not batch:  # the wrapper holds one plan: the current batch's
            self._plan(batch, q, kv_pool)
            self._planned_for = batch
        k_cache = kv_pool.k_buffer[layer].unsqueeze(1)
        v_cache = kv_pool.v_buffer[layer].unsqueeze(1)
        return self.wrapper.run(q.contiguous(), (k_cache, v_cache))

    def _plan(self, batch: AttentionBatch, q: torch.Tensor, kv_pool: KVPool) -> None:
        device = q.device
        qo_indptr = torch.zeros(len(batch.q_lens) + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.tensor(batch.q_lens).cumsum(0)
        kv_indptr = torch.zeros(len(batch.kv_lens) + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.tensor(batch.kv_lens).cumsum(0)
        kv_indices = torch.cat(batch.all_slots()).to(device=device, dtype=torch.int32)
        last_page_len = torch.ones(len(batch.q_lens), dtype=torch.int32, device=device)
        self.wrapper.plan(
            qo_indptr.to(device),
            kv_indptr.to(device),
            kv_indices,
            last_page_len,
            q.shape[1],  # query heads
            kv_pool.num_kv_heads,
            q.shape[2],  # head dim
            1,  # page size
            causal=True,
            q_data_type=q.dtype,
            kv_data_type=kv_pool.dtype,
        )
