"""Radix (prefix) cache: token sequences -> the KV slots that hold them.

The tree maps token paths to slot ids. Each edge (`TreeNode`) holds whole pages of tokens. The
KV of a request's tokens lives in four regions, each with one owner at any moment:

    [cached prefix: tree nodes | new prompt + output: the request | session tail | free: allocator]

Ownership moves only in: `insert` (request -> tree), `evict` and `reset` (tree -> allocator).
`lock`/`unlock` pin a path (the request's cached prefix) against eviction without moving it.

Eviction is LRU over unlocked leaves, from a lazily maintained heap (`radix_evict`): no
`evict` walks the tree.

KV events follow blocks of `block_size` tokens counted from the root (independent of
`page_size`): a node reports `BlockStored` for the blocks that end inside it when it is
created and `BlockRemoved` for them when it is evicted; a split moves blocks between two nodes
and reports nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from mem_cache.allocator import (
    KVAllocator,
    SlotIds,
    as_int64_array,
)
from mem_cache.block_ledger import BlockLedger, snapshot_stored
from mem_cache.events import (
    DEVICE,
    HOST,
    AllCleared,
    KVEvent,
)
from mem_cache.host_cache import KVCopier
from mem_cache.radix_evict import LruEviction
from mem_cache.radix_host import HostTier
from mem_cache.radix_host_load import HostLoad
from mem_cache.radix_integrity import check_tree
from mem_cache.radix_node import TOKEN_BYTES, TreeNode, make_root
from mem_cache.radix_tree import RadixTree


@dataclass(frozen=True, slots=True, eq=False)
class MatchResult:
    """A prefix match. `indices` are the slots of the first `length` tokens (a fresh tensor;
    only safe to use while `node` is locked); `node` is where the match ended (the root on a
    miss); `host_length` counts tokens past `length` that only the host tier holds, ending at
    `host_node`. Unpacks as `indices, node, length` (the fields DESIGN.md names)."""

    indices: torch.Tensor
    node: TreeNode
    length: int
    host_length: int = 0
    host_node: TreeNode | None = None

    def __iter__(self) -> Iterator[object]:
        return iter((self.indices, self.node, self.length))


class RadixCache(RadixTree, LruEviction, HostTier, HostLoad):
    """Radix tree from token sequences to slot ids; see the module docstring and DESIGN.md.

    With `allocator=None` it is a pure index: nothing is freed, `indices` may be omitted on
    insert, and a match returns empty `indices` unless every node on its path was given slots.
    """

    def __init__(
        self,
        allocator: KVAllocator | None,
        page_size: int = 1,
        block_size: int = 16,
        host_allocator: KVAllocator | None = None,
        write_policy: str = "write_through",
        copier: KVCopier | None = None,
        load_back_min: int = 0,
    ) -> None:
        if page_size <= 0 or block_size <= 0:
            raise ValueError("page_size and block_size must be positive")
        if allocator is not None and allocator.page_size != page_size:
            raise ValueError(
                f"allocator page_size {allocator.page_size} != cache page_size {page_size}"
            )
        self.allocator = allocator
        self.page_size = page_size
        self.block_size = block_size
        self._page_bytes = page_size * TOKEN_BYTES
        self._events: list[KVEvent] = []
        self._device_blocks = BlockLedger(self._events, DEVICE, block_size % page_size != 0)
        self._tick = 0
        self._seq = 0
        self._init_host(host_allocator, write_policy, copier, load_back_min)
        self._new_tree()

    def _new_tree(self) -> None:
        self.root = make_root()
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._device_blocks.clear()
        self._reset_host()

    # --- sizes ------------------------------------------------------------------------------

    def evictable_size(self) -> int:
        """Cached tokens on no locked path."""
        return self._evictable

    def protected_size(self) -> int:
        """Cached tokens on some locked path."""
        return self._protected

    def total_size(self) -> int:
        """All cached tokens (the root counts for nothing)."""
        return self._evictable + self._protected

    def num_nodes(self) -> int:
        return self._num_nodes

    # --- lookup and insertion ---------------------------------------------------------------

    def match_prefix(self, tokens: object, namespace: str | None = None) -> MatchResult:
        """Longest cached page-aligned prefix of `tokens`. Takes no lock; refreshes recency.

        A match ending inside a node splits it so that `.node` ends exactly at the match.
        """
        arr = as_int64_array(tokens)
        n = len(arr) // self.page_size * self.page_size
        node, pos, path = self._walk(arr[:n].tobytes(), namespace)
        self._touch(path)
        if self.host_allocator is None:
            return MatchResult(self._gather(path), node, pos)
        return self._match_with_host(path, node, pos)

    def insert(
        self, tokens: object, indices: SlotIds | None = None, namespace: str | None = None
    ) -> int:
        """Cache the page-aligned prefix of `tokens`; return how many tokens were cached before.

        Needs `len(indices) >= aligned_len`. Afterwards the tree owns
        `indices[returned:aligned_len]`; the caller still owns `indices[:returned]` (duplicates
        it must free) and `indices[aligned_len:]` (the unaligned tail).
        """
        arr = as_int64_array(tokens)
        n = len(arr) // self.page_size * self.page_size
        values = None if indices is None else as_int64_array(indices)
        if values is None and self.allocator is not None:
            raise ValueError("insert() needs indices when the cache has an allocator")
        if values is not None and len(values) < n:
            raise ValueError(f"insert(): {len(values)} indices for {n} aligned tokens")
        query = arr[:n].tobytes()
        node, pos, path = self._walk(query, namespace)
        self._touch(path)
        if self.host_allocator is not None:
            self._collect_writes()
        cached = pos if self.host_allocator is None else self._promote(path, values)
        if pos < n:
            path.append(self._add_leaf(node, query, arr, pos, n, values, namespace))
        if self.host_allocator is not None:
            self._backup_after_use(path, inserted=True)
        return cached

    def _touch(self, path: list[TreeNode]) -> None:
        self._tick += 1
        for node in path:
            node.last_access = self._tick
        if not path:
            return
        last = path[-1]  # its heap position must follow its new last use
        if self.host_allocator is None:
            if not last.children and last.lock_ref == 0:
                self._push(last)
            return
        last_device = None
        for node in path:
            node.hits += 1
            if not node.evicted:
                last_device = node
        if last.evicted:
            self._maybe_host_candidate(last)
        if last_device is not None and self._is_device_leaf(last_device):
            self._push(last_device)

    # --- locks ------------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """Protect the path root..node from eviction (counted; the root is a no-op)."""
        if node is self.root:
            return
        if node.parent is None or node.evicted:
            raise ValueError("lock(): the node is not on device")
        node.locks_here += 1
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node)
                self._protected += len(node)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        """Release one `lock(node)`. Raises `ValueError`, changing nothing, if `node` holds no
        lock of its own (a lock taken on a descendant is released through the descendant)."""
        if node is self.root:
            return
        if node.locks_here <= 0:
            raise ValueError("unlock(): the node is not locked")
        node.locks_here -= 1
        leaf = node
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node)
                self._evictable += len(node)
            node = node.parent  # type: ignore[assignment]
        if leaf.lock_ref == 0 and (not leaf.children or self._is_device_leaf(leaf)):
            self._push(leaf)

    # --- events, reset, integrity -------------------------------------------------------------

    def take_events(self) -> list[KVEvent]:
        """KV events since the last call, oldest first."""
        events = self._events[:]
        self._events.clear()  # the ledgers append to this very list
        return events

    def snapshot_events(self) -> list[KVEvent]:
        """`AllCleared` then `BlockStored` for every fully cached block, parents first (device
        blocks, then host copies with `medium="host"`)."""
        self._collect_writes()
        events: list[KVEvent] = [AllCleared()]
        events += snapshot_stored(self.root, DEVICE, lambda node: not node.evicted)
        if self.host_allocator is not None:
            events += snapshot_stored(self.root, HOST, lambda node: node.host_ready)
        return events

    def reset(self) -> None:
        """Free every slot of the tree (both tiers) and report one `AllCleared`. Waits for
        copies in flight; refused while a path is locked or host-protected."""
        self.flush()
        if self._protected or any(n.host_ref for n in self.root.children.values()):
            raise ValueError("reset(): some path is locked or host-protected")
        pages, host_pages = [], []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.value is not None:
                pages.append(node.value)
            if node.host_value is not None:
                host_pages.append(node.host_value)
            node.parent = None
            node.value = None
        if pages and self.allocator is not None:
            self.allocator.free_pages(np.concatenate(pages))
        if host_pages and self.host_allocator is not None:
            self.host_allocator.free_pages(np.concatenate(host_pages))
        self._new_tree()
        self._events.append(AllCleared())

    def check_integrity(self) -> None:
        """Raise `AssertionError` naming the first violated invariant (see radix_integrity)."""
        check_tree(self)
