"""The host-memory tier of the radix cache (a mixin of `RadixCache`).

A node's KV lives on device (`not node.evicted`), on host (`node.host_value`), or both. Both
sets are prefix-closed: a node is on device only if its parent is, and backed up on host only
if its parent is (the write path backs up parents first). Policies decide when the device->host
copy (the "backup") happens:

- `write_through`: when a node is inserted;
- `write_through_selective`: when a node is used the second time;
- `write_back`: when the device evicts it.

Device `evict` demotes a backed-up node (frees its device pages, keeps it in the tree on host)
and drops a node with no backup. `evict_host` removes host-only leaves that no in-flight copy
or `protect_host` pins (`host_ref`), LRU first, cascading to host-only parents. A match walks
on past the device prefix into host-only nodes (`MatchResult.host_length`); `load_back` copies
them to device, all or nothing, with the device path locked meanwhile.

In-flight device->host copies hold a device lock and a host protection on the node written;
they complete in issue order and are collected at every public call (`flush()` waits for all).
Host blocks are reported (`medium="host"`) when their copy completes and when they are removed.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import TYPE_CHECKING

import numpy as np
import torch

from mem_cache.allocator import KVAllocator, pages_to_slots
from mem_cache.block_ledger import BlockLedger
from mem_cache.events import HOST
from mem_cache.host_cache import KVCopier, NullCopier
from mem_cache.radix_node import TreeNode

if TYPE_CHECKING:
    from mem_cache.radix_cache import RadixCache

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
SELECTIVE_HITS = 2  # write_through_selective backs a node up on its second use


class HostTier:
    """Host-tier state and operations; mixed into `RadixCache` (which owns the tree)."""

    def _init_host(
        self: RadixCache,
        host_allocator: KVAllocator | None,
        write_policy: str,
        copier: KVCopier | None,
        load_back_min: int,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        if host_allocator is not None and host_allocator.page_size != self.page_size:
            raise ValueError("host_allocator page_size must equal the cache's page_size")
        self.host_allocator = host_allocator
        self.write_policy = write_policy
        self.copier = copier if copier is not None else NullCopier()
        self.load_back_min = load_back_min
        self._host_blocks = BlockLedger(self._events, HOST, self.block_size % self.page_size != 0)
        self._writes: deque[tuple[object, TreeNode]] = deque()  # in issue order
        self._reset_host()

    def _reset_host(self: RadixCache) -> None:
        self._host_size = 0
        self._host_heap: list[tuple[int, int, TreeNode]] = []
        if self.host_allocator is not None:
            self._host_blocks.clear()

    def host_size(self: RadixCache) -> int:
        """Tokens with a host copy (complete or in flight)."""
        return self._host_size

    def _split_host(self: RadixCache, child: TreeNode, upper: TreeNode, length: int) -> None:
        """Both halves of a split keep the host state: a backed-up node stays backed up (a
        split parent without a host copy would get its leaf dropped instead of offloaded)."""
        upper.evicted = child.evicted
        upper.host_ready = child.host_ready
        upper.host_ref = child.host_ref
        upper.hits = child.hits
        if child.host_value is not None:
            cut = length // self.page_size
            upper.host_value = child.host_value[:cut].copy()
            child.host_value = child.host_value[cut:].copy()

    # --- protection -------------------------------------------------------------------------

    def protect_host(self: RadixCache, node: TreeNode) -> None:
        """Pin the host copies of the path root..node against `evict_host` (counted)."""
        if node is self.root:
            return
        if node.parent is None:
            raise ValueError("protect_host(): the node was removed")
        node.host_here += 1
        while node is not self.root:
            node.host_ref += 1
            node = node.parent  # type: ignore[assignment]

    def release_host(self: RadixCache, node: TreeNode) -> None:
        """Release one `protect_host(node)`; `ValueError`, changing nothing, if it has none."""
        if node is self.root:
            return
        if node.host_here <= 0 or node.parent is None:
            raise ValueError("release_host(): the node is not protected")
        node.host_here -= 1
        leaf = node
        while node is not self.root:
            node.host_ref -= 1
            node = node.parent  # type: ignore[assignment]
        self._maybe_host_candidate(leaf)

    # --- backup (device -> host) ------------------------------------------------------------

    def _backup(self: RadixCache, node: TreeNode, wait: bool = False) -> bool:
        """Start copying `node` and its ancestors that have no host copy to host, parents
        first. False (nothing changed) if host memory cannot be found."""
        path = []
        while node is not self.root and node.host_value is None:
            path.append(node)
            node = node.parent  # type: ignore[assignment]
        if not path:
            return True
        path.reverse()
        deepest = path[-1]
        need = sum(len(n) for n in path) // self.page_size
        pages = self._host_alloc(need)
        if pages is None:
            return False
        host_slots, device_slots, at = [], [], 0
        for n in path:
            count = len(n) // self.page_size
            n.host_value = pages[at : at + count].copy()
            at += count
            host_slots.append(n.host_value)
            if n.value is not None:
                device_slots.append(n.value)
        self._host_size += need * self.page_size
        self.lock(deepest)  # the device pages are being read
        self.protect_host(deepest)  # the host pages are being written
        ticket = None  # a pure index has no KV to copy
        if self.allocator is not None:
            ticket = self.copier.to_host(self._slots(device_slots), self._slots(host_slots))
        self._writes.append((ticket, deepest))
        if wait:
            self.copier.wait(ticket)
        self._collect_writes()
        return True

    def _host_alloc(self: RadixCache, num_pages: int) -> np.ndarray | None:
        assert self.host_allocator is not None
        pages = self.host_allocator.alloc_pages(num_pages)
        if pages is None:
            self.evict_host(num_pages * self.page_size - self.host_allocator.available_size())
            pages = self.host_allocator.alloc_pages(num_pages)
        return pages

    def _slots(self: RadixCache, pages: list[np.ndarray]) -> torch.Tensor:
        return torch.from_numpy(pages_to_slots(np.concatenate(pages), self.page_size))

    def _collect_writes(self: RadixCache) -> None:
        """Finish the copies that completed, oldest first (they complete in issue order)."""
        while self._writes and self.copier.done(self._writes[0][0]):
            _, deepest = self._writes.popleft()
            self._finish_write(deepest)

    def _finish_write(self: RadixCache, deepest: TreeNode) -> None:
        # The write covered `deepest` and the ancestors that were not yet backed up; a split
        # since then may have cut them in two, so walk up to the first ready ancestor.
        done = []
        node = deepest
        while node is not self.root and not node.host_ready:
            done.append(node)
            node = node.parent  # type: ignore[assignment]
        for n in reversed(done):
            n.host_ready = True
            if n.hashes:
                self._host_blocks.stored(n.hashes, self._last_hash(n.parent))
        self.unlock(deepest)
        self.release_host(deepest)

    def flush(self: RadixCache) -> None:
        """Wait for every copy in flight and finish its bookkeeping."""
        while self._writes:
            self.copier.wait(self._writes[0][0])
            self._collect_writes()

    def _backup_after_use(self: RadixCache, path: list[TreeNode], inserted: bool) -> None:
        """Apply the write policy to the device nodes of a path just matched or inserted."""
        if not path or self.host_allocator is None:
            return
        device = [n for n in path if not n.evicted]
        if not device:
            return
        if self.write_policy == "write_through" and inserted:
            self._backup(device[-1])
        elif self.write_policy == "write_through_selective":
            hot = [n for n in device if n.hits >= SELECTIVE_HITS and n.host_value is None]
            if hot:
                self._backup(hot[-1])

    # --- device eviction: demote or drop ----------------------------------------------------

    def _is_device_leaf(self: RadixCache, node: TreeNode) -> bool:
        """On device, unlocked, and no child on device: a device eviction candidate."""
        if node.evicted or node.lock_ref or node.parent is None:
            return False
        return not any(not c.evicted for c in node.children.values())

    def _evict_device_node(self: RadixCache, node: TreeNode, pages: list[np.ndarray]) -> None:
        """Take `node` off the device: demote it to host if it is (or can now be) backed up,
        else drop it from the tree."""
        if node.host_value is None and self.write_policy == "write_back":
            if self.host_allocator is not None and self._backup(node, wait=True):
                self.flush()
        if node.host_value is None:
            assert not node.children, "a node with host-only children must be backed up"
            self._remove_leaf(node, pages)
            return
        assert node.host_ready and not node.lock_ref, "demoting a node with a copy in flight"
        if node.value is not None:
            pages.append(node.value)
        node.value = None
        node.evicted = True
        self._evictable -= len(node)
        if node.hashes:
            self._device_blocks.removed(node.hashes)
        self._maybe_host_candidate(node)

    # --- host eviction ----------------------------------------------------------------------

    def _maybe_host_candidate(self: RadixCache, node: TreeNode) -> None:
        if node.evicted and not node.children and not node.host_ref and node.parent is not None:
            self._seq += 1
            node.host_heap_seq = self._seq
            heapq.heappush(self._host_heap, (node.last_access, self._seq, node))

    def evict_host(self: RadixCache, num_tokens: int) -> int:
        """Remove host-only leaves that nothing pins, least recently used first, until
        `num_tokens` host tokens are freed or none is left; returns the tokens freed."""
        if self.host_allocator is None:
            return 0
        self._collect_writes()
        freed, pages = 0, []
        while freed < num_tokens and self._host_heap:
            _, seq, node = heapq.heappop(self._host_heap)
            if node.host_heap_seq != seq:
                continue
            node.host_heap_seq = -1
            if not node.evicted or node.children or node.host_ref or node.parent is None:
                continue
            parent = node.parent
            freed += len(node)
            pages.append(node.host_value)
            self._drop_host_copy(node)
            del parent.children[self._child_key(node)]
            self._num_nodes -= 1
            node.parent = None
            if parent is not self.root:
                self._maybe_host_candidate(parent)
        if pages:
            self.host_allocator.free_pages(np.concatenate(pages))
        return freed

    def _drop_host_copy(self: RadixCache, node: TreeNode) -> None:
        self._host_size -= len(node)
        if node.hashes and node.host_ready:
            self._host_blocks.removed(node.hashes)
        node.host_value = None
        node.host_ready = False
