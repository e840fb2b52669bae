"""The host-memory tier of the radix cache: an object the `RadixCache` owns and calls at a few
points of its life (insert, match, device eviction, load back, reset, integrity).

A node's KV lives on device (`not node.evicted`), on host (`node.host_value`), or both. Both
sets are prefix-closed: a node is on device only if its parent is, and backed up on host only
if its parent is (a backup copies the missing ancestors first). Policies decide when the
device->host copy (the "backup") happens:

- `write_through`: when a node is inserted;
- `write_through_selective`: when a node is used the second time;
- `write_back`: when the device evicts it.

Device eviction demotes a backed-up node (the cache frees its device pages, the node stays in
the tree on host) and drops a node with no backup. `evict` removes host-only leaves that no
in-flight copy or `protect` pins (`host_ref`), LRU first, cascading to host-only parents.

In-flight device->host copies hold a device lock and a host protection on the node written;
they complete in issue order and are collected at every public call of the cache (`flush`
waits for all). Host blocks are reported (`medium="host"`) when their copy completes and when
they are removed.

`HostTier` is the interface, and the tier of a cache without host memory (its hooks do
nothing); `HostMemoryTier` is the tier with host memory.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sized
from typing import Protocol

import numpy as np
import torch

from mem_cache.allocator import KVAllocator, pages_to_slots
from mem_cache.block_ledger import BlockLedger, snapshot_stored
from mem_cache.events import HOST, BlockStored
from mem_cache.host_cache import KVCopier, NullCopier
from mem_cache.radix_node import TreeNode, last_block_hash

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
SELECTIVE_HITS = 2  # write_through_selective backs a node up on its second use


class Tree(Protocol):
    """What the host tier asks of the cache that owns it."""

    root: TreeNode

    def lock(self, node: TreeNode) -> None: ...

    def unlock(self, node: TreeNode) -> None: ...

    def detach(self, node: TreeNode) -> None: ...


class HostTier:
    """The cache's calls into its host tier. This base is the tier of a cache without host
    memory: nothing is ever backed up, so nothing is demoted, loaded back or pinned, and every
    hook does nothing. `HostMemoryTier` is the real one."""

    def __init__(self, copier: KVCopier | None = None) -> None:
        self.allocator: KVAllocator | None = None  # host pages
        self.copier = copier if copier is not None else NullCopier()  # moves the KV
        self.writes: Sized = ()  # copies to host in flight, oldest first

    def size(self) -> int:
        """Tokens with a host copy (complete or in flight)."""
        return 0

    def collect(self) -> None:
        """Finish the copies that completed (the cache calls it at every public call)."""

    def flush(self) -> None:
        """Wait for every copy in flight and finish its bookkeeping."""

    def after_use(self, path: list[TreeNode], inserted: bool) -> None:
        """`path` was just matched or inserted (its device nodes first): apply the policy."""

    def split(self, child: TreeNode, upper: TreeNode, length: int) -> None:
        """`upper` took the first `length` tokens of `child`: give it its share of the host
        state (a split parent without its host copy would get its leaf dropped, not demoted)."""

    def offload(self, node: TreeNode) -> bool:
        """The device evicts `node`: True if it keeps a complete host copy (demote it), False
        if it has none (remove it)."""
        return False

    def rerank(self, node: TreeNode) -> None:
        """A host-only node was demoted or used: (re)enter it among the host-eviction
        candidates if it is an unpinned leaf."""

    def loaded(self, node: TreeNode) -> None:
        """`node` is back on device (load back or insert over it)."""

    def copy_to_device(self, path: list[TreeNode], pages: np.ndarray) -> None:
        """Copy the host KV of `path` into the device `pages`, ready for the next kernel."""

    def protect(self, node: TreeNode) -> None:
        """Pin the host copies of the path root..node against `evict` (counted)."""

    def release(self, node: TreeNode) -> None:
        """Release one `protect(node)`; `ValueError`, changing nothing, if it has none."""

    def evict(self, num_tokens: int) -> int:
        """Remove unpinned host-only leaves, LRU first, until `num_tokens` are freed."""
        return 0

    def snapshot(self) -> list[BlockStored]:
        """`BlockStored(medium="host")` for every block with a complete host copy."""
        return []

    def pinned(self) -> bool:
        """Whether some path is protected (by `protect` or a copy in flight)."""
        return False

    def clear(self, nodes: list[TreeNode]) -> None:
        """The tree is reset: free the host pages of `nodes` (all of its nodes), forget them."""

    def check(self, nodes: list[TreeNode]) -> None:
        """Raise `AssertionError` naming the first violated host-tier invariant."""


def new_host_tier(
    tree: Tree,
    allocator: KVAllocator | None,
    write_policy: str,
    copier: KVCopier | None,
    ledger: BlockLedger,
    moves_kv: bool,
) -> HostTier:
    """The tier for `allocator` (host pages; None: no host memory). `ledger` reports host
    blocks; `moves_kv` is False for a cache with no KV behind it (nothing to copy)."""
    if write_policy not in WRITE_POLICIES:
        raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
    if allocator is None:
        return HostTier(copier)
    return HostMemoryTier(tree, allocator, write_policy, copier, ledger, moves_kv)


class HostMemoryTier(HostTier):
    """Host copies of the cache's nodes in the pages of `allocator`; see the module docstring."""

    def __init__(
        self,
        tree: Tree,
        allocator: KVAllocator,
        write_policy: str,
        copier: KVCopier | None,
        ledger: BlockLedger,
        moves_kv: bool,
    ) -> None:
        self.tree = tree
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.write_policy = write_policy
        self.copier = copier if copier is not None else NullCopier()
        self.moves_kv = moves_kv
        self.writes: deque[tuple[object, TreeNode]] = deque()  # in issue order
        self._blocks = ledger
        self._size = 0
        self._heap: list[tuple[int, int, TreeNode]] = []  # lazy, like the device's LRU heap
        self._seq = 0

    def size(self) -> int:
        return self._size

    def split(self, child: TreeNode, upper: TreeNode, length: int) -> None:
        upper.host_ready = child.host_ready
        upper.host_ref = child.host_ref
        upper.hits = child.hits
        if child.host_value is not None:
            cut = length // self.page_size
            upper.host_value = child.host_value[:cut].copy()
            child.host_value = child.host_value[cut:].copy()

    # --- protection -------------------------------------------------------------------------

    def protect(self, node: TreeNode) -> None:
        root = self.tree.root
        if node is root:
            return
        if node.parent is None:
            raise ValueError("protect_host(): the node was removed")
        node.host_here += 1
        while node is not root:
            node.host_ref += 1
            node = node.parent  # type: ignore[assignment]

    def release(self, node: TreeNode) -> None:
        root = self.tree.root
        if node is root:
            return
        if node.host_here <= 0 or node.parent is None:
            raise ValueError("release_host(): the node is not protected")
        node.host_here -= 1
        leaf = node
        while node is not root:
            node.host_ref -= 1
            node = node.parent  # type: ignore[assignment]
        self.rerank(leaf)

    def pinned(self) -> bool:
        return any(n.host_ref for n in self.tree.root.children.values())

    # --- backup (device -> host) ------------------------------------------------------------

    def after_use(self, path: list[TreeNode], inserted: bool) -> None:
        for node in path:
            node.hits += 1
        device = [n for n in path if not n.evicted]
        if not device:
            return
        if self.write_policy == "write_through" and inserted:
            self._backup(device[-1])
        elif self.write_policy == "write_through_selective":
            hot = [n for n in device if n.hits >= SELECTIVE_HITS and n.host_value is None]
            if hot:
                self._backup(hot[-1])

    def _backup(self, node: TreeNode, wait: bool = False) -> bool:
        """Start copying `node` and its ancestors that have no host copy to host, parents
        first. False (nothing changed) if host memory cannot be found."""
        root, path = self.tree.root, []
        while node is not root and node.host_value is None:
            path.append(node)
            node = node.parent  # type: ignore[assignment]
        if not path:
            return True
        path.reverse()
        deepest = path[-1]
        pages = self._alloc(sum(len(n) for n in path) // self.page_size)
        if pages is None:
            return False
        at = 0
        for n in path:
            count = len(n) // self.page_size
            n.host_value = pages[at : at + count].copy()
            at += count
        self._size += len(pages) * self.page_size
        self.tree.lock(deepest)  # the device pages are being read
        self.protect(deepest)  # the host pages are being written
        ticket = None
        if self.moves_kv:
            device = self._slots([n.value for n in path])  # type: ignore[misc]
            ticket = self.copier.to_host(device, self._slots([n.host_value for n in path]))
        self.writes.append((ticket, deepest))
        if wait:
            self.copier.wait(ticket)
        self.collect()
        return True

    def _alloc(self, num_pages: int) -> np.ndarray | None:
        pages = self.allocator.alloc_pages(num_pages)
        if pages is None:
            self.evict(num_pages * self.page_size - self.allocator.available_size())
            pages = self.allocator.alloc_pages(num_pages)
        return pages

    def _slots(self, pages: list[np.ndarray]) -> torch.Tensor:
        return torch.from_numpy(pages_to_slots(np.concatenate(pages), self.page_size))

    def collect(self) -> None:
        while self.writes and self.copier.done(self.writes[0][0]):
            _, deepest = self.writes.popleft()
            self._finish_write(deepest)

    def _finish_write(self, deepest: TreeNode) -> None:
        # The write covered `deepest` and the ancestors that were not yet backed up; a split
        # since then may have cut them in two, so walk up to the first ready ancestor.
        root, done, node = self.tree.root, [], deepest
        while node is not root and not node.host_ready:
            done.append(node)
            node = node.parent  # type: ignore[assignment]
        for n in reversed(done):
            n.host_ready = True
            if n.hashes:
                self._blocks.stored(n.hashes, last_block_hash(n.parent))  # type: ignore[arg-type]
        self.tree.unlock(deepest)
        self.release(deepest)

    def flush(self) -> None:
        while self.writes:
            self.copier.wait(self.writes[0][0])
            self.collect()

    # --- device eviction and load back ------------------------------------------------------

    def offload(self, node: TreeNode) -> bool:
        if node.host_value is None and self.write_policy == "write_back":
            if self._backup(node, wait=True):
                self.flush()
        if node.host_value is None:
            return False
        assert node.host_ready and not node.lock_ref, "demoting a node with a copy in flight"
        return True

    def loaded(self, node: TreeNode) -> None:
        node.host_heap_seq = -1  # no longer a host-eviction candidate

    def copy_to_device(self, path: list[TreeNode], pages: np.ndarray) -> None:
        host = self._slots([n.host_value for n in path])  # type: ignore[misc]
        self.copier.wait(self.copier.to_device(host, self._slots([pages])))

    # --- host eviction ----------------------------------------------------------------------

    def rerank(self, node: TreeNode) -> None:
        if node.evicted and not node.children and not node.host_ref and node.parent is not None:
            self._seq += 1
            node.host_heap_seq = self._seq
            heapq.heappush(self._heap, (node.last_access, self._seq, node))

    def evict(self, num_tokens: int) -> int:
        self.collect()
        root, freed, pages = self.tree.root, 0, []
        while freed < num_tokens and self._heap:
            _, seq, node = heapq.heappop(self._heap)
            if node.host_heap_seq != seq:
                continue
            node.host_heap_seq = -1
            if not node.evicted or node.children or node.host_ref or node.parent is None:
                continue
            parent = node.parent
            freed += len(node)
            pages.append(node.host_value)
            self._drop_copy(node)
            self.tree.detach(node)
            if parent is not root:
                self.rerank(parent)
        if pages:
            self.allocator.free_pages(np.concatenate(pages))
        return freed

    def _drop_copy(self, node: TreeNode) -> None:
        self._size -= len(node)
        if node.hashes and node.host_ready:
            self._blocks.removed(node.hashes)
        node.host_value = None
        node.host_ready = False

    # --- snapshot, reset, integrity ---------------------------------------------------------

    def snapshot(self) -> list[BlockStored]:
        return snapshot_stored(self.tree.root, HOST, lambda node: node.host_ready)

    def clear(self, nodes: list[TreeNode]) -> None:
        pages = [n.host_value for n in nodes if n.host_value is not None]
        if pages:
            self.allocator.free_pages(np.concatenate(pages))
        self._size = 0
        self._heap = []
        self._blocks.clear()

    def check(self, nodes: list[TreeNode]) -> None:
        root = self.tree.root
        assert root.host_ref == 0 and root.host_value is None, "root: must stay off the host tier"
        for node in nodes:
            self._check_node(node)
        self._check_heap(nodes)
        self._blocks.check(nodes, lambda n: n.host_ready)
        values = [n.host_value for n in nodes if n.host_value is not None]
        pages = np.concatenate(values) if values else np.zeros(0, dtype=np.int64)
        assert len(pages) * self.page_size == self._size, "host sizes: host_size drifted"
        slots = pages_to_slots(pages, self.page_size)
        size = self.allocator.size  # counts per slot: linear in the pool (see check_slots)
        owners = np.bincount(slots, minlength=size)
        assert owners.max(initial=0) <= 1, "host slots: a host page owned by two nodes"
        freed = np.bincount(self.allocator.free_slot_ids(), minlength=size)
        assert not (owners[:size] & freed[:size]).any(), "host slots: a tree slot is free"

    def _check_node(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None
        if parent is not self.tree.root:
            assert not (parent.evicted and not node.evicted), (
                "tiers: a node on device whose parent is not (device nodes must be prefix-closed)"
            )
            assert node.host_value is None or parent.host_value is not None, (
                "tiers: a node on host without its parent on host"
            )
        if node.evicted:
            assert node.host_value is not None and node.host_ready, (
                "tiers: a node is neither on device nor completely on host"
            )
            assert node.lock_ref == 0, "tiers: a node off the device is locked"
        assert node.host_ref >= 0 and node.host_here >= 0, "host refs: negative reference count"
        below = sum(child.host_ref for child in node.children.values())
        assert node.host_ref == node.host_here + below, (
            "host refs: count != protections ending here + children's counts"
        )
        if node.host_value is None:
            assert not node.host_ready, "tiers: host copy marked ready without host pages"
            return
        assert len(node.host_value) * self.page_size == len(node), (
            "host values: page count != token count / page"
        )
        assert node.host_value.flags.owndata, "host values: must be a copy, never a view"
        if not node.host_ready:
            assert node.lock_ref > 0 and node.host_ref > 0, (
                "in flight: a node being copied to host is not pinned on both tiers"
            )

    def _check_heap(self, nodes: list[TreeNode]) -> None:
        live = {seq: (use, node) for use, seq, node in self._heap if node.host_heap_seq == seq}
        for node in nodes:
            if not node.evicted or node.children or node.host_ref:
                continue
            entry = live.get(node.host_heap_seq)
            assert entry is not None and entry[1] is node, (
                "host eviction: a host-only leaf is missing from the candidates"
            )
            assert entry[0] == node.last_access, "host eviction: candidate ranked by a stale use"
