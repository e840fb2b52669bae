"""LRU eviction of the radix cache's unlocked leaves (a mixin of `RadixCache`).

The candidates live in a lazy min-heap keyed by last use: a node is pushed whenever it becomes
(or, touched, stays) an unlocked leaf, and an entry is live only while its sequence number is
the node's `heap_seq`; stale entries are skipped on pop and the heap is compacted when they
outnumber the nodes. No `evict` walks the tree.

Freeing path: an evicted leaf's pages go back to the allocator (tree -> allocator), or, with a
host tier, its device pages do while the node stays matchable on host.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np

from mem_cache.radix_node import TreeNode

if TYPE_CHECKING:
    from mem_cache.radix_cache import RadixCache


class LruEviction:
    """`evict` and the heap of eviction candidates; state lives on the `RadixCache`."""

    def evict(self: RadixCache, num_tokens: int) -> int:
        """Take unlocked leaves off the device, least recently used first, until `num_tokens`
        are freed or nothing is evictable; a parent left an unlocked leaf becomes a candidate
        with its own last use. With a host tier a backed-up node is demoted to host (it stays
        matchable there) instead of removed. Returns the device tokens freed."""
        host = self.host_allocator is not None
        if host:
            self._collect_writes()
        freed, pages = 0, []
        while freed < num_tokens and self._heap:
            _, seq, node = heapq.heappop(self._heap)
            if node.heap_seq != seq:
                continue
            node.heap_seq = -1
            if not self._evictable_leaf(node):
                continue
            freed += len(node)
            parent = node.parent
            if host:
                self._evict_device_node(node, pages)
            else:
                self._remove_leaf(node, pages)
            if parent is not self.root and self._evictable_leaf(parent):
                self._push(parent)
        if pages and self.allocator is not None:
            self.allocator.free_pages(np.concatenate(pages))
        return freed

    def _evictable_leaf(self: RadixCache, node: TreeNode) -> bool:
        if self.host_allocator is not None:
            return self._is_device_leaf(node)
        return node.parent is not None and not node.children and not node.lock_ref

    def _remove_leaf(self: RadixCache, node: TreeNode, pages: list[np.ndarray]) -> None:
        """Detach an unlocked leaf; its pages go to `pages` for the caller to free."""
        assert not node.children and node.lock_ref == 0, "only unlocked leaves are removed"
        del node.parent.children[self._child_key(node)]  # type: ignore[union-attr]
        self._evictable -= len(node)
        self._num_nodes -= 1
        if node.value is not None:
            pages.append(node.value)
        if node.hashes:
            self._device_blocks.removed(node.hashes)
        node.parent = None
        node.value = None

    def _push(self: RadixCache, node: TreeNode) -> None:
        self._seq += 1
        node.heap_seq = self._seq
        heapq.heappush(self._heap, (node.last_access, self._seq, node))
        if len(self._heap) > 2 * self._num_nodes + 1024:
            self._compact_heap()

    def _compact_heap(self: RadixCache) -> None:
        """Drop stale heap entries (amortised: runs after more pushes than there are nodes)."""
        self._heap = [e for e in self._heap if e[2].heap_seq == e[1]]
        heapq.heapify(self._heap)
