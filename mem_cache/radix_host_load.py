"""Reading the host tier: matches that run on into host-only nodes, promotion of host-only
nodes by `insert`, and `load_back` (a mixin of `RadixCache`; see radix_host.py for the tier).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mem_cache.radix_node import TreeNode

if TYPE_CHECKING:
    from mem_cache.radix_cache import MatchResult, RadixCache


class HostLoad:
    """Host-tier reads of `RadixCache` (which owns the state they use)."""

    def _match_with_host(
        self: RadixCache, path: list[TreeNode], node: TreeNode, pos: int
    ) -> MatchResult:
        from mem_cache.radix_cache import MatchResult

        self._collect_writes()
        on_device = 0
        while on_device < len(path) and not path[on_device].evicted:
            on_device += 1
        device, host = path[:on_device], path[on_device:]
        host_length = sum(len(n) for n in host)
        end = device[-1] if device else self.root
        self._backup_after_use(path, inserted=False)
        return MatchResult(
            self._gather(device), end, pos - host_length, host_length, host[-1] if host else None
        )

    def _promote(self: RadixCache, path: list[TreeNode], values: np.ndarray | None) -> int:
        """Insert over host-only nodes: they take the caller's device slots. Returns the
        device-cached length before (what the caller holds duplicates of)."""
        cached = 0
        for node in path:
            if not node.evicted:
                cached = node.end
                continue
            if values is not None:
                node.value = self._pages_of(values, node.start, node.end)
            self._to_device(node)
        return cached

    def _to_device(self: RadixCache, node: TreeNode) -> None:
        node.evicted = False
        self._evictable += len(node)
        node.host_heap_seq = -1
        if node.hashes:
            self._device_blocks.stored(node.hashes, self._last_hash(node.parent))
        if self._is_device_leaf(node):
            self._push(node)

    def load_back(self: RadixCache, result: MatchResult) -> MatchResult:
        """Copy the host-only part of a match to device, all or nothing. Returns a result
        whose `.length` covers it, or `result` unchanged when it is shorter than
        `load_back_min`, when device memory cannot be found, or when there is nothing to load."""
        from mem_cache.radix_cache import MatchResult

        host_end = result.host_node
        if not result.host_length or host_end is None or result.host_length < self.load_back_min:
            return result
        if host_end.parent is None or not host_end.evicted:
            raise ValueError("load_back(): the match is stale (its nodes changed)")
        path = []
        node = host_end
        while node is not result.node and node is not self.root:
            path.append(node)
            node = node.parent  # type: ignore[assignment]
        path.reverse()
        if not self._load(path, result.node):
            return result
        full = []
        node = host_end
        while node is not self.root:
            full.append(node)
            node = node.parent  # type: ignore[assignment]
        full.reverse()
        return MatchResult(self._gather(full), host_end, result.length + result.host_length)

    def _load(self: RadixCache, path: list[TreeNode], device_end: TreeNode) -> bool:
        need = sum(len(n) for n in path) // self.page_size
        pages = None
        self.lock(device_end)  # the device prefix and the host path must survive the
        self.protect_host(path[-1])  # evictions that making room may cause
        try:
            if self.allocator is not None:
                pages = self.allocator.alloc_pages(need)
                if pages is None:
                    self.evict(need * self.page_size - self.allocator.available_size())
                    pages = self.allocator.alloc_pages(need)
                if pages is None:
                    return False
                host = self._slots([n.host_value for n in path])  # type: ignore[misc]
                self.copier.wait(self.copier.to_device(host, self._slots([pages])))
            at = 0
            for n in path:
                count = len(n) // self.page_size
                if pages is not None:
                    n.value = pages[at : at + count].copy()
                at += count
                self._to_device(n)
        finally:
            self.release_host(path[-1])
            self.unlock(device_end)
        return True
