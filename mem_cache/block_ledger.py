"""Turns node-level changes of the radix tree into block-level KV events, per medium.

A block is reported stored once when it becomes fully cached on a medium and removed once when
it stops being. Usually exactly one node holds a block (the node where the block ends), so a
node's blocks are reported when the node gains or loses the medium. When pages do not tile
blocks (`block_size % page_size != 0`) two sibling nodes, which differ somewhere in their first
page, can both hold a block that ends before they differ; the ledger then counts holders per
block hash and reports only the first arrival and the last departure.
"""

from __future__ import annotations

from collections.abc import Callable

from mem_cache.events import DEVICE, BlockRemoved, BlockStored, KVEvent, KVGroup
from mem_cache.radix_node import TreeNode


class BlockLedger:
    """Block events of one medium (and one KV group of a hybrid model: `group`, None for a
    full-attention-only model), appended to a shared, ordered event list."""

    def __init__(
        self,
        out: list[KVEvent],
        medium: str = DEVICE,
        count_holders: bool = False,
        group: KVGroup | None = None,
    ):
        self.out = out
        self.medium = medium
        self.group = group
        self.refs: dict[int, int] | None = {} if count_holders else None

    def clear(self) -> None:
        """Forget every holder (the tree was reset; the caller reports `AllCleared`)."""
        if self.refs is not None:
            self.refs = {}

    def stored(self, hashes: list[int], before: int | None) -> None:
        """A node gained the medium: `hashes` are its blocks, `before` the block preceding them."""
        refs = self.refs
        if refs is None:
            self.out.append(BlockStored(list(hashes), before, self.medium, self.group))
            return
        run: list[int] = []
        for h in hashes:
            refs[h] = refs.get(h, 0) + 1
            if refs[h] == 1:
                run.append(h)
                continue
            if run:
                self.out.append(BlockStored(run, before, self.medium, self.group))
                run = []
            before = h
        if run:
            self.out.append(BlockStored(run, before, self.medium, self.group))

    def check(self, nodes: list[TreeNode], holds: Callable[[TreeNode], bool]) -> None:
        """Raise `AssertionError` unless the holder counts match the `nodes` where `holds`."""
        if self.refs is None:
            return
        counts: dict[int, int] = {}
        for node in nodes:
            if holds(node):
                for h in node.hashes:
                    counts[h] = counts.get(h, 0) + 1
        assert counts == self.refs, "events: block holder counts do not match the tree"

    def check_counts(self, counts: dict[int, int]) -> None:
        """Raise `AssertionError` unless the holder counts are `counts` (block -> holders)."""
        if self.refs is not None:
            assert counts == self.refs, f"events: {self.medium} block holders do not match the tree"

    def removed(self, hashes: list[int]) -> None:
        """A node lost the medium: `hashes` are its blocks."""
        refs = self.refs
        if refs is None:
            self.out.append(BlockRemoved(list(hashes), self.medium, self.group))
            return
        gone = []
        for h in hashes:
            refs[h] -= 1
            if refs[h] == 0:
                del refs[h]
                gone.append(h)
        if gone:
            self.out.append(BlockRemoved(gone, self.medium, self.group))


def snapshot_stored(
    root: TreeNode, medium: str, holds: Callable[[TreeNode], bool]
) -> list[BlockStored]:
    """`BlockStored` for every block that the nodes where `holds(node)` hold, parents first.

    `holds` must be true of a node's parent whenever it is true of the node (cached paths are
    prefixes), so every event's `parent` block was reported before it.
    """
    events: list[BlockStored] = []
    seen: set[int] = set()  # a block two siblings hold is reported once
    stack: list[tuple[TreeNode, int | None]] = [(root, None)]
    while stack:
        node, before = stack.pop()
        if node is not root and not holds(node):
            continue
        fresh = [h for h in node.hashes if h not in seen]
        if fresh:
            seen.update(fresh)
            i = node.hashes.index(fresh[0])
            events.append(BlockStored(fresh, node.hashes[i - 1] if i else before, medium))
        last = node.hashes[-1] if node.hashes else before
        stack.extend((child, last) for child in node.children.values())
    return events
