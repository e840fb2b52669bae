"""Decode passes replayed from CUDA graphs, one graph per padded batch size.

On a GPU a decode pass of a small model is launch-bound: each layer is a dozen or so kernels of
a few microseconds, and the Python that launches them takes longer than they run (a step eager
takes many times the time its weights take to read; docs/engine.md). A CUDA graph records the
launches of one pass once and replays them in one call.

`DecodeGraphs` captures, at start, one pass for each batch size of `graph_batch_sizes` over
input tensors it owns: token ids, positions, the slots the new K/V go to, each sequence's KV
length and its row of the device's copy of the request-to-slot table (which the attention
kernel reads in place; `ReqToTokenPool.device_table`). A decode step copies its inputs into
them, pads the batch to the next captured size and replays. Padding rows decode token 0 at
position 0 over one key and write their K/V into the pool's pad slot (`KVPool.pad_slot`),
which no allocator hands out, so they touch no one's KV.

`ChunkGraphs` does the same for a pass over one sequence's chunk of new tokens that samples its last
one: a prompt, or the part of it past a cached prefix, when it is alone in its step. Such a pass
is launch-bound too (hundreds of launches, short kernels), which left a cache hit's TTFT on a
GPU close to a cold prompt's (docs/engine.md). It pads the chunk to the next captured length;
the padding tokens come after the real ones, so the causal mask hides them from every real
query, and their K/V goes to the pad slot.

Only a backend whose plan reads every length and row on the device can be captured
(`graph_plan`; today `triton`). Everything else runs eagerly, as before: mixed batches and
chunks of several sequences, a batch or chunk above the largest graph, another backend, a
capture that failed.

`capture=False` runs the same passes over the same padded buffers without recording a graph
(both classes):
how the padding and the in-place plan are tested on a machine with no GPU (the Triton kernel in
its CPU interpreter).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from functools import partial

import torch

from mem_cache.kv_pool import KVPool
from worker.attention.base import AttentionBatch
from worker.models.llama import CausalLM

logger = logging.getLogger(__name__)
# a captured size's replay, and the output buffer it refills (None: the replay returns it)
Pass = tuple[Callable[[], torch.Tensor | None], torch.Tensor | None]


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The captured batch sizes up to `max_batch` (which is always one): 1, 2, 4, 8, then
    every 8 to 64, every 16 to 128, every 32 beyond. A batch pads to the next size up: fewer
    than 8 padding rows up to 64 requests, 16 up to 128, 32 beyond (vLLM and SGLang step their
    sizes the same way)."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, 129, 16)]
    sizes += range(160, max_batch + 1, 32)
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


class _PaddedPasses:
    """What both kinds of graphs share: one pass per size of `sizes` (captured, or run eagerly
    over the same buffers), the token buffers it reads (ids, positions, the slots their K/V go
    to), filled and padded per step, and the replay. A kind adds its index buffers (`_load`)
    and the pass itself (`_forward`)."""

    sizes: list[int]

    def __init__(self, kv_pool: KVPool, n: int, device: torch.device) -> None:
        if kv_pool.pad_slot is None:
            raise ValueError("CUDA graphs need a KV pool with a pad slot")
        self.kv_pool = kv_pool
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), kv_pool.pad_slot, dtype=torch.int64, device=device)
        self.replays = 0  # passes run through here
        self.capture_s, self.capture_bytes = 0.0, 0  # what capturing took (GPU)
        # size -> the replay (a graph's, or the eager pass) and its logits
        self.passes: dict[int, Pass] = {}

    def _make_passes(self, capture: bool, what: str) -> None:
        """A graph of every size (logged as `what`), or with `capture` False each size's pass
        run eagerly over the same buffers (how a machine without a GPU tests them)."""
        self.capture = capture
        if not capture:
            self.passes = {size: (partial(self._forward, size), None) for size in self.sizes}
            return
        self.passes, self.capture_s, self.capture_bytes = capture_passes(
            self.sizes, self._forward, self.input_ids.device
        )
        logger.info("captured %d %s graphs (up to %d) in %.1f s, %.0f MiB", len(self.sizes),
                    what, self.sizes[-1], self.capture_s, self.capture_bytes / 2**20)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_lens: list[int],
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """float32 logits of the pass (`can_run`) over the tokens `input_ids` at `positions`,
        their K/V to `slot_mapping`, of sequences with `kv_lens` keys after it at `rows` of the
        slot table: [B, vocab] for a decode batch of B, [1, vocab] for a chunk."""
        n = input_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        if n < size:  # padding tokens: token 0 at position 0, K/V into the pad slot
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(self.kv_pool.pad_slot)
        out_rows = self._load(kv_lens, rows, n, size)
        replay, logits = self.passes[size]
        self.replays += 1
        out = replay()
        if logits is None:  # not captured: the pass returned them
            logits = out
        # a copy: a graph's output buffer is overwritten by its next replay
        return logits[:out_rows].clone()

    def _load(self, kv_lens: list[int], rows: torch.Tensor, n: int, size: int) -> int:
        """Fill the kind's index buffers for `n` tokens padded to `size`; the logits rows the
        pass yields."""
        raise NotImplementedError

    def _forward(self, size: int) -> torch.Tensor:
        """The pass over the first `size` tokens of the buffers (what a graph records)."""
        raise NotImplementedError


class DecodeGraphs(_PaddedPasses):
    """CUDA graphs of the decode pass of `model` over `kv_pool` (which has a pad slot) for up to
    `max_batch` sequences whose slots are rows of `slot_table` (the device's copy of the
    request-to-slot table, which the engine keeps current)."""

    def __init__(
        self,
        model: CausalLM,
        kv_pool: KVPool,
        slot_table: torch.Tensor,
        max_batch: int,
        capture: bool = True,
    ) -> None:
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = n = self.sizes[-1]
        dev = slot_table.device
        super().__init__(kv_pool, n, dev)
        self.model = model
        self.kv_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.rows = torch.zeros(n, dtype=torch.int32, device=dev)
        self.q_indptr = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.slot_table = slot_table
        self._make_passes(capture, "decode")

    @staticmethod
    def supported(model: CausalLM) -> bool:
        """Whether `model`'s attention backend can be captured."""
        return hasattr(model.backend, "graph_plan")

    def can_run(self, num_seqs: int, num_tokens: int) -> bool:
        """A decode-only batch (one token per sequence) of at most `max_batch` sequences."""
        return num_tokens == num_seqs and 0 < num_seqs <= self.max_batch

    def _load(self, kv_lens: list[int], rows: torch.Tensor, n: int, size: int) -> int:
        """Each of the B = n sequences' KV length and row; padding rows one key, row 0."""
        self.rows[:n].copy_(rows, non_blocking=True)
        lens = torch.tensor(kv_lens, dtype=torch.int32)
        self.kv_lens[:n].copy_(lens, non_blocking=self.kv_lens.is_cuda)
        if n < size:
            self.kv_lens[n:size].fill_(1)
            self.rows[n:size].zero_()
        return n

    def _forward(self, size: int) -> torch.Tensor:
        """The decode pass of the first `size` rows of the buffers (what a graph records)."""
        slot_mapping = self.slot_mapping[:size]
        plan = self.model.backend.graph_plan(
            self.q_indptr[: size + 1], self.kv_lens[:size], self.rows[:size], self.slot_table, 1
        )
        batch = AttentionBatch([1] * size, [1] * size, slot_mapping, slot_table=self.slot_table)
        batch.plan[self.model.backend.name] = plan
        return self.model.forward(
            self.input_ids[:size], self.positions[:size], batch, self.kv_pool, None
        )


