"""The model and its KV pool: turns one scheduled batch into one forward pass.

`ModelRunner.forward` flattens the new tokens of every scheduled request into one pass
(`AttentionBatch`, the requests' slots given by their rows of the request-to-slot table), and
returns the logits of the requests whose chunk reaches the end of their
tokens (those sample a next token); requests part-way through a chunked prefill get none.
On a CUDA device a decode-only batch, and one sequence's chunk that samples, replay a CUDA graph
instead (`worker.cuda_graphs`, after `enable_cuda_graphs`).

A model with sliding-window layers (Gemma 3) gets two pools (`HybridKVPool`): the full layers'
at the engine's slots, and the window layers' (`WindowKV`), whose batch (`AttentionBatch.sliding`)
lists each sequence's window slots from the first key its queries see. A model with recurrent
layers (LFM2) gets `RecurrentKVPool`: the attention layers' pool and the state slots
(`StateSlots`), each sequence's given by `AttentionBatch.states`. Hybrid models run eagerly (no
CUDA graphs yet: their passes need the window batch or the state slots, which the captured
graphs lack).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from mem_cache.kv_pool import KVPool, ReqToTokenPool
from worker.attention.base import AttentionBatch
from worker.attention.hybrid_pool import HybridKVPool, RecurrentKVPool
from worker.cuda_graphs import ChunkGraphs, DecodeGraphs, make_chunk_graphs, make_decode_graphs
from worker.loader import load_model
from worker.request import Request
from worker.scheduler import ScheduledBatch
from worker.state_slots import StateSlots
from worker.window_kv import WindowKV


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
        self.kv_pool: KVPool | HybridKVPool | RecurrentKVPool | None = None
        self.window: WindowKV | None = None  # sliding-window models (`allocate_kv`)
        self.states: StateSlots | None = None  # recurrent models (`allocate_kv`)
        self.num_sliding = len(self.config.sliding_layers)
        self.num_recurrent = len(self.config.recurrent_layers)
        self.num_full = self.config.num_layers - self.num_sliding - self.num_recurrent
        self.graphs: DecodeGraphs | None = None
        self.chunk_graphs: ChunkGraphs | None = None
        self.rows: ReqToTokenPool | None = None  # `use_rows`

    def bytes_per_slot(self) -> int:
        """Bytes of one slot of the engine's pool (the full-attention layers' K and V)."""
        c = self.config
        return 2 * self.num_full * c.num_kv_heads * c.head_dim * c.dtype.itemsize

    def bytes_per_window_slot(self) -> int:
        """Bytes of one slot of the sliding-window layers' pool (0 without such layers)."""
        c = self.config
        return 2 * self.num_sliding * c.num_kv_heads * c.head_dim * c.dtype.itemsize

    def window_tokens(self, kv_tokens: int, max_running: int, chunk: int, page: int) -> int:
        """Window slots for `max_running` requests, each holding its window and a page either
        side, and the chunk tokens of one step: at most `kv_tokens` (each window slot sits
        beside a full one). 0 for a model without sliding-window layers."""
        if not self.num_sliding:
            return 0
        need = max_running * (self.config.sliding_window + 2 * page) + chunk
        return min(-(-need // page) * page, kv_tokens)

    def allocate_kv(
        self, kv_tokens: int, window_tokens: int = 0, page_size: int = 1, num_states: int = 0
    ) -> None:
        """The pools: `kv_tokens` slots of the full layers, and for a sliding-window model
        `window_tokens` of its window layers, for a recurrent one `num_states` states."""
        c = self.config
        full = KVPool(
            kv_tokens, self.num_full, c.num_kv_heads, c.head_dim, c.dtype, self.device,
            pad_slot=True,  # where decode graphs pad their batches (worker.cuda_graphs)
        )
        if self.num_recurrent:
            shape = (num_states + 1, self.num_recurrent, c.hidden_size, c.conv_kernel - 1)
            conv = torch.zeros(shape, dtype=c.dtype, device=self.device)
            self.kv_pool = RecurrentKVPool(full, conv)
            self.states = StateSlots(conv)
            return
        if not self.num_sliding:
            self.kv_pool = full
            return
        window = KVPool(window_tokens, self.num_sliding, c.num_kv_heads, c.head_dim, c.dtype,
                        self.device, pad_slot=True)  # fmt: skip
        self.kv_pool = HybridKVPool(full, window)
        self.window = WindowKV(window, kv_tokens, page_size, c.sliding_window)

    def use_rows(self, rows: ReqToTokenPool) -> None:
        """The engine's request-to-slot table, whose rows give each pass its slots."""
        self.rows = rows

    def enable_cuda_graphs(self, max_batch: int, max_chunk: int) -> bool:
        """Capture the decode pass for batches of up to `max_batch`, and one sequence's chunk
        of up to `max_chunk` tokens (after `allocate_kv` and `use_rows`); whether the decode
        pass was (a CUDA device and a backend that can be captured)."""
        if self.window is not None or self.states is not None:
            return False
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
                                  slot_table=table, sliding=inputs.sliding,
                                  states=inputs.states)  # fmt: skip
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
        host_slots = host[token_rows, positions_t]
        parts = [torch.tensor(ids, dtype=torch.int64), positions_t, rows_t, host_slots]
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
        states = None
        if self.states is not None:
            states = torch.tensor([r.state_slot for r in batch.requests], dtype=torch.int64)
        sliding = None
        if self.window is not None:
            sliding = self._sliding_batch(rows_t, q_lens, kv_lens, host_slots)
        ids_t, positions_t, rows_t, slot_mapping = parts[:4]
        attn = None
        if not mirrored:
            attn = AttentionBatch(q_lens, kv_lens, slot_mapping, slot_table=parts[4],
                                  sliding=sliding, states=states)  # fmt: skip
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
            sliding,
            states,
        )

    def _sliding_batch(
        self, rows: torch.Tensor, q_lens: list[int], kv_lens: list[int], slots: torch.Tensor
    ) -> AttentionBatch:
        """The window layers' batch (host tensors, moved to the device): each sequence's keys
        from the window behind its first new token to its last, as window slots."""
        w = self.window
        firsts = [w.horizon(kv - q) for q, kv in zip(q_lens, kv_lens, strict=True)]
        lens = [kv - first for kv, first in zip(kv_lens, firsts, strict=True)]
        host = self.rows.req_to_token
        cols = torch.tensor(firsts)[:, None] + torch.arange(max(lens))[None, :]
        full = host[rows[:, None], cols.clamp_(max=host.shape[1] - 1)]
        table = w.window_of[full].clamp_(min=0)  # past a sequence's keys: any valid slot
        mapping = w.window_of[slots]
        assert bool((mapping >= 0).all()), "a new token without a window slot"
        return AttentionBatch(q_lens, lens, mapping.to(self.device),
                              slot_table=table.to(self.device), window=w.window)  # fmt: skip


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
    sliding: AttentionBatch | None  # the window layers' batch (sliding-window models)
    states: torch.Tensor | None  # [num_seqs] recurrent-state slots, host (recurrent models)
