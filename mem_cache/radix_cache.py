"""Radix (prefix) cache: token sequences -> the KV slots that hold them.

The tree maps token paths to slot ids. Each edge (`TreeNode`) holds whole pages of tokens. The
KV of a request's tokens lives in four regions, each with one owner at any moment:

    [cached prefix: tree nodes | new prompt + output: the request | session tail | free: allocator]

Ownership moves only in: `insert` (request -> tree), `evict` and `reset` (tree -> allocator).
`lock`/`unlock` pin a path (the request's cached prefix) against eviction without moving it.

Eviction is LRU over unlocked device leaves, from a lazy min-heap keyed by last use: a node is
pushed whenever it becomes (or, touched, stays) an unlocked leaf, and an entry is live only
while its sequence number is the node's `heap_seq`; stale entries are skipped on pop and the
heap is compacted when they outnumber the nodes. No `evict` walks the tree.

The host tier (`radix_host`) is an object the cache owns and calls on insert and match, on
device eviction (demote a node with a host copy instead of removing it), on a match that runs
on into host-only nodes, on load back, and on reset; without host memory it is `NoHostTier`,
whose hooks do nothing. Device nodes are prefix-closed: a node is on device (`not evicted`) only
if its parent is.

KV events follow blocks of `block_size` tokens counted from the root (independent of
`page_size`): a node reports `BlockStored` for the blocks that end inside it when it gains the
device and `BlockRemoved` when it loses it; a split moves blocks between two nodes and reports
nothing.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sized
from dataclasses import dataclass

import numpy as np
import torch

from mem_cache.allocator import KVAllocator, SlotIds, as_int64_array, pages_to_slots, slots_to_pages
from mem_cache.block_ledger import BlockLedger, snapshot_stored
from mem_cache.events import (
    DEVICE,
    HOST,
    AllCleared,
    KVEvent,
    extend_block_states,
    hash_block_states,
)
from mem_cache.host_cache import KVCopier
from mem_cache.radix_host import new_host_tier
from mem_cache.radix_integrity import check_eviction_heap, check_nodes, check_sizes, check_slots
from mem_cache.radix_node import (
    TOKEN_BYTES,
    TreeNode,
    common_prefix_tokens,
    descendants,
    last_block_hash,
    make_root,
    path_below,
)

_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True, slots=True, eq=False)
class MatchResult:
    """A prefix match. `indices` are the slots of the first `length` tokens (a fresh tensor;
    only safe to use while `node` is locked); `node` is where the match ended (the root on a
    miss); `host_length` counts tokens past `length` that only the host tier holds, ending at
    `host_node`. Unpacks as `indices, node, length`, the contract's three fields."""

    indices: torch.Tensor
    node: TreeNode
    length: int
    host_length: int = 0
    host_node: TreeNode | None = None

    def __iter__(self) -> Iterator[object]:
        return iter((self.indices, self.node, self.length))