def chunk_graph_sizes(max_tokens: int) -> list[int]:
    """The captured chunk lengths up to `max_tokens` (none under 16): powers of two from 16 to
    512, then 768, 1024, 1536 and 2048. A chunk pads to the next: under half of a graph's
    tokens are padding up to 512, under a third beyond."""
    return [s for s in (16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048) if s <= max_tokens]


class ChunkGraphs(_PaddedPasses):
    """CUDA graphs of a pass over one sequence's chunk of 2 to `max_tokens` (at most 2048) new
    tokens that samples its last one, the sequence's slots a row of `slot_table` (the device's
    copy of the request-to-slot table), for `model` over `kv_pool` (which has a pad slot).

    A chunk of t tokens over a prefix of p pads to the captured length T >= t: the kernel sees
    one sequence of T new tokens and p + T keys, so query i < t sits at position p + i and sees
    keys up to it alone; the padding queries read table entries past p + t (any valid slot) and
    their outputs are dropped. Padding tokens are token 0 at position 0, K/V into the pad slot.
    A chunk fits only where p + T is within the table's width."""

    def __init__(
        self,
        model: CausalLM,
        kv_pool: KVPool,
        slot_table: torch.Tensor,
        max_tokens: int,
        capture: bool = True,
    ) -> None:
        self.sizes = chunk_graph_sizes(min(max_tokens, slot_table.shape[1]))
        if not self.sizes:
            raise ValueError(f"no chunk graph fits {max_tokens} tokens")
        dev, n = slot_table.device, self.sizes[-1]
        super().__init__(kv_pool, n, dev)
        self.model, self.slot_table = model, slot_table
        self.kv_len = torch.ones(1, dtype=torch.int32, device=dev)  # p + T
        self.row = torch.zeros(1, dtype=torch.int32, device=dev)
        self.last = torch.zeros(1, dtype=torch.int64, device=dev)  # t - 1: the row to sample
        self.q_indptr = {
            size: torch.tensor([0, size], dtype=torch.int32, device=dev) for size in self.sizes
        }
        self._make_passes(capture, "chunk")

    def can_run(self, num_seqs: int, num_tokens: int, kv_len: int) -> bool:
        """One sequence's chunk of 2 to the largest graph's tokens, ending at `kv_len`, whose
        padded keys stay within the slot table's row."""
        if num_seqs != 1 or not 1 < num_tokens <= self.sizes[-1]:
            return False
        size = self.sizes[bisect.bisect_left(self.sizes, num_tokens)]
        return kv_len - num_tokens + size <= self.slot_table.shape[1]

    def _load(self, kv_lens: list[int], rows: torch.Tensor, n: int, size: int) -> int:
        """The sequence's row, its keys with the padding (p + T), the row to sample (t - 1)."""
        self.row.copy_(rows, non_blocking=True)
        self.kv_len.fill_(kv_lens[0] - n + size)
        self.last.fill_(n - 1)
        return 1

    def _forward(self, size: int) -> torch.Tensor:
        """The pass over the first `size` tokens of the buffers (what a graph records)."""
        plan = self.model.backend.graph_plan(
            self.q_indptr[size], self.kv_len, self.row, self.slot_table, size
        )
        slot_mapping = self.slot_mapping[:size]
        batch = AttentionBatch([size], [size], slot_mapping, slot_table=self.slot_table)
        batch.plan[self.model.backend.name] = plan
        return self.model.forward(
            self.input_ids[:size], self.positions[:size], batch, self.kv_pool, self.last
        )


