"""The model and its KV pool: turns one scheduled batch into one forward pass.

`ModelRunner.forward` flattens the new tokens of every scheduled request into one pass
(`AttentionBatch`, the requests' slots given by their rows of the request-to-slot table), and
returns the logits of the requests whose chunk reaches the end of their
tokens (those sample a next token); requests part-way through a chunked prefill get none.
"""

from __future__ import annotations

import os
from typing import NamedTuple

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
        inputs = self.prepare(batch, req_to_token)
        return self.run(inputs), inputs.sampled

    def run(self, inputs: PassInputs) -> torch.Tensor:
        """The forward pass of prepared inputs (the part an overlapping engine runs in its
        forward thread: it reads only `inputs` and writes only the KV pool)."""
        return self.model.forward(
            inputs.input_ids, inputs.positions, inputs.attn, self.kv_pool, inputs.logits_at
        )

    @staticmethod
    def resolve(inputs: PassInputs, sampled_ids: torch.Tensor) -> None:
        """Replace the placeholders of a batch prepared before the previous step's tokens were
        known: id `-1 - i` stands for `sampled_ids[i]` (`Engine` overlap mode)."""
        ids = inputs.input_ids
        pending = ids < 0
        if bool(pending.any()):
            ids[pending] = sampled_ids.to(ids.device)[-1 - ids[pending]]

    def prepare(self, batch: ScheduledBatch, req_to_token: torch.Tensor) -> PassInputs:
        """The inputs of one pass. Per step this costs O(batch) Python ints and a few small
        tensors: the slots come from the requests' rows of `req_to_token` (the block table,
        which `KVMemory.alloc` extends as requests grow) with one gather, never a tensor per
        request. A token id < 0 is a placeholder for a token still being sampled (`resolve`)."""
        ids: list[int] = []
        positions: list[int] = []
        rows, kv_lens, logits_at, sampled = [], [], [], []
        for req, n in zip(batch.requests, batch.num_new, strict=True):
            start, end = req.num_computed, req.num_computed + n
            ids.extend(req.tokens[start:end])
            positions.extend(range(start, end))
            rows.append(req.row)
            kv_lens.append(end)
            if end == len(req.tokens):
                logits_at.append(len(ids) - 1)
                sampled.append(req)
        dev = self.device
        q_lens = list(batch.num_new)
        rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
        positions_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        if len(ids) == len(rows):  # decode only: one token per request
            token_rows = rows_t
        else:
            token_rows = rows_t.repeat_interleave(torch.tensor(q_lens, device=dev))
        slot_mapping = req_to_token[token_rows, positions_t]
        table = req_to_token[:, : max(kv_lens)].index_select(0, rows_t)
        attn = AttentionBatch(q_lens, kv_lens, slot_mapping, slot_table=table)
        every_row = len(logits_at) == len(ids)
        return PassInputs(
            attn,
            torch.tensor(ids, dtype=torch.int64, device=dev),
            positions_t,
            None if every_row else logits_at,
            sampled,
        )


class PassInputs(NamedTuple):
    attn: AttentionBatch
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    logits_at: list[int] | None  # rows whose logits are wanted; None: every row
    sampled: list[Request]  # the requests those rows belong to
