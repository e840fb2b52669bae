"""The model and its KV pool: turns one scheduled batch into one forward pass.

`ModelRunner.forward` flattens the new tokens of every scheduled request into one pass
(`AttentionBatch`, the requests' slots given by their rows of the request-to-slot table), and
returns the logits of the requests whose chunk reaches the end of their
tokens (those sample a next token); requests part-way through a chunked prefill get none.
On a CUDA device a decode-only batch, and one sequence's chunk that samples, replay a CUDA graph
instead (`worker.cuda_graphs`, after `enable_cuda_graphs`).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from mem_cache.kv_pool import KVPool, ReqToTokenPool
from worker.attention.base import AttentionBatch
from worker.cuda_graphs import ChunkGraphs, DecodeGraphs, make_chunk_graphs, make_decode_graphs
from worker.loader import load_model
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
        self.graphs: DecodeGraphs | None = None
        self.chunk_graphs: ChunkGraphs | None = None
        self.rows: ReqToTokenPool | None = None  # `use_rows`

    def bytes_per_slot(self) -> int:
        c = self.config
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * c.dtype.itemsize

    def allocate_kv(self, kv_tokens: int) -> None:
        c = self.config
        self.kv_pool = KVPool(
            kv_tokens, c.num_layers, c.num_kv_heads, c.head_dim, c.dtype, self.device,
            pad_slot=True,  # where decode graphs pad their batches (worker.cuda_graphs)
        )

    def use_rows(self, rows: ReqToTokenPool) -> None:
        """The engine's request-to-slot table, whose rows give each pass its slots."""
        self.rows = rows

    def enable_cuda_graphs(self, max_batch: int, max_chunk: int) -> bool:
        """Capture the decode pass for batches of up to `max_batch`, and one sequence's chunk
        of up to `max_chunk` tokens (after `allocate_kv` and `use_rows`); whether the decode
        pass was (a CUDA device and a backend that can be captured)."""
        table = self.rows.device_table
        self.chunk_graphs = make_chunk_graphs(self.model, self.kv_pool, table, max_chunk)
        self.graphs = make_decode_graphs(self.model, self.kv_pool, table, max_batch)
        return self.graphs is not None

    def default_kv_tokens(self, max_tokens: int) -> int:
        """GPU: 85% of free device memory. CPU: 20% of available RAM. At most `max_tokens`."""
        if self.device.type == "cuda":
            budget = torch.cuda.mem_get_info(self.device)[0] * 0.85
        else:
            budget = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 0.2
        return min(int(budget) // self.bytes_per_slot(), max_tokens)

    def forward(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Request]]:
        """Run `batch`; float32 logits [S, vocab] for the S requests returned (in order)."""
        inputs = self.prepare(batch)
        self.rows.drop_writes(inputs.writes_shipped)
        return self.run(inputs), inputs.sampled

    def run(self, inputs: PassInputs) -> torch.Tensor:
        """The forward pass of prepared inputs: it reads only `inputs`, and writes only the KV
        pool and the device's copy of the slot table, in stream order before the pass."""
        writes = inputs.table_writes
        if writes is not None:
            self.rows.device_table[writes[0], writes[1]] = writes[2]
        if inputs.graph is not None:
            return inputs.graph.run(
                inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.kv_lens,
                inputs.rows,
            )  # fmt: skip
        attn = inputs.attn
        if attn is None:  # the batch's rows of the device's table, now that it is current
            table = self.rows.device_table[:, : max(inputs.kv_lens)].index_select(0, inputs.rows)
            attn = AttentionBatch(inputs.q_lens, inputs.kv_lens, inputs.slot_mapping,
                                  slot_table=table)  # fmt: skip
        return self.model.forward(
            inputs.input_ids, inputs.positions, attn, self.kv_pool, inputs.logits_at
        )

    def prepare(self, batch: ScheduledBatch) -> PassInputs:
        """The inputs of one pass. Per step this costs O(batch) Python ints and a few small
        tensors: the slots come from the requests' rows of the host's slot table (which
        `KVMemory.alloc` extends as requests grow) with one gather, never a tensor per request.
        On a GPU everything the pass needs goes up in one copy: ids, positions, rows, slots,
        and the slot-table entries written since the last pass (`ReqToTokenPool.pending_writes`),
        applied to the device's copy in `run`, which reads the batch's rows from it there. On
        a CPU the batch's rows are copied here."""
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
        q_lens = list(batch.num_new)
        host = self.rows.req_to_token
        rows_t = torch.tensor(rows, dtype=torch.int64)
        positions_t = torch.tensor(positions, dtype=torch.int64)
        if len(ids) == len(rows):  # decode only: one token per request
            token_rows = rows_t
        else:
            token_rows = rows_t.repeat_interleave(torch.tensor(q_lens))
        parts = [torch.tensor(ids, dtype=torch.int64), positions_t, rows_t,
                 host[token_rows, positions_t]]  # fmt: skip
        graph: DecodeGraphs | ChunkGraphs | None = None
        if self.graphs is not None and self.graphs.can_run(len(rows), len(ids)):
            graph = self.graphs
        elif (self.chunk_graphs is not None and len(sampled) == 1
              and self.chunk_graphs.can_run(len(rows), len(ids), kv_lens[0])):  # fmt: skip
            graph = self.chunk_graphs
        mirrored = self.rows.mirrored
        if not mirrored:  # a snapshot of its rows (a device's copy is read in `run`)
            parts.append(host[:, : max(kv_lens)].index_select(0, rows_t))
        shipped, writes = self.rows.pending_writes()
        if writes is not None:
            parts.append(writes)
        if mirrored:  # one upload, then views of it
            sizes = [p.numel() for p in parts]
            flat = torch.cat([p.reshape(-1) for p in parts]).to(self.device)
            parts = [v.view(p.shape) for v, p in zip(flat.split(sizes), parts, strict=True)]
        ids_t, positions_t, rows_t, slot_mapping = parts[:4]
        attn = None
        if not mirrored:
            attn = AttentionBatch(q_lens, kv_lens, slot_mapping, slot_table=parts[4])
        every_row = len(logits_at) == len(ids)
        return PassInputs(
            attn,
            ids_t,
            positions_t,
            None if every_row else logits_at,
            sampled,
            rows_t,
            kv_lens,
            slot_mapping,
            parts[-1] if writes is not None else None,
            shipped,
            q_lens,
            graph,
        )


class PassInputs(NamedTuple):
    # None where a device's copy of the slot table serves the pass (built in `run`)
    attn: AttentionBatch | None
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    logits_at: list[int] | None  # rows whose logits are wanted; None: every row
    sampled: list[Request]  # the requests those rows belong to
    rows: torch.Tensor  # [num_seqs] each sequence's row of the request-to-slot table
    kv_lens: list[int]  # each sequence's KV length after the pass
    slot_mapping: torch.Tensor  # [T] the slot each new token's K/V goes to
    table_writes: torch.Tensor | None  # [3, N] slot-table entries to apply on the device first
    writes_shipped: int  # how many logged table writes those are (`ReqToTokenPool`)
    q_lens: list[int]  # each sequence's new tokens
    graph: DecodeGraphs | ChunkGraphs | None  # the CUDA graphs that replay this pass
