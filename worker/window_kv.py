"""`WindowKV`: the sliding-window layers' KV slots, and which full slot each one belongs to.

A model with sliding-window layers (Gemma 3) keeps two pools (`HybridKVPool`): the engine's
slots (allocator, request rows, sessions) index the full-attention layers' pool, and each of
them may have one slot of the window pool beside it, `window_of[slot]` (-1: none). A window
slot is attached when its full slot is allocated, so it has the full slot's owner, and detached
(freed back to this allocator) either with its full slot or earlier, once no query of its owner
can see it any more: a request at `num_computed` tokens needs the window KV of positions
`num_computed - window + 1` on only (`horizon`), so its window memory is bounded by the window
plus the chunk it computes, not by its context. The component radix cache
(`mem_cache.hybrid_cache`) holds window slots beside the full slots it holds, and frees them
through this allocator when it tombstones or evicts a node: every free, whoever makes it,
detaches the slot (`full_of`, the mapping read backwards, finds its full slot).

Only whole pages move: a page of full slots has a page of window slots, contiguous in the same
order.
"""

from __future__ import annotations

import numpy as np
import torch

from mem_cache.allocator import KVAllocator, pages_to_slots
from mem_cache.kv_pool import KVPool


class WindowAllocator(KVAllocator):
    """The window pool's free list; a page given back is detached from its full slots."""

    def __init__(self, size: int, page_size: int, window_kv: WindowKV) -> None:
        self.window_kv = window_kv
        super().__init__(size, page_size)

    def free_pages(self, pages: np.ndarray) -> None:
        super().free_pages(pages)  # validates first: nothing changes on a bad free
        slots = torch.from_numpy(pages_to_slots(np.asarray(pages), self.page_size))
        kv = self.window_kv
        full = kv.full_of[slots]
        kv.window_of[full[full >= 0]] = -1
        kv.full_of[slots] = -1


class WindowKV:
    def __init__(self, pool: KVPool, full_size: int, page_size: int, window: int) -> None:
        """`pool` has `pool.size` window slots (and a pad slot, mapped from the full pool's);
        `full_size` full slots may each have one."""
        self.pool = pool
        self.window = window
        self.page_size = page_size
        # index full_size: the full pool's pad slot (CUDA-graph padding) -> the window's pad slot
        self.window_of = torch.full((full_size + 1,), -1, dtype=torch.int64)
        self.window_of[full_size] = pool.size
        self.full_of = torch.full((pool.size + 1,), -1, dtype=torch.int64)
        self.allocator = WindowAllocator(pool.size, page_size, self)
        self.full_size = full_size

    @property
    def size(self) -> int:
        return self.allocator.size

    def horizon(self, num_computed: int) -> int:
        """The first position whose window KV a request at `num_computed` tokens still needs."""
        return max(num_computed - self.window + 1, 0)

    def attach(self, slots: torch.Tensor) -> bool:
        """Give each of `slots` (whole pages of full slots, none attached) a window slot; False,
        taking nothing, when this pool is short."""
        assert bool((self.window_of[slots] < 0).all()), "attach to a slot that has one"
        window = self.allocator.alloc(slots.numel())
        if window is None:
            return False
        self.window_of[slots] = window
        self.full_of[window] = slots
        return True

    def detach(self, slots: torch.Tensor) -> int:
        """Free the window slots of those of `slots` (whole pages) that have one; how many."""
        if slots.numel() == 0:
            return 0
        window = self.window_of[slots]
        held = window >= 0
        if not bool(held.any()):
            return 0
        self.allocator.free(window[held])  # detaches them (`WindowAllocator`)
        return int(held.sum())

    def move(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """The window slots of full slots `old` now sit beside `new` (the radix cache kept its
        own full copy of those tokens and took the window slots for it); `old` keeps none."""
        window = self.window_of[old]
        held = window >= 0
        self.window_of[old] = -1
        self.window_of[new[held]] = window[held]
        self.full_of[window[held]] = new[held]

    def intact(self, slots: torch.Tensor) -> bool:
        """Whether every one of `slots` has its window slot."""
        return bool((self.window_of[slots] >= 0).all())

    def first_attached(self, slots: torch.Tensor) -> int:
        """The index of the first of `slots` that has a window slot (len(slots) if none)."""
        held = torch.nonzero(self.window_of[slots] >= 0)
        return int(held[0, 0]) if held.numel() else slots.numel()

    def attached(self) -> int:
        """Full slots with a window slot."""
        return int((self.window_of[: self.full_size] >= 0).sum())

    def check(self, free_full: torch.Tensor) -> None:
        """Conservation: free + attached == size, no window slot given twice, no free full
        slot holding one (`free_full`: the full allocator's free slot ids)."""
        mapped = self.window_of[: self.full_size]
        held = mapped[mapped >= 0]
        free = self.allocator.available_size()
        assert free + held.numel() == self.size, (
            f"window slots: free {free} + attached {held.numel()} != {self.size}"
        )
        assert held.unique().numel() == held.numel(), "a window slot attached twice"
        assert not bool((mapped[free_full] >= 0).any()), "a free full slot holds a window slot"
        full = torch.nonzero(mapped >= 0)[:, 0]
        assert torch.equal(self.full_of[held], full), "the backward mapping disagrees"
