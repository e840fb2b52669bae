"""`StateSlots`: the recurrent states of a model with recurrent layers (LFM2's convolutions).

Each running request holds one slot of `RecurrentKVPool.conv` (`Request.state_slot`): the state
after its `num_computed` tokens. A session turn that parks hands its slot to the session; the
next turn takes it over when it resumes exactly where the state stands (else it recomputes).
Slots come zeroed (the state before any token). The component radix cache keeps copies of
states saved at checkpoints in slots of its own from the same allocator (`worker.kv_memory`).
"""

from __future__ import annotations

import torch

from mem_cache.allocator import KVAllocator


class StateSlots:
    def __init__(self, conv: torch.Tensor) -> None:
        """`conv`: [slots + 1, ...] state tensor; the last slot is padding no one holds."""
        self.conv = conv
        self.allocator = KVAllocator(conv.shape[0] - 1, 1)

    @property
    def size(self) -> int:
        return self.allocator.size

    def alloc(self) -> int | None:
        """A zeroed slot, or None when every slot is held."""
        slot = self.allocator.alloc(1)
        if slot is None:
            return None
        self.conv[int(slot[0])].zero_()
        return int(slot[0])

    def free(self, slot: int) -> None:
        self.allocator.free([slot])

    def check(self, held: list[int], tree: int = 0) -> None:
        """Conservation: free + held (requests, sessions) + the tree's == size, no slot held
        twice."""
        free = self.allocator.available_size()
        assert len(set(held)) == len(held), "a state slot held twice"
        assert free + len(held) + tree == self.size, (
            f"state slots: free {free} + held {len(held)} + tree {tree} != {self.size}"
        )
