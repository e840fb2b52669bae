"""A node of the component radix tree (`HybridRadixCache`): a `TreeNode` whose edge also holds
the KV of a hybrid model's other layer kinds.

Besides the full-attention pages (`value`, as in the plain tree) a node holds, per
sliding-window group, the window-KV pages of the same tokens (`windows[i]`, `None` once evicted:
the node is then a *tombstone* for that group), and at most one recurrent state (`state`, a
state slot id, -1 when none) saved at the node's END. The host tier's copies mirror them
(`host_value`, `host_windows`, `host_state`).

Window locks: a lock on node `d` protects, for a group of window `W`, the window KV of the nodes
that overlap `[d.end - W, d.end)`. Each node keeps the ends of the window locks that reach it
(`wlocks`: end -> count, for the largest window), so the group's protection of a node is a
function of the node alone (`window_locked`) and a split hands the upper half exactly the locks
that reach it.
"""

from __future__ import annotations

import numpy as np

from mem_cache.radix_node import TreeNode

NO_STATE = -1


class HybridNode(TreeNode):
    """One edge of the component tree; fields are public to the cache and its checker."""

    __slots__ = ("windows", "state", "wlocks", "seqs", "host_windows", "host_state")

    def __init__(self, *args: object, num_windows: int = 0, num_components: int = 1) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.windows: list[np.ndarray | None] = [None] * num_windows
        self.state = NO_STATE
        self.wlocks: dict[int, int] = {}  # window-lock end -> count
        self.seqs = [-1] * num_components  # live heap entry per component's LRU
        self.host_windows: list[np.ndarray | None] = [None] * num_windows
        self.host_state = NO_STATE

    def new_node(self, *args: object) -> HybridNode:
        return HybridNode(*args, num_windows=len(self.windows), num_components=len(self.seqs))

    def window_locked(self, window: int) -> bool:
        """Whether some lock protects this node's KV of a group with `window`."""
        return bool(self.wlocks) and min(self.wlocks) - window < self.end

    def split_components(self, upper: HybridNode, length: int, page_size: int, widest: int) -> None:
        """`upper` took this node's first `length` tokens (`TreeNode.split`): give it its share
        of the window pages, the window locks that reach it, and no state (a state belongs to
        the end, which stays here)."""
        cut = length // page_size
        for i, pages in enumerate(self.windows):
            if pages is not None:
                upper.windows[i] = pages[:cut].copy()
                self.windows[i] = pages[cut:].copy()
        for i, pages in enumerate(self.host_windows):
            if pages is not None:
                upper.host_windows[i] = pages[:cut].copy()
                self.host_windows[i] = pages[cut:].copy()
        upper.wlocks = {e: n for e, n in self.wlocks.items() if e - widest < upper.end}

    def __repr__(self) -> str:
        tomb = "".join("T" if w is None else "w" for w in self.windows)
        return (
            f"HybridNode(start={self.start}, len={len(self)}, lock={self.lock_ref}, "
            f"win={tomb}, state={self.state}, evicted={self.evicted})"
        )
