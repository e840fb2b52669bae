"""Attention over a paged KV pool: one interface, several backends.

A forward pass covers several sequences whose new tokens are flattened into one `[T, ...]`
tensor, sequence after sequence (`AttentionBatch.q_lens`). Each backend first writes the new
tokens' K/V into the `KVPool` at `slot_mapping`, then lets every sequence's queries attend over
all of its `kv_slots` (cached prefix + new tokens). The causal mask is aligned to the END: the
`q_len` queries of a sequence are its last `q_len` positions, so query `i` sees keys
`0 .. kv_len - q_len + i`.

Backends, one file each, made by name in `registry.py`: `torch` (`torch_ref.py`, the
reference, CPU and GPU, always there: a plain gather per sequence, then SDPA), `native`
(`native.py`, the default: the same result from torch ops and the CPU kernels with less work),
`triton` (`triton_paged.py`, a paged kernel, CUDA + triton only) and `flashinfer`
(`flashinfer_paged.py`, when that package is importable). The registry imports the GPU backends
only when named, so this module loads on a machine without them.
"""

from __future__ import annotations

import bisect
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from mem_cache.kv_pool import KVPool


@dataclass
class AttentionBatch:
    """The shape of one forward pass. Tokens are flattened sequence by sequence.

    `q_lens[i]` new tokens of sequence `i` (they sum to T); `kv_lens[i] >= q_lens[i]` is its
    cached prefix plus its new tokens; `slot_mapping` (int64 [T]) the slot where each new
    token's K/V goes. The slots of all of sequence `i`'s tokens in order (the last `q_lens[i]`
    of them equal to its part of `slot_mapping`) come either as `kv_slots[i]` (int64
    [kv_len_i]) or as row `i` of `slot_table` (int64 [num_seqs, W >= max kv_len], the rows of
    the engine's request-to-slot table; entries past `kv_len_i` are any valid slot).

    A backend may memoise per-batch index tensors in `plan` (shared by every layer of the pass);
    callers build a fresh batch per forward pass.

    With `window`, each query sees only the last `window` keys up to itself (a sliding-window
    layer), and each sequence's keys may start after its first token: they are the last
    `kv_lens[i]` keys, those its queries can see (`needs_band` says whether some query must
    still skip some of them). `sliding` is the batch of a model's sliding-window layers, over
    their own pool, beside this one of its full-attention layers.
    """

    q_lens: list[int]
    kv_lens: list[int]
    slot_mapping: torch.Tensor
    kv_slots: list[torch.Tensor] | None = None
    slot_table: torch.Tensor | None = None
    plan: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    window: int | None = None
    sliding: AttentionBatch | None = None
    states: torch.Tensor | None = None  # int64 [num_seqs]: recurrent-state slots (LFM2)

    def needs_band(self) -> bool:
        """Whether a query of this windowed batch sees fewer keys than the causal mask gives
        it: a chunk of several queries whose last one reaches past the window."""
        if self.window is None:
            return False
        return any(q > 1 and kv > self.window for q, kv in zip(self.q_lens, self.kv_lens,
                                                                 strict=True))  # fmt: skip

    def slots(self, i: int) -> torch.Tensor:
        """The KV slots of sequence `i`, int64 [kv_lens[i]]."""
        if self.kv_slots is not None:
            return self.kv_slots[i]
        return self.slot_table[i, : self.kv_lens[i]]

    def all_slots(self) -> list[torch.Tensor]:
        """The KV slots of every sequence, in order."""
        return [self.slots(i) for i in range(len(self.q_lens))]

    def padded_slots(self, seqs: list[int], width: int) -> torch.Tensor:
        """int64 [len(seqs), width]: the slots of sequences `seqs`, padded with valid slots."""
        if self.slot_table is not None:
            index = torch.tensor(seqs, device=self.slot_table.device)
            return self.slot_table.index_select(0, index)[:, :width]
        return pad_sequence([self.kv_slots[i] for i in seqs], batch_first=True)  # pads with 0

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    def rows_only(self, rows: list[int]) -> AttentionBatch:
        """The batch of the queries at `rows` (rows of the flattened batch) alone, in that
        order: each one new token over the keys it sees here (the query at offset j of
        sequence i's chunk sees the first `kv_lens[i] - q_lens[i] + j + 1` of them)."""
        starts = list(itertools.accumulate(self.q_lens, initial=0))
        seqs, kv_lens = [], []
        for row in rows:
            i = bisect.bisect_right(starts, row) - 1
            seqs.append(i)
            kv_lens.append(self.kv_lens[i] - self.q_lens[i] + row - starts[i] + 1)
        device = self.slot_mapping.device
        slot_mapping = self.slot_mapping[torch.tensor(rows, dtype=torch.int64, device=device)]
        if self.kv_slots is not None:
            kv_slots = [self.kv_slots[i][:n] for i, n in zip(seqs, kv_lens, strict=True)]
            return AttentionBatch([1] * len(rows), kv_lens, slot_mapping, kv_slots=kv_slots)
        table = self.slot_table.index_select(0, torch.tensor(seqs, device=device))
        return AttentionBatch([1] * len(rows), kv_lens, slot_mapping, slot_table=table)

    def validate(self) -> None:
        """Raise ValueError when the lengths do not describe a consistent batch."""
        if (self.kv_slots is None) == (self.slot_table is None):
            raise ValueError("give exactly one of kv_slots and slot_table")
        table = self.kv_slots if self.kv_slots is not None else self.slot_table
        if not (len(self.q_lens) == len(self.kv_lens) == len(table)):
            raise ValueError("q_lens, kv_lens and the slots must have one entry per sequence")
        if self.slot_mapping.numel() != self.num_tokens:
            raise ValueError("slot_mapping must have one slot per new token")
        for i, (q_len, kv_len) in enumerate(zip(self.q_lens, self.kv_lens, strict=True)):
            slots = self.slots(i)
            if not 0 < q_len <= kv_len or slots.numel() != kv_len:
                raise ValueError(
                    f"bad sequence: q_len={q_len} kv_len={kv_len} slots={slots.numel()}"
                )


class AttentionBackend(ABC):
    """Writes the new K/V of one layer into the pool and attends over each sequence's KV."""

    name: str = "abstract"

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        batch: AttentionBatch,
        kv_pool: KVPool,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] of the new tokens -> attention output [T, H, D]."""


def end_aligned_mask(
    q_len: int, kv_len: int, device: torch.device, window: int | None = None
) -> torch.Tensor | None:
    """Bool [q_len, kv_len] mask, True where query i may see key j (j <= kv_len - q_len + i,
    and with `window`, j > kv_len - q_len + i - window).

    None when there is no cached prefix and no window cuts in: plain `is_causal` is the same
    mask and faster.
    """
    banded = window is not None and kv_len > window and q_len > 1
    if q_len == kv_len and not banded:
        return None
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    keys = torch.arange(kv_len, device=device)[None, :]
    mask = keys <= q_pos
    return mask & (keys > q_pos - window) if banded else mask
