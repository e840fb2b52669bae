"""Radix cache with components: the prefix cache of a hybrid model.

A hybrid model keeps several kinds of KV, one per *group* of layers (`events.KVGroup`): full
attention (the KV of every token), sliding-window attention (each group keeps the last `W`
tokens' KV in its own pool), recurrent layers (one state that summarises the whole prefix). One
tree serves them all; each `HybridNode` holds its edge's full-attention pages, each window
group's pages (`None` once evicted: the node is a *tombstone* for that group) and at most one
recurrent state saved at its END (see `hybrid_node`).

Resume rule. A cached prefix of length `p` can serve a new request only if every group can resume
there: full KV for `[0, p)`, for each window group the window KV of `[max(0, p - W), p)` (no
tombstone there), and a recurrent state saved exactly at `p`. `match_prefix` returns the longest
such `p` on the matched path (it is always a node end) and cuts longer full-KV matches back to it.

Components. Each group has its own accounting (`evictable_size(g)`, `protected_size(g)`; tokens,
states for the recurrent group), its own LRU and its own eviction:

- `evict` (full KV): unlocked device leaves, least recently used first; a removed leaf frees all
  of its components;
- `evict_window(g, n)`: unprotected window KV; an inner node becomes a tombstone for `g`, a leaf
  is removed (no device leaf is a tombstone) and the removal cascades up through parents that
  are then tombstoned leaves, unless they are pinned (locked, or referenced by the host tier);
- `evict_states(n)`: unlocked states, independently of the tree's shape.

One `lock(node)` protects, per component, the full KV of root..node, each window group's KV of
the `W` tokens before the node's end, and the state at its end.

Ownership is as in `RadixCache`: `insert` moves slots from the request to the tree (and says which
it did not take), eviction and `reset` from the tree to the allocators.

Events: every block event carries its group. A block is stored in the full group while its full
KV is cached, in a window group while its window KV is, and in the recurrent group while a state
saved at the block's end is. The host tier (`hybrid_host`) reports its copies with
`medium="host"` the same way.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from mem_cache.allocator import KVAllocator, SlotIds, as_int64_array, pages_to_slots, slots_to_pages
from mem_cache.block_ledger import BlockLedger
from mem_cache.events import (
    DEVICE,
    FULL_ATTENTION,
    HOST,
    RECURRENT,
    SLIDING_WINDOW,
    AllCleared,
    BlockStored,
    KVEvent,
    KVGroup,
    extend_block_states,
    hash_block_states,
)
from mem_cache.host_cache import KVCopier
from mem_cache.hybrid_host import HybridHostTier
from mem_cache.hybrid_integrity import check_hybrid
from mem_cache.hybrid_node import NO_STATE, HybridNode
from mem_cache.radix_node import (
    TOKEN_BYTES,
    common_prefix_tokens,
    descendants,
    last_block_hash,
    path_below,
)

_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True, slots=True, eq=False)
class HybridMatch:
    """A resume point. `length` tokens can be resumed (every group can); `node` ends there (the
    root on a miss). `full`: full-attention slots of `[0, length)`; `windows[g] = (start, ids)`:
    group `g`'s window slots of `[start, length)`; `state`: the state slot saved at `length`
    (None without a recurrent group or on a miss); the engine copies it, the tree keeps it.
    `full_length`: how far full KV alone matched on device. `host_length`: tokens past `length`
    that `load_back` can make resumable, ending at `host_node`. Unpacks as `full, node, length`.
    Slot ids are only safe to use while `node` is locked."""

    full: torch.Tensor
    node: HybridNode
    length: int
    windows: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    state: int | None = None
    full_length: int = 0
    host_length: int = 0
    host_node: HybridNode | None = None

    def __iter__(self) -> Iterator[object]:
        return iter((self.full, self.node, self.length))


@dataclass(frozen=True, slots=True, eq=False)
class InsertResult:
    """What `insert` did. `prefix_len`: tokens whose full KV was cached on device before. `node`
    ends at the aligned end. `unused_*`: the ids the caller gave that the tree does not hold
    afterwards (duplicates of what it had), still the caller's to free; ids equal to the tree's
    own (a match's) are not listed, and ids past the aligned end are never taken nor listed."""

    prefix_len: int
    node: HybridNode
    unused_full: np.ndarray
    unused_windows: dict[int, np.ndarray]
    unused_states: list[int]


def _not_in(ids: np.ndarray, held: np.ndarray) -> np.ndarray:
    """`ids` that are not in `held` (a copy)."""
    return ids[~np.isin(ids, held)].copy()


class HybridRadixCache:
    """Radix tree from token sequences to the KV of every group of a hybrid model; see the module
    docstring and docs/mem_cache.md."""

    def __init__(
        self,
        groups: list[KVGroup] | tuple[KVGroup, ...],
        allocators: list[KVAllocator | None] | tuple[KVAllocator | None, ...],
        page_size: int = 1,
        block_size: int = 16,
        host_allocators: list[KVAllocator] | tuple[KVAllocator, ...] | None = None,
        write_policy: str = "write_through",
        copiers: Mapping[int, KVCopier] | None = None,
    ) -> None:
        if page_size <= 0 or block_size <= 0:
            raise ValueError("page_size and block_size must be positive")
        self.groups = tuple(groups)
        if len(allocators) != len(self.groups):
            raise ValueError("one allocator per group (None for a pure index)")
        kinds = [g.kind for g in self.groups]
        if kinds.count(FULL_ATTENTION) != 1 or kinds.count(RECURRENT) > 1:
            raise ValueError("exactly one full-attention group and at most one recurrent group")
        if len({g.index for g in self.groups}) != len(self.groups):
            raise ValueError("group indices must be distinct")
        if any(a is None for a in allocators):
            raise ValueError("every group needs its allocator")
        self.page_size = page_size
        self.block_size = block_size
        self.allocators: tuple[KVAllocator, ...] = tuple(allocators)  # type: ignore[arg-type]
        self.full = kinds.index(FULL_ATTENTION)  # component positions in `groups`
        self.window_pos = [c for c, k in enumerate(kinds) if k == SLIDING_WINDOW]
        self.window_sizes = [self.groups[c].window or 0 for c in self.window_pos]
        self.widest = max(self.window_sizes, default=0)
        self.recurrent = kinds.index(RECURRENT) if RECURRENT in kinds else None
        for c, alloc in enumerate(self.allocators):
            want = 1 if c == self.recurrent else page_size
            if alloc.page_size != want:
                raise ValueError(f"group {self.groups[c].index}: allocator page_size != {want}")
        self._page_bytes = page_size * TOKEN_BYTES
        self._events: list[KVEvent] = []
        self.ledgers = [BlockLedger(self._events, DEVICE, True, g) for g in self.groups]
        self._tick = 0
        self._seq = 0
        self.host = HybridHostTier(
            self, host_allocators, write_policy, copiers,
            [BlockLedger(self._events, HOST, True, g) for g in self.groups],
        )
        self._new_tree()

    def _new_tree(self) -> None:
        self.root = HybridNode(
            None, b"", None, None, 0, [], np.zeros(0, dtype=np.uint64), 0, 0,
            num_windows=len(self.window_pos), num_components=len(self.groups),
        )
        self._evictable = [0] * len(self.groups)
        self._protected = [0] * len(self.groups)
        self._num_nodes = 0
        self._heaps: list[list[tuple[int, int, HybridNode]]] = [[] for _ in self.groups]
        for ledger in self.ledgers:
            ledger.clear()

    # --- sizes ------------------------------------------------------------------------------

    def _component(self, group: int) -> int:
        for c, g in enumerate(self.groups):
            if g.index == group:
                return c
        raise ValueError(f"no KV group {group}")

    def evictable_size(self, group: int | None = None) -> int:
        """Cached device tokens (states, for the recurrent group) that nothing protects; the
        full-attention group's by default."""
        return self._evictable[self.full if group is None else self._component(group)]

    def protected_size(self, group: int | None = None) -> int:
        """Cached device tokens (states) of `group` that some lock protects."""
        return self._protected[self.full if group is None else self._component(group)]

    def total_size(self, group: int | None = None) -> int:
        c = self.full if group is None else self._component(group)
        return self._evictable[c] + self._protected[c]

    def num_nodes(self) -> int:
        return self._num_nodes

    # --- what a node holds, per component ---------------------------------------------------

    def holds(self, node: HybridNode, c: int) -> bool:
        """Whether `node` holds component `c` on device."""
        if node.evicted:
            return False
        if c == self.full:
            return True
        if c == self.recurrent:
            return node.state != NO_STATE
        return node.windows[self.window_pos.index(c)] is not None

    def blocks(self, node: HybridNode, c: int) -> list[int]:
        """The blocks component `c` of `node` stands for: the blocks that end inside the node,
        or for the recurrent group the block that ends exactly at the node's end."""
        if c != self.recurrent:
            return node.hashes
        if node.hashes and node.end % self.block_size == 0:
            return node.hashes[-1:]
        return []

    def block_before(self, node: HybridNode, c: int) -> int | None:
        """The block preceding `blocks(node, c)` in the chain."""
        hashes = node.hashes
        if c == self.recurrent and len(hashes) >= 2:
            return hashes[-2]
        return last_block_hash(node.parent)  # type: ignore[arg-type]

    def _protects(self, node: HybridNode, c: int) -> bool:
        """Whether a lock protects `node`'s component `c` (which it holds)."""
        if c == self.full:
            return node.lock_ref > 0
        if c == self.recurrent:
            return node.locks_here > 0
        return node.window_locked(self.window_sizes[self.window_pos.index(c)])

    def _count(self, node: HybridNode, c: int, amount: int) -> None:
        """Add `amount` to component `c`'s size on the side `node` is on (protected or not)."""
        if self._protects(node, c):
            self._protected[c] += amount
        else:
            self._evictable[c] += amount

    def _size_of(self, node: HybridNode, c: int) -> int:
        return 1 if c == self.recurrent else len(node)

    # --- lookup -----------------------------------------------------------------------------

    def match_prefix(self, tokens: object, namespace: str | None = None) -> HybridMatch:
        """The longest resume point of `tokens` (see the module docstring). Takes no lock;
        refreshes the recency of the matched path."""
        arr = as_int64_array(tokens)
        n = len(arr) // self.page_size * self.page_size
        _, _, path = self._walk(arr[:n].tobytes(), namespace)
        self._touch(path)
        self.host.after_use(path, inserted=False)
        return self._result(path)

    def _result(self, path: list[HybridNode]) -> HybridMatch:
        on_device = 0
        while on_device < len(path) and not path[on_device].evicted:
            on_device += 1
        best = self._resume(path[:on_device])
        best_all = self._resume(path) if on_device < len(path) else best
        node = path[best - 1] if best else self.root
        length = node.end
        full = self._gather([n.value for n in path[:best]])
        windows = {}
        for i, c in enumerate(self.window_pos):
            start = max(0, length - self.window_sizes[i]) // self.page_size * self.page_size
            nodes = [n for n in path[:best] if n.end > start]
            ids = self._gather([n.windows[i] for n in nodes])
            if nodes:
                ids = ids[start - nodes[0].start :]
            windows[self.groups[c].index] = (start, ids)
        state = None
        if self.recurrent is not None and best:
            state = node.state
        host_node = path[best_all - 1] if best_all > best else None
        host_length = host_node.end - length if host_node is not None else 0
        full_length = path[on_device - 1].end if on_device else 0
        return HybridMatch(full, node, length, windows, state, full_length, host_length, host_node)

    def _resume(self, path: list[HybridNode]) -> int:
        """How many leading nodes of `path` reach its deepest resume point (0: the root). A
        host-only node counts with its host copies (what a load back would restore)."""
        last_tomb = [None] * len(self.window_pos)  # end of the last tombstone so far, per group
        best = 0
        for k, node in enumerate(path):
            wins = node.host_windows if node.evicted else node.windows
            state = node.host_state if node.evicted else node.state
            ok = self.recurrent is None or state != NO_STATE
            for i, pages in enumerate(wins):
                tomb = last_tomb[i]
                if pages is None:
                    ok = False
                elif tomb is not None and node.end < tomb + self.window_sizes[i]:
                    ok = False
            if ok:
                best = k + 1
            for i, pages in enumerate(wins):
                if pages is None:
                    last_tomb[i] = node.end
        return best

    def _gather(self, values: list[np.ndarray | None]) -> torch.Tensor:
        if not values or any(v is None for v in values):
            return _EMPTY.clone()
        pages = np.frombuffer(bytearray().join(values), dtype=np.int64)  # type: ignore[arg-type]
        slots = pages if self.page_size == 1 else pages_to_slots(pages, self.page_size)
        return torch.from_numpy(slots)

    def _walk(self, query: bytes, namespace: str | None) -> tuple[HybridNode, int, list]:
        """Match `query` down the tree (device and host-only nodes), splitting a partly matched
        node. Returns the last node, the matched length in tokens and the path."""
        node, pos, path = self.root, 0, []
        page, end = self._page_bytes, len(query)
        while pos < end:
            first = query[pos : pos + page]
            child = node.children.get((namespace, first) if node is self.root else first)
            if child is None:
                break
            if query.startswith(child.key, pos):
                pos += len(child.key)
                node = child
                path.append(child)
                continue
            shared = common_prefix_tokens(child.key, query, pos) // self.page_size * self.page_size
            if shared == 0:
                break
            node = self._split(child, shared)
            path.append(node)
            pos += shared * TOKEN_BYTES
            break
        return node, pos // TOKEN_BYTES, path

    def _touch(self, path: list[HybridNode]) -> None:
        self._tick += 1
        for node in path:
            node.last_access = self._tick
            self._push_all(node)
            self.host.rerank(node)

    # --- tree shape -------------------------------------------------------------------------

    def _child_key(self, node: HybridNode) -> object:
        first = node.key[: self._page_bytes]
        return (node.namespace, first) if node.parent is self.root else first

    def _split(self, child: HybridNode, length: int) -> HybridNode:
        """Cut `child` after `length` tokens; the new upper node takes its place. Locks, events
        and full-KV sizes carry over; a window group whose locks do not reach the upper half
        moves its tokens from protected to evictable (the upper half is checked on its own)."""
        upper: HybridNode = child.split(length, self.page_size, self.block_size)  # type: ignore
        child.split_components(upper, length, self.page_size, self.widest)
        self.host.split(child, upper, length)
        upper.parent.children[self._child_key(upper)] = upper  # type: ignore[union-attr]
        self._num_nodes += 1
        for i, c in enumerate(self.window_pos):
            if upper.windows[i] is not None and child.window_locked(self.window_sizes[i]):
                if not upper.window_locked(self.window_sizes[i]):
                    self._protected[c] -= len(upper)
                    self._evictable[c] += len(upper)
        self._push_all(upper)
        return upper

    def _new_node(self, parent: HybridNode, arr: np.ndarray, start: int, end: int,
                  namespace: str | None) -> HybridNode:
        states, state = extend_block_states(arr[start:end], start, parent.hash_state,
                                            self.block_size)
        hashes = hash_block_states(states, namespace)
        key = arr[start:end].tobytes()
        node = HybridNode(
            parent, key, None, namespace, start, hashes, states, state, self._tick,
            num_windows=len(self.window_pos), num_components=len(self.groups),
        )
        parent.children[self._child_key(node)] = node
        self._num_nodes += 1
        return node

    def detach(self, node: HybridNode) -> None:
        """Take a node with no device components and no children out of the tree."""
        assert not node.children and node.lock_ref == 0, "only unlocked leaves are removed"
        del node.parent.children[self._child_key(node)]  # type: ignore[union-attr]
        self._num_nodes -= 1
        node.parent = None

    def _path_slots(self, path: list[HybridNode], c: int) -> np.ndarray:
        """The device slots of component `c` (not states) held by the nodes of `path`."""
        pages = [self.host._device_pages(x, c) for x in path if self.holds(x, c)]
        if not pages:
            return np.zeros(0, dtype=np.int64)
        return pages_to_slots(np.concatenate(pages), self.page_size)

    def slots(self, node: HybridNode, group: int | None = None) -> torch.Tensor | tuple:
        """The slots a request resuming at `node`'s end uses: the full-attention group's (by
        default) for root..node, or a window group's `(start, ids)` for the `W` tokens before
        the node's end (as `HybridMatch.windows`). For a chunked request that goes on after
        inserting its first chunks (lock `node` first)."""
        path = path_below(self.root, node)
        c = self.full if group is None else self._component(group)
        if c == self.full:
            return self._gather([x.value for x in path])
        if c not in self.window_pos:
            raise ValueError(f"group {group} has no slots per token")
        i = self.window_pos.index(c)
        start = max(0, node.end - self.window_sizes[i]) // self.page_size * self.page_size
        nodes = [x for x in path if x.end > start]
        ids = self._gather([x.windows[i] for x in nodes])
        return start, ids[start - nodes[0].start :] if nodes else ids

    # --- insertion --------------------------------------------------------------------------

    def insert(
        self,
        tokens: object,
        full_ids: SlotIds,
        windows: Mapping[int, tuple[int, SlotIds]] | None = None,
        states: Mapping[int, int] | None = None,
        namespace: str | None = None,
    ) -> InsertResult:
        """Cache the page-aligned prefix of `tokens` with the request's KV of every group:
        `full_ids` for `tokens[:aligned]`, `windows[g] = (start, ids)` the window slots of
        `tokens[start:start + len(ids)]`, `states[pos]` a state saved after `tokens[:pos]`.
        See `InsertResult` for what the caller still owns afterwards."""
        arr = as_int64_array(tokens)
        n = len(arr) // self.page_size * self.page_size
        values = as_int64_array(full_ids)
        if len(values) < n:
            raise ValueError(f"insert(): {len(values)} full ids for {n} aligned tokens")
        wins = self._window_args(windows, n)
        state_args = dict(states or {})
        if self.recurrent is None and state_args:
            raise ValueError("insert(): states given to a cache without a recurrent group")
        node, pos, path = self._walk(arr[:n].tobytes(), namespace)
        if pos < n or any(x.evicted for x in path):  # the device gains a leaf
            for i, (cover, _) in enumerate(wins):
                if cover > n - self.page_size:
                    raise ValueError(
                        f"insert(): window group {self.groups[self.window_pos[i]].index} has "
                        "no KV for the last page (a new leaf would be a tombstone)"
                    )
        self._touch(path)
        cached = 0
        for node_ in path:
            if node_.evicted:
                break
            cached = node_.end
        # Existing nodes: promote host-only ones, refill tombstones the request covers (a
        # tombstone across the covered boundary is split there first).
        path = self._split_at_cover(path, wins)
        for node_ in path:
            if node_.evicted:
                self._to_device(node_, self._pages(values, 0, node_.start, node_.end), {})
            self._refill(node_, wins)
        # New tokens: a chain of nodes cut where a window group's coverage begins.
        if pos < n:
            cuts = sorted({c for c, _ in wins if pos < c < n} | {n})
            parent, start = node, pos
            for end in cuts:
                leaf = self._new_node(parent, arr, start, end, namespace)
                leaf.value = self._pages(values, 0, start, end)
                self._on_device(leaf)
                self._refill(leaf, wins)
                path.append(leaf)
                parent, start = leaf, end
        unused_states = self._take_states(path, state_args, n)
        end_node = path[-1] if path else self.root
        for node_ in path:
            self._push_all(node_)
        self.host.after_use(path, inserted=True)
        # What the caller gave and the tree does not hold now is still the caller's (ids equal
        # to the tree's own, such as a match's, were never the caller's to free).
        unused_full = _not_in(values[:n], self._path_slots(path, self.full))
        unused_windows = {
            self.groups[c].index: _not_in(wins[i][1][1], self._path_slots(path, c))
            for i, c in enumerate(self.window_pos)
        }
        tree_states = {x.state for x in path}
        unused_states += [s for s in state_args.values() if s not in tree_states and
                          s not in unused_states]
        return InsertResult(cached, end_node, unused_full, unused_windows, unused_states)

    def _window_args(
        self, windows: Mapping[int, tuple[int, SlotIds]] | None, n: int
    ) -> list[tuple[int, tuple[int, np.ndarray]]]:
        """Per window group (in component order): the first page-aligned position the request's
        window ids cover, and `(start, ids)` cut to the aligned end (`cover == n`: none)."""
        given = dict(windows or {})
        out = []
        for c in self.window_pos:
            index = self.groups[c].index
            if index not in given:
                out.append((n, (n, np.zeros(0, dtype=np.int64))))
                continue
            start, ids = given.pop(index)
            ids = as_int64_array(ids)
            if start < 0 or start + len(ids) < n:
                raise ValueError(f"insert(): window ids of group {index} end before the tokens")
            ids = ids[: max(0, n - start)]
            cover = -(-start // self.page_size) * self.page_size
            out.append((min(cover, n), (start, ids)))
        if given:
            raise ValueError(f"insert(): no window group {sorted(given)}")
        return out

    def _split_at_cover(self, path: list[HybridNode], wins: list) -> list[HybridNode]:
        """Split the nodes without window KV of a group (tombstones, host-only nodes) that the
        request's window KV of that group starts inside, so that the covered part can take it
        (a host-only node brought back in one piece would be a tombstoned leaf)."""
        out: list[HybridNode] = []
        order = sorted(range(len(wins)), key=lambda i: wins[i][0])
        for node in path:
            for i in order:
                cover = wins[i][0]
                if node.windows[i] is None and node.start < cover < node.end:
                    out.append(self._split(node, cover - node.start))
            out.append(node)
        return out

    def _refill(self, node: HybridNode, wins: list) -> None:
        """Give `node` the request's window KV for each group that is tombstoned here and that
        the request covers."""
        for i, (cover, (start, ids)) in enumerate(wins):
            if node.windows[i] is not None or cover > node.start or node.end > start + len(ids):
                continue
            self._set_window(node, i, self._pages(ids, start, node.start, node.end))

    def _set_window(self, node: HybridNode, i: int, pages: np.ndarray) -> None:
        c = self.window_pos[i]
        node.windows[i] = pages
        self._count(node, c, len(node))
        self._stored(node, c)

    def _take_states(self, path: list[HybridNode], states: dict[int, int], n: int) -> list[int]:
        """File each state at the node that ends at its position (splitting a node there);
        returns the state slots not taken."""
        unused = []
        for pos, slot in sorted(states.items()):
            if pos <= 0 or pos > n or pos % self.page_size:
                unused.append(slot)
                continue
            k = next(k for k, node in enumerate(path) if node.start < pos <= node.end)
            node = path[k]
            if pos < node.end:
                node = self._split(node, pos - node.start)
                path.insert(k, node)
            if node.state != NO_STATE:
                unused.append(slot)
                continue
            self._set_state(node, slot)
        return unused

    def _set_state(self, node: HybridNode, slot: int) -> None:
        assert self.recurrent is not None
        node.state = slot
        self._count(node, self.recurrent, 1)
        self._stored(node, self.recurrent)

    def _pages(self, ids: np.ndarray, offset: int, start: int, end: int) -> np.ndarray:
        """The pages of the caller's ids for tokens `[start, end)` (`ids[0]` is token
        `offset`), as a copy."""
        pages = slots_to_pages(ids[start - offset : end - offset], self.page_size)
        return pages.copy() if self.page_size == 1 else pages

    def _on_device(self, node: HybridNode) -> None:
        """A node gained its full KV on device."""
        node.evicted = False
        self._count(node, self.full, len(node))
        self._stored(node, self.full)

    def _to_device(self, node: HybridNode, pages: np.ndarray | None,
                   parts: Mapping[int, np.ndarray | int]) -> None:
        """A host-only node is back on device: full KV in `pages`, and the window pages / state
        slot of `parts` (component -> ids)."""
        node.value = pages
        self._on_device(node)
        for c, ids in parts.items():
            if c == self.recurrent:
                self._set_state(node, int(ids))  # type: ignore[arg-type]
            else:
                self._set_window(node, self.window_pos.index(c), ids)  # type: ignore[arg-type]
        self.host.loaded(node)

    def _stored(self, node: HybridNode, c: int) -> None:
        blocks = self.blocks(node, c)
        if blocks:
            self.ledgers[c].stored(blocks, self.block_before(node, c))

    def _removed(self, node: HybridNode, c: int) -> None:
        blocks = self.blocks(node, c)
        if blocks:
            self.ledgers[c].removed(blocks)

    # --- locks ------------------------------------------------------------------------------

    def lock(self, node: HybridNode) -> None:
        """Protect, per component: the full KV of root..node, each window group's KV of the `W`
        tokens before the node's end, the state at its end (counted; the root is a no-op)."""
        if node is self.root:
            return
        if node.parent is None or node.evicted:
            raise ValueError("lock(): the node is not on device")
        self._lock_state(node, +1)
        self._lock_windows(node, +1)
        x = node
        while x is not self.root:
            if x.lock_ref == 0:
                self._evictable[self.full] -= len(x)
                self._protected[self.full] += len(x)
            x.lock_ref += 1
            x = x.parent  # type: ignore[assignment]

    def unlock(self, node: HybridNode) -> None:
        """Release one `lock(node)`; `ValueError`, changing nothing, if `node` holds none."""
        if node is self.root:
            return
        if node.locks_here <= 0:
            raise ValueError("unlock(): the node is not locked")
        x = node
        while x is not self.root:
            x.lock_ref -= 1
            if x.lock_ref == 0:
                self._protected[self.full] -= len(x)
                self._evictable[self.full] += len(x)
            x = x.parent  # type: ignore[assignment]
        walked = self._lock_windows(node, -1)
        self._lock_state(node, -1)
        for x in walked:
            self._push_all(x)
        self._prune(node)

    def _lock_state(self, node: HybridNode, step: int) -> None:
        before = node.locks_here > 0
        node.locks_here += step
        after = node.locks_here > 0
        if node.state != NO_STATE and before != after and self.recurrent is not None:
            self._evictable[self.recurrent] -= step
            self._protected[self.recurrent] += step

    def _lock_windows(self, node: HybridNode, step: int) -> list[HybridNode]:
        """Add (`step=1`) or remove one window lock ending at `node.end` on the nodes that the
        widest window reaches; returns them."""
        walked: list[HybridNode] = []
        if not self.window_pos:
            return walked
        end, x = node.end, node
        while x is not self.root and x.end > end - self.widest:
            before = [x.window_locked(w) for w in self.window_sizes]
            count = x.wlocks.get(end, 0) + step
            if count:
                x.wlocks[end] = count
            else:
                del x.wlocks[end]
            for i, c in enumerate(self.window_pos):
                after = x.window_locked(self.window_sizes[i])
                if x.windows[i] is not None and after != before[i]:
                    sign = 1 if after else -1
                    self._evictable[c] -= sign * len(x)
                    self._protected[c] += sign * len(x)
            walked.append(x)
            x = x.parent  # type: ignore[assignment]
        return walked

    # --- eviction ---------------------------------------------------------------------------

    def _candidate(self, node: HybridNode, c: int) -> bool:
        """Whether component `c` of `node` may be evicted now."""
        if node.parent is None or node.evicted:
            return False
        if c == self.full:
            return node.lock_ref == 0 and self._device_leaf(node)
        return self.holds(node, c) and not self._protects(node, c)

    def _device_leaf(self, node: HybridNode) -> bool:
        for child in node.children.values():
            if not child.evicted:
                return False
        return True

    def _push_all(self, node: HybridNode) -> None:
        for c in range(len(self.groups)):
            if self._candidate(node, c):
                self._push(node, c)

    def _push(self, node: HybridNode, c: int) -> None:
        self._seq += 1
        node.seqs[c] = self._seq
        heap = self._heaps[c]
        heapq.heappush(heap, (node.last_access, self._seq, node))
        if len(heap) > 2 * self._num_nodes + 1024:
            self._heaps[c] = [e for e in heap if e[2].seqs[c] == e[1]]
            heapq.heapify(self._heaps[c])

    def _pop(self, c: int) -> HybridNode | None:
        heap = self._heaps[c]
        while heap:
            _, seq, node = heapq.heappop(heap)
            if node.seqs[c] != seq:
                continue
            node.seqs[c] = -1
            if self._candidate(node, c):
                return node
        return None

    def evict(self, num_tokens: int) -> int:
        """Full KV: take unlocked device leaves off the device, least recently used first, until
        `num_tokens` are freed; each frees all its components (a node with a host copy is
        demoted to host). Returns the full-KV tokens freed."""
        freed = 0
        while freed < num_tokens:
            node = self._pop(self.full)
            if node is None:
                break
            freed += len(node)
            parent = node.parent
            self._off_device(node)
            self._prune(parent)  # type: ignore[arg-type]
        return freed

    def evict_window(self, group: int, num_tokens: int) -> int:
        """Window KV of `group`: least recently used unprotected nodes first; an inner node
        becomes a tombstone, a leaf is removed (cascading up through tombstoned parents).
        Returns the window tokens freed."""
        c = self._component(group)
        if c not in self.window_pos:
            raise ValueError(f"group {group} is not a sliding-window group")
        i = self.window_pos.index(c)
        freed = 0
        while freed < num_tokens:
            node = self._pop(c)
            if node is None:
                break
            freed += len(node)
            if self._device_leaf(node):
                parent = node.parent
                self._off_device(node)
                self._prune(parent)  # type: ignore[arg-type]
            else:
                self._drop_window(node, i)
        return freed

    def evict_states(self, num_states: int) -> int:
        """Recurrent states: least recently used unlocked states first. Returns states freed."""
        if self.recurrent is None:
            return 0
        freed = 0
        while freed < num_states:
            node = self._pop(self.recurrent)
            if node is None:
                break
            self._drop_state(node)
            freed += 1
        return freed

    def _drop_window(self, node: HybridNode, i: int) -> None:
        c = self.window_pos[i]
        pages = node.windows[i]
        self._count(node, c, -len(node))
        self._removed(node, c)
        node.windows[i] = None
        if pages is not None:
            self.allocators[c].free_pages(pages)

    def _drop_state(self, node: HybridNode) -> None:
        c = self.recurrent
        assert c is not None
        self._count(node, c, -1)
        self._removed(node, c)
        slot, node.state = node.state, NO_STATE
        self.allocators[c].free_pages(np.array([slot], dtype=np.int64))

    def _off_device(self, node: HybridNode) -> None:
        """An unpinned device leaf loses the device: every component is freed; it stays on host
        if it has a complete host copy (write-back makes one now), else it leaves the tree."""
        self.host.before_offload(node)
        for i, pages in enumerate(node.windows):
            if pages is not None:
                self._drop_window(node, i)
        if node.state != NO_STATE:
            self._drop_state(node)
        self._count(node, self.full, -len(node))
        self._removed(node, self.full)
        if node.value is not None:
            self.allocators[self.full].free_pages(node.value)
        node.value = None
        node.evicted = True
        if node.host_ready:
            self.host.rerank(node)
        else:
            self.detach(node)

    def _prune(self, node: HybridNode) -> None:
        """No device leaf is a tombstone: from `node` up, take tombstoned device leaves off the
        device until a node that is not one, or that is pinned (locked, or referenced by the host
        tier without a complete host copy: it is pruned when released), then make the first
        remaining node a candidate again."""
        while node is not self.root and node.parent is not None and not node.evicted:
            if not self._device_leaf(node) or all(w is not None for w in node.windows):
                break
            if node.lock_ref or (node.host_ref and not node.host_ready):
                break
            parent = node.parent
            self._off_device(node)
            node = parent  # type: ignore[assignment]
        if node is not self.root and node.parent is not None:
            self._push_all(node)

    # --- host tier --------------------------------------------------------------------------

    def host_size(self) -> int:
        """Tokens with a full-KV host copy."""
        return self.host.size()

    def evict_host(self, num_tokens: int) -> int:
        """Remove unpinned host-only leaves, LRU first, until `num_tokens` host tokens are freed."""
        return self.host.evict(num_tokens)

    def protect_host(self, node: HybridNode) -> None:
        """Pin the host copies of root..node against `evict_host` (counted)."""
        self.host.protect(node)

    def release_host(self, node: HybridNode) -> None:
        """Release one `protect_host(node)`; `ValueError`, changing nothing, if it has none."""
        self.host.release(node)
        self._prune(node)

    def flush(self) -> None:
        """Copies are synchronous: nothing is ever in flight."""

    def load_back(self, match: HybridMatch) -> HybridMatch:
        """Copy the host-only nodes of a match's path to device, all or nothing, and return the
        match at `host_node`; `match` unchanged when there is nothing to load or no room."""
        end = match.host_node
        if not match.host_length or end is None:
            return match
        if end.parent is None or not end.evicted:
            raise ValueError("load_back(): the match is stale (its nodes changed)")
        full_path = path_below(self.root, end)
        path = [n for n in full_path if n.evicted]
        device_end = path[0].parent
        self.lock(device_end)  # type: ignore[arg-type]
        self.host.protect(end)
        try:
            if not self.host.load(path):
                return match
        finally:
            self.host.release(end)
            self.unlock(device_end)  # type: ignore[arg-type]
        self._touch(full_path)
        return self._result(full_path)

    # --- events, reset, integrity -----------------------------------------------------------

    def take_events(self) -> list[KVEvent]:
        """KV events since the last call, oldest first."""
        events = self._events[:]
        self._events.clear()
        return events

    def snapshot_events(self) -> list[KVEvent]:
        """`AllCleared`, then `BlockStored` for every cached block of every group, parents first
        (device, then host copies)."""
        events: list[KVEvent] = [AllCleared()]
        nodes: list[HybridNode] = descendants(self.root)  # type: ignore[assignment]
        for medium, holds in ((DEVICE, self.holds), (HOST, self.host.holds)):
            for c, group in enumerate(self.groups):
                seen: set[int] = set()
                for node in nodes:
                    if not holds(node, c):
                        continue
                    fresh = [h for h in self.blocks(node, c) if h not in seen]
                    if fresh:
                        seen.update(fresh)
                        events.append(BlockStored(fresh, self.block_before(node, c) if
                                                  fresh[0] == self.blocks(node, c)[0] else
                                                  None, medium, group))
        return events

    def reset(self) -> None:
        """Free every slot of the tree (both tiers) and report one `AllCleared`; refused while
        a path is locked or host-protected."""
        if any(self._protected) or self.host.pinned():
            raise ValueError("reset(): some path is locked or host-protected")
        nodes: list[HybridNode] = descendants(self.root)  # type: ignore[assignment]
        for node in reversed(nodes):  # leaves first
            if not node.evicted:
                for i, pages in enumerate(node.windows):
                    if pages is not None:
                        self.allocators[self.window_pos[i]].free_pages(pages)
                if node.state != NO_STATE and self.recurrent is not None:
                    states = np.array([node.state], dtype=np.int64)
                    self.allocators[self.recurrent].free_pages(states)
                if node.value is not None:
                    self.allocators[self.full].free_pages(node.value)
        self.host.clear(nodes)
        for node in nodes:
            node.parent = None
            node.value = None
        self._new_tree()
        self._events.append(AllCleared())

    def check_integrity(self) -> None:
        """Raise `AssertionError` naming the first violated invariant (see hybrid_integrity)."""
        check_hybrid(self)

