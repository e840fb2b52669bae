"""The model and its KV pool: turns one scheduled batch into one forward pass.

`ModelRunner.forward` flattens the new tokens of every scheduled request into one pass
(`AttentionBatch`), and returns the logits of the requests whose chunk reaches the end of their
tokens (those sample a next token); requests part-way through a chunked prefill get none.
"""

from __future__ import annotations

import os

import torch

from mem_cache.kv_pool import KVPool
from worker.attention import AttentionBatch
from worker.models import load_model
from worker.request import Request
from worker.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(
        self,
        model: str,
        device: torch.device,
        dtype: str | torch.dtype | None,
        attention: str,
    ) -> None:
        self.device = device
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.model = load_model(model, device, dtype, attention)
        self.config = self.model.config
        self.kv_pool: KVPool | None = None

    def bytes_per_slot(self) -> int:
        c = self.config
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * c.dtype.itemsize

    def allocate_kv(self, kv_tokens: int) -> None:
        c = self.config
        self.kv_pool = KVPool(
            kv_tokens, c.num_layers, c.num_kv_heads, c.head_dim, c.dtype, self.device
        )

    def default_kv_tokens(self, max_tokens: int) -> int:
        """GPU: 85% of free device memory. CPU: 20% of available RAM. At most `max_tokens`."""
        if self.device.type == "cuda":
            budget = torch.cuda.mem_get_info(self.device)[0] * 0.85
        else:
            budget = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 0.2
        return min(int(budget) // self.bytes_per_slot(), max_tokens)

    def forward(
        self, batch: ScheduledBatch, req_to_token: torch.Tensor
    ) -> tuple[torch.Tensor, list[Request]]:
        """Run `batch`; float32 logits [S, vocab] for the S requests returned (in order)."""
        ids: list[int] = []
        positions: list[int] = []
        slots, kv_slots, kv_lens, logits_at, sampled = [], [], [], [], []
        for req, n in zip(batch.requests, batch.num_new, strict=True):
            start, end = req.num_computed, req.num_computed + n
            row = req_to_token[req.row]
            ids.extend(req.tokens[start:end])
            positions.extend(range(start, end))
            slots.append(row[start:end])
            kv_slots.append(row[:end])
            kv_lens.append(end)
            if end == len(req.tokens):
                logits_at.append(len(ids) - 1)
                sampled.append(req)
        attn = AttentionBatch(list(batch.num_new), kv_lens, torch.cat(slots), kv_slots)
        dev = self.device
        logits = self.model.forward(
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            attn,
            self.kv_pool,
            torch.tensor(logits_at, dtype=torch.int64, device=dev),
        )
        return logits, sampled
