"""`HybridKVPool`: the two KV pools of a model with sliding-window layers; `RecurrentKVPool`:
the attention layers' pool and the recurrent states of a model with recurrent layers.

`full` holds the full-attention layers' K/V, indexed by the engine's slots (the radix cache's
and the request rows' ids); `window` holds the sliding-window layers' K/V in slots of its own,
of which each request keeps only the window its next queries can see (`worker.window_kv`).
Memory only, like `KVPool`: who owns which slot is the engine's business.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mem_cache.kv_pool import KVPool


@dataclass
class HybridKVPool:
    full: KVPool
    window: KVPool

    def bytes_per_slot(self) -> int:
        """Bytes of one full slot plus one window slot (every layer's K and V of one token)."""
        return self.full.bytes_per_slot() + self.window.bytes_per_slot()


@dataclass
class RecurrentKVPool:
    """`full`: the attention layers' K/V at the engine's slots; `conv`: [state slots + 1,
    conv layers, hidden, kernel - 1], each slot one request's convolution state (the last
    one a pad slot that no one holds)."""

    full: KVPool
    conv: torch.Tensor