def capture_passes(
    sizes: list[int], forward: Callable[[int], torch.Tensor], device: torch.device
) -> tuple[dict[int, Pass], float, int]:
    """A graph of `forward(size)` for each of `sizes`, largest first so the smaller reuse its
    memory pool: each size's replay and output buffer, the seconds it took and the device
    memory it reserved."""
    started, reserved = time.perf_counter(), torch.cuda.memory_reserved()
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream())
    # warm-up, every size once: Triton (the attention kernel, and torch.compile's kernels when
    # the layers are compiled) builds a kernel for each new shape or alignment it meets, and
    # CUDA refuses the module load a build ends with inside a capture
    with torch.cuda.stream(stream):
        for size in reversed(sizes):
            forward(size)
    torch.cuda.current_stream().wait_stream(stream)
    passes: dict[int, Pass] = {}
    for size in reversed(sizes):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward(size)
        passes[size] = (graph.replay, out)
    torch.cuda.synchronize()
    return passes, time.perf_counter() - started, torch.cuda.memory_reserved() - reserved


def make_decode_graphs(
    model: CausalLM, kv_pool: KVPool, slot_table: torch.Tensor, max_batch: int
) -> DecodeGraphs | None:
    """The engine's decode graphs on a CUDA device, or None where they cannot be had (another
    device or backend, or a capture that failed: logged, and the engine runs eagerly)."""
    return _on_cuda(DecodeGraphs, "the decode pass", model, kv_pool, slot_table, max_batch)


def make_chunk_graphs(
    model: CausalLM, kv_pool: KVPool, slot_table: torch.Tensor, max_tokens: int
) -> ChunkGraphs | None:
    """The engine's graphs of one sequence's sampled chunk (`ChunkGraphs`), on the same terms
    as `make_decode_graphs`."""
    return _on_cuda(ChunkGraphs, "prompt chunks", model, kv_pool, slot_table, max_tokens)


def _on_cuda(cls: type, what: str, model: CausalLM, kv_pool: KVPool, slot_table: torch.Tensor,
             limit: int):  # fmt: skip
    if slot_table.device.type != "cuda" or kv_pool.pad_slot is None:
        return None
    if not DecodeGraphs.supported(model):
        logger.info("attention backend %s has no CUDA graphs: %s run eagerly", model.backend.name,
                    what)
        return None
    try:
        return cls(model, kv_pool, slot_table, limit)
    except Exception as exc:  # noqa: BLE001 - any capture failure leaves the engine eager
        logger.warning("capturing CUDA graphs of %s failed, running them eagerly: %s", what, exc)
        torch.cuda.synchronize()
        return None