class RadixCache:
    """Radix tree from token sequences to slot ids; see the module docstring and docs/mem_cache.md.

    With `allocator=None` it is a pure index: nothing is freed, `indices` may be omitted on
    insert, and a match returns empty `indices` unless every node on its path was given slots.
    `host_allocator` (host pages) adds a host tier; `load_back_min` is the shortest host hit
    worth loading back.
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
        for alloc in (allocator, host_allocator):
            if alloc is not None and alloc.page_size != page_size:
                raise ValueError(f"allocator page_size {alloc.page_size} != cache's {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.block_size = block_size
        self.load_back_min = load_back_min
        self._page_bytes = page_size * TOKEN_BYTES
        self._events: list[KVEvent] = []
        split_blocks = block_size % page_size != 0  # two siblings may hold one block
        self._device_blocks = BlockLedger(self._events, DEVICE, split_blocks)
        self._host = new_host_tier(
            self, host_allocator, write_policy, copier,
            BlockLedger(self._events, HOST, split_blocks), moves_kv=allocator is not None,
        )
        self._tick = 0
        self._seq = 0
        self._new_tree()

    def _new_tree(self) -> None:
        self.root = make_root()
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._device_blocks.clear()

    # --- sizes ------------------------------------------------------------------------------

    def evictable_size(self) -> int:
        """Cached device tokens on no locked path."""
        return self._evictable

    def protected_size(self) -> int:
        """Cached device tokens on some locked path."""
        return self._protected

    def total_size(self) -> int:
        """All cached device tokens (the root counts for nothing)."""
        return self._evictable + self._protected

    def num_nodes(self) -> int:
        return self._num_nodes

    # --- lookup and insertion ---------------------------------------------------------------

    def match_prefix(self, tokens: object, namespace: str | None = None) -> MatchResult:
        """Longest cached page-aligned prefix of `tokens`. Takes no lock; refreshes recency.

        A match ending inside a node splits it so that `.node` ends exactly at the match. The
        part of the match that only the host tier holds is `.host_length` past `.length`.
        """
        arr = as_int64_array(tokens)
        n = len(arr) // self.page_size * self.page_size
        node, pos, path = self._walk(arr[:n].tobytes(), namespace)
        self._touch(path)
        self._host.collect()
        self._host.after_use(path, inserted=False)
        if not path or not path[-1].evicted:
            return MatchResult(self._gather(path), node, pos)
        on_device = _device_prefix(path)
        host = path[on_device:]
        host_length = sum(len(n) for n in host)
        end = path[on_device - 1] if on_device else self.root
        device = self._gather(path[:on_device])
        return MatchResult(device, end, pos - host_length, host_length, host[-1])

    def insert(
        self, tokens: object, indices: SlotIds | None = None, namespace: str | None = None
    ) -> int:
        """Cache the page-aligned prefix of `tokens`; return how many tokens were cached on
        device before.

        Needs `len(indices) >= aligned_len`. Afterwards the tree owns
        `indices[returned:aligned_len]`; the caller still owns `indices[:returned]` (duplicates
        it must free) and `indices[aligned_len:]` (the unaligned tail). Host-only nodes on the
        path take the caller's slots for them (they are back on device).
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
        self._host.collect()
        cached = self._promote(path, values) if path and path[-1].evicted else pos
        if pos < n:
            path.append(self._add_leaf(node, query, arr, pos, n, values, namespace))
        self._host.after_use(path, inserted=True)
        return cached

    def _touch(self, path: list[TreeNode]) -> None:
        self._tick += 1
        for node in path:
            node.last_access = self._tick
        if not path:
            return
        last = path[-1]  # its heap position must follow its new last use
        if last.evicted:
            self._host.rerank(last)
            on_device = _device_prefix(path)
            if not on_device:
                return
            last = path[on_device - 1]
        if not last.lock_ref and (not last.children or self._is_device_leaf(last)):
            self._push(last)

    def _promote(self, path: list[TreeNode], values: np.ndarray | None) -> int:
        """Insert over host-only nodes: they take the caller's device slots. Returns the
        device-cached length before (what the caller holds duplicates of)."""
        cached = 0
        for node in path:
            if not node.evicted:
                cached = node.end
                continue
            pages = None if values is None else self._pages_of(values, node.start, node.end)
            self._to_device(node, pages)
        return cached

    # --- tree shape: walk, split, grow --------------------------------------------------------

    def _walk(self, query: bytes, namespace: str | None) -> tuple[TreeNode, int, list[TreeNode]]:
        """Follow `query` (int64 bytes, page-aligned) down the tree, splitting a partly matched
        node. Returns the last node, the matched length in tokens and the path (root excluded)."""
        node, pos, path = self.root, 0, []
        page, end = self._page_bytes, len(query)
        while pos < end:
            first = query[pos : pos + page]
            child = node.children.get((namespace, first) if node is self.root else first)
            if child is None:
                break
            key = child.key
            if query.startswith(key, pos):
                pos += len(key)
                node = child
                path.append(child)
                continue
            shared = common_prefix_tokens(key, query, pos) // self.page_size * self.page_size
            node = self._split(child, shared)
            path.append(node)
            pos += shared * TOKEN_BYTES
            break
        return node, pos // TOKEN_BYTES, path

    def _split(self, child: TreeNode, length: int) -> TreeNode:
        """Cut `child` after `length` tokens; the new upper node takes its place and is returned.

        `child` keeps denoting the same path end (handles stay valid); locks, sizes, last use
        and events are unchanged because both halves carry the old node's state.
        """
        upper = child.split(length, self.page_size, self.block_size)
        self._host.split(child, upper, length)
        upper.parent.children[self._child_key(upper)] = upper  # type: ignore[union-attr]
        self._num_nodes += 1
        return upper

    def _add_leaf(
        self,
        parent: TreeNode,
        query: bytes,
        arr: np.ndarray,
        pos: int,
        n: int,
        values: np.ndarray | None,
        namespace: str | None,
    ) -> TreeNode:
        """Hang tokens `pos..n` under `parent` (which ends at `pos`); the tree takes their slots."""
        states, state = extend_block_states(arr[pos:n], pos, parent.hash_state, self.block_size)
        hashes = hash_block_states(states, namespace)
        value = None if values is None else self._pages_of(values, pos, n)
        key = query[pos * TOKEN_BYTES :]
        leaf = TreeNode(parent, key, value, namespace, pos, hashes, states, state, self._tick)
        parent.children[self._child_key(leaf)] = leaf
        self._evictable += n - pos
        self._num_nodes += 1
        self._push(leaf)
        if hashes:
            self._device_blocks.stored(hashes, last_block_hash(parent))
        return leaf

    def _pages_of(self, values: np.ndarray, start: int, end: int) -> np.ndarray:
        """The pages of the caller's slots `values[start:end]` (whole pages), as a copy."""
        pages = slots_to_pages(values[start:end], self.page_size)
        return pages.copy() if self.page_size == 1 else pages  # page_size > 1: already new

    def _child_key(self, node: TreeNode) -> object:
        first = node.key[: self._page_bytes]
        return (node.namespace, first) if node.parent is self.root else first

    def detach(self, node: TreeNode) -> None:
        """Take a leaf with no device pages out of the tree (the host tier drops host-only
        leaves with it; device eviction uses it after freeing a leaf's pages)."""
        assert not node.children and node.lock_ref == 0, "only unlocked leaves are removed"
        del node.parent.children[self._child_key(node)]  # type: ignore[union-attr]
        self._num_nodes -= 1
        node.parent = None

    def _gather(self, path: list[TreeNode]) -> torch.Tensor:
        values = []
        for node in path:
            if node.value is None:  # a pure index that was not given slots here
                return _EMPTY.clone()
            values.append(node.value)
        if not values:
            return _EMPTY.clone()
        # Joining the int64 buffers costs half of np.concatenate for a path of small arrays,
        # and gives a new writable array (so page size 1 needs no second copy).
        pages = np.frombuffer(bytearray().join(values), dtype=np.int64)
        slots = pages if self.page_size == 1 else pages_to_slots(pages, self.page_size)
        return torch.from_numpy(slots)

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
        if self._is_device_leaf(leaf):
            self._push(leaf)

    # --- device eviction --------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Take unlocked leaves off the device, least recently used first, until `num_tokens`
        are freed or nothing is evictable; a parent left an unlocked leaf becomes a candidate
        with its own last use. A node with a host copy is demoted to host (it stays matchable
        there) instead of removed. Returns the device tokens freed."""
        self._host.collect()
        freed, pages = 0, []
        while freed < num_tokens and self._heap:
            _, seq, node = heapq.heappop(self._heap)
            if node.heap_seq != seq:
                continue
            node.heap_seq = -1
            if not self._is_device_leaf(node):
                continue
            freed += len(node)
            parent = node.parent
            if node.value is not None:
                pages.append(node.value)
            if self._host.offload(node):
                self._off_device(node)
            else:
                self._remove_leaf(node)
            if parent is not self.root and self._is_device_leaf(parent):  # type: ignore[arg-type]
                self._push(parent)  # type: ignore[arg-type]
        if pages and self.allocator is not None:
            self.allocator.free_pages(np.concatenate(pages))
        return freed

    def _is_device_leaf(self, node: TreeNode) -> bool:
        """On device, unlocked, and no child on device: an eviction candidate."""
        if node.evicted or node.lock_ref or node.parent is None:
            return False
        for child in node.children.values():  # a loop: no generator per call
            if not child.evicted:
                return False
        return True

    def _remove_leaf(self, node: TreeNode) -> None:
        """Detach an unlocked device leaf whose pages the caller frees."""
        self._evictable -= len(node)
        if node.hashes:
            self._device_blocks.removed(node.hashes)
        self.detach(node)
        node.value = None

    def _off_device(self, node: TreeNode) -> None:
        """Demote an unlocked device leaf whose pages the caller frees: it stays on host."""
        node.value = None
        node.evicted = True
        self._evictable -= len(node)
        if node.hashes:
            self._device_blocks.removed(node.hashes)
        self._host.rerank(node)

    def _to_device(self, node: TreeNode, pages: np.ndarray | None) -> None:
        """A host-only node is back on device, in `pages` (None in a pure index)."""
        node.value = pages
        node.evicted = False
        self._evictable += len(node)
        self._host.loaded(node)
        if node.hashes:
            self._device_blocks.stored(node.hashes, last_block_hash(node.parent))  # type: ignore[arg-type]
        if self._is_device_leaf(node):
            self._push(node)

    def _push(self, node: TreeNode) -> None:
        self._seq += 1
        node.heap_seq = self._seq
        heapq.heappush(self._heap, (node.last_access, self._seq, node))
        if len(self._heap) > 2 * self._num_nodes + 1024:
            # Drop stale entries (amortised: runs after more pushes than there are nodes).
            self._heap = [e for e in self._heap if e[2].heap_seq == e[1]]
            heapq.heapify(self._heap)

    # --- the host tier ----------------------------------------------------------------------

    @property
    def host_allocator(self) -> KVAllocator | None:
        """The host tier's page allocator (None: no host tier)."""
        return self._host.allocator

    @property
    def copier(self) -> KVCopier:
        """Moves KV between device and host slots."""
        return self._host.copier

    @copier.setter
    def copier(self, copier: KVCopier) -> None:
        self._host.copier = copier

    @property
    def _writes(self) -> Sized:
        """Copies to host in flight (tests read it)."""
        return self._host.writes

    def host_size(self) -> int:
        """Tokens with a host copy (complete or in flight)."""
        return self._host.size()

    def evict_host(self, num_tokens: int) -> int:
        """Remove host-only leaves that nothing pins, least recently used first, until
        `num_tokens` host tokens are freed or none is left; returns the tokens freed."""
        return self._host.evict(num_tokens)

    def protect_host(self, node: TreeNode) -> None:
        """Pin the host copies of the path root..node against `evict_host` (counted)."""
        self._host.protect(node)

    def release_host(self, node: TreeNode) -> None:
        """Release one `protect_host(node)`; `ValueError`, changing nothing, if it has none."""
        self._host.release(node)

    def flush(self) -> None:
        """Wait for every copy in flight and finish its bookkeeping."""
        self._host.flush()

    def load_back(self, result: MatchResult) -> MatchResult:
        """Copy the host-only part of a match to device, all or nothing. Returns a result
        whose `.length` covers it, or `result` unchanged when it is shorter than
        `load_back_min`, when device memory cannot be found, or when there is nothing to load."""
        host_end = result.host_node
        if not result.host_length or host_end is None or result.host_length < self.load_back_min:
            return result
        if host_end.parent is None or not host_end.evicted:
            raise ValueError("load_back(): the match is stale (its nodes changed)")
        if not self._load(path_below(result.node, host_end), result.node):
            return result
        full = path_below(self.root, host_end)
        return MatchResult(self._gather(full), host_end, result.length + result.host_length)

    def _load(self, path: list[TreeNode], device_end: TreeNode) -> bool:
        need = sum(len(n) for n in path) // self.page_size
        pages = None
        self.lock(device_end)  # the device prefix and the host path must survive the
        self._host.protect(path[-1])  # evictions that making room may cause
        try:
            if self.allocator is not None:
                pages = self.allocator.alloc_pages(need)
                if pages is None:
                    self.evict(need * self.page_size - self.allocator.available_size())
                    pages = self.allocator.alloc_pages(need)
                if pages is None:
                    return False
                self._host.copy_to_device(path, pages)
            at = 0
            for n in path:
                count = len(n) // self.page_size
                self._to_device(n, None if pages is None else pages[at : at + count].copy())
                at += count
        finally:
            self._host.release(path[-1])
            self.unlock(device_end)
        return True

    # --- events, reset, integrity -----------------------------------------------------------

    def take_events(self) -> list[KVEvent]:
        """KV events since the last call, oldest first."""
        events = self._events[:]
        self._events.clear()  # the ledgers append to this very list
        return events

    def snapshot_events(self) -> list[KVEvent]:
        """`AllCleared` then `BlockStored` for every fully cached block, parents first (device
        blocks, then host copies with `medium="host"`)."""
        self._host.collect()
        events: list[KVEvent] = [AllCleared()]
        events += snapshot_stored(self.root, DEVICE, lambda node: not node.evicted)
        events += self._host.snapshot()
        return events

    def reset(self) -> None:
        """Free every slot of the tree (both tiers) and report one `AllCleared`. Waits for
        copies in flight; refused while a path is locked or host-protected."""
        self.flush()
        if self._protected or self._host.pinned():
            raise ValueError("reset(): some path is locked or host-protected")
        nodes = descendants(self.root)
        pages = [n.value for n in nodes if n.value is not None]
        if pages and self.allocator is not None:
            self.allocator.free_pages(np.concatenate(pages))
        self._host.clear(nodes)
        for node in nodes:
            node.parent = None
            node.value = None
        self._new_tree()
        self._events.append(AllCleared())

    def check_integrity(self) -> None:
        """Raise `AssertionError` naming the first violated invariant (see radix_integrity)."""
        nodes = check_nodes(
            self.root, self._num_nodes, self.page_size, self.block_size, self.allocator is not None
        )
        check_sizes(nodes, self._evictable, self._protected, self.total_size())
        check_eviction_heap(self.root, self._heap, nodes)
        self._device_blocks.check(nodes, lambda n: not n.evicted)
        if self.allocator is not None:
            check_slots(nodes, self.allocator, self.total_size())
        self._host.check(nodes)


def _device_prefix(path: list[TreeNode]) -> int:
    """How many leading nodes of a path are on device (device nodes are prefix-closed)."""
    on_device = len(path)
    while on_device and path[on_device - 1].evicted:
        on_device -= 1
    return on_device
