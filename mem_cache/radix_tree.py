"""The structure of the radix tree: walking, splitting and growing it (a mixin of RadixCache).

These methods change the tree's shape but never who owns a slot or whether a path is locked;
`RadixCache` decides when they run. A split keeps every handle valid: the new node goes above
the old one, which keeps denoting the same path end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from mem_cache.allocator import pages_to_slots, slots_to_pages
from mem_cache.events import extend_block_states, hash_block_states
from mem_cache.radix_node import TOKEN_BYTES, TreeNode, common_prefix_tokens

if TYPE_CHECKING:
    from mem_cache.radix_cache import RadixCache

_EMPTY = torch.empty(0, dtype=torch.int64)


class RadixTree:
    """Tree-shape operations of `RadixCache` (which owns the state they use)."""

    def _walk(
        self: RadixCache, query: bytes, namespace: str | None
    ) -> tuple[TreeNode, int, list[TreeNode]]:
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

    def _split(self: RadixCache, child: TreeNode, length: int) -> TreeNode:
        """Cut `child` after `length` tokens; the new upper node takes its place and is returned.

        `child` keeps denoting the same path end (handles stay valid); locks, sizes, last use
        and events are unchanged because both halves carry the old node's state.
        """
        assert 0 < length < len(child) and length % self.page_size == 0, "split off the pages"
        parent, cut = child.parent, length * TOKEN_BYTES
        assert parent is not None
        bs = self.block_size
        num_blocks = (child.start + length) // bs - child.start // bs
        upper = TreeNode(
            parent,
            child.key[:cut],
            None if child.value is None else child.value[: length // self.page_size].copy(),
            child.namespace,
            child.start,
            child.hashes[:num_blocks],
            child.block_states[:num_blocks].copy(),
            self._state_at(child, length),
            child.last_access,
        )
        upper.lock_ref = child.lock_ref
        if self.host_allocator is not None:
            self._split_host(child, upper, length)
        parent.children[self._child_key(child)] = upper
        child.key = child.key[cut:]
        if child.value is not None:
            child.value = child.value[length // self.page_size :].copy()
        child.start += length
        child.hashes = child.hashes[num_blocks:]
        child.block_states = child.block_states[num_blocks:].copy()
        child.parent = upper
        upper.children[child.key[: self._page_bytes]] = child
        self._num_nodes += 1
        return upper

    def _state_at(self: RadixCache, node: TreeNode, length: int) -> int:
        """The running hash state after the first `length` tokens of `node`: from the last
        block end before that point (or the node's start), mixing fewer than a block of tokens."""
        bs, start = self.block_size, node.start
        end = start + length
        last_block_end = end // bs * bs
        if last_block_end > start:
            base_pos = last_block_end
            base = int(node.block_states[(last_block_end // bs) - start // bs - 1])
            if base_pos == end:  # the split is at a block end: nothing to mix
                return base
        else:
            base_pos, base = start, node.parent.hash_state  # type: ignore[union-attr]
        tokens = node.tokens()[base_pos - start : length]
        return extend_block_states(tokens, base_pos, base, bs)[1]

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
        leaf = TreeNode(
            parent,
            query[pos * TOKEN_BYTES :],
            value,
            namespace,
            pos,
            hashes,
            states,
            state,
            self._tick,
        )
        leaf.hits = 1  # its first use (write_through_selective backs up on the second)
        parent.children[self._child_key(leaf)] = leaf
        self._evictable += n - pos
        self._num_nodes += 1
        self._push(leaf)
        if hashes:
            self._device_blocks.stored(hashes, self._last_hash(parent))
        return leaf

    def _pages_of(self: RadixCache, values: np.ndarray, start: int, end: int) -> np.ndarray:
        """The pages of the caller's slots `values[start:end]` (whole pages), as a copy."""
        pages = slots_to_pages(values[start:end], self.page_size)
        return pages.copy() if self.page_size == 1 else pages  # page_size > 1: already new

    def _child_key(self: RadixCache, node: TreeNode) -> object:
        first = node.key[: self._page_bytes]
        return (node.namespace, first) if node.parent is self.root else first

    def _last_hash(self: RadixCache, node: TreeNode) -> int | None:
        """Hash of the last full block on the path root..node (None if there is none)."""
        while node is not self.root and not node.hashes:
            node = node.parent  # type: ignore[assignment]
        return node.hashes[-1] if node.hashes else None

    def _gather(self: RadixCache, path: list[TreeNode]) -> torch.Tensor:
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
