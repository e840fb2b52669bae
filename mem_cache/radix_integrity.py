"""The device-side checks of `RadixCache.check_integrity()`: each re-derives an invariant from
a full walk of the tree.

Each check raises `AssertionError` whose message starts with the invariant's name, so a failing
test names what broke. They walk the whole tree, so they are for tests and idle-time
self-checks, never for the request path. The host tier checks its own invariants
(`radix_host`), each block ledger its holder counts (`block_ledger`).
"""

from __future__ import annotations

import numpy as np

from mem_cache.allocator import KVAllocator, pages_to_slots
from mem_cache.events import extend_block_states, hash_block_states
from mem_cache.radix_node import TreeNode


def check_nodes(
    root: TreeNode, num_nodes: int, page_size: int, block_size: int, needs_values: bool
) -> list[TreeNode]:
    """Every node but the root, parents first, after checking the root and each node's own
    invariants (`needs_values`: every device node must hold slots)."""
    assert root.lock_ref == 0, "root: lock count must stay 0 (a miss must not count it)"
    assert root.parent is None and not root.key and not root.hashes, "root: must stay empty"
    nodes: list[TreeNode] = []
    stack = [root]
    while stack:
        parent = stack.pop()
        for key, child in parent.children.items():
            _check_node(parent, parent is root, key, child, page_size, needs_values)
            _check_hashes(parent, child, block_size)
            nodes.append(child)
            stack.append(child)
    assert len(nodes) == num_nodes, "structure: node count drifted"
    return nodes


def _check_node(
    parent: TreeNode, under_root: bool, key: object, node: TreeNode, page: int, needs_values: bool
) -> None:
    length = len(node)
    assert node.parent is parent, "structure: child's parent pointer is wrong"
    first = node.key[: page * 8]
    assert key == ((node.namespace, first) if under_root else first), (
        "structure: child filed under the wrong first page"
    )
    assert length > 0 and length % page == 0, "page alignment: key length not whole pages"
    assert len(node.key) % 8 == 0, "page alignment: key is not int64 tokens"
    assert node.start == parent.end, "structure: node start != parent end"
    if not under_root:
        assert node.namespace == parent.namespace, "namespaces: a node shares another's path"
        assert parent.lock_ref >= node.lock_ref, "locks: parent count below a child's"
    assert node.lock_ref >= 0 and node.locks_here >= 0, "locks: negative lock count"
    below = sum(child.lock_ref for child in node.children.values())
    assert node.lock_ref == node.locks_here + below, (
        "locks: count != locks ending here + children's counts"
    )
    if node.evicted:
        assert node.value is None, "tiers: a node off the device still holds device pages"
    elif node.value is not None:
        assert len(node.value) * page == length, "values: page count != token count / page"
        assert node.value.dtype == np.int64, "values: page ids must be int64"
        assert node.value.flags.owndata, "values: a node's pages must be a copy, never a view"
    elif needs_values:
        raise AssertionError("values: a node without slots in a cache with an allocator")


def _check_hashes(parent: TreeNode, node: TreeNode, bs: int) -> None:
    assert len(node.hashes) == node.end // bs - node.start // bs, (
        "events: node does not hold exactly the blocks that end inside it"
    )
    states, state = extend_block_states(node.tokens(), node.start, parent.hash_state, bs)
    assert hash_block_states(states, node.namespace) == list(node.hashes), (
        "events: block hashes do not match the node's tokens"
    )
    assert np.array_equal(states, node.block_states), "events: block states do not match"
    assert state == node.hash_state, "events: hash state does not match the node's tokens"


def check_sizes(nodes: list[TreeNode], evictable: int, protected: int, total: int) -> None:
    """The cache's counters against the tokens of its unlocked and locked device nodes."""
    unlocked = sum(len(n) for n in nodes if n.lock_ref == 0 and not n.evicted)
    locked = sum(len(n) for n in nodes if n.lock_ref > 0 and not n.evicted)
    assert evictable >= 0 and protected >= 0, "sizes: negative evictable or protected size"
    assert evictable == unlocked, f"sizes: evictable_size {evictable} != {unlocked} unlocked"
    assert protected == locked, f"sizes: protected_size {protected} != {locked} in locked nodes"
    assert total == evictable + protected, "sizes: total != evictable + protected"


def check_eviction_heap(
    root: TreeNode, heap: list[tuple[int, int, TreeNode]], nodes: list[TreeNode]
) -> None:
    """Every unlocked device leaf has a live entry in `heap`, ranked by its last use."""
    live = {seq: (access, node) for access, seq, node in heap if node.heap_seq == seq}
    assert all(node is not root for _, node in live.values()), "eviction: the root is a candidate"
    for node in nodes:
        if node.evicted or node.lock_ref or any(not c.evicted for c in node.children.values()):
            continue
        entry = live.get(node.heap_seq)
        assert entry is not None and entry[1] is node, (
            "eviction: an unlocked leaf is missing from the candidates"
        )
        assert entry[0] == node.last_access, "eviction: candidate ranked by a stale last use"


def check_slots(nodes: list[TreeNode], allocator: KVAllocator, total: int) -> None:
    """The device slots of the tree: unique, in range, none free, `total` of them."""
    values = [n.value for n in nodes if n.value is not None and not n.evicted]
    pages = np.concatenate(values) if values else np.zeros(0, dtype=np.int64)
    tree = pages_to_slots(pages, allocator.page_size)
    assert len(tree) == total, "slots: tree slot count != total_size"
    if len(tree):
        assert tree.min() >= 0 and tree.max() < allocator.size, "slots: out of range"
    # Counts per slot (bincount: linear in the pool; np.unique's hashing took ~45 ms at 177k
    # slots, and the engine checks at every idle moment).
    owners = np.bincount(tree, minlength=allocator.size)
    assert owners.max(initial=0) <= 1, "slots: a slot is owned by two nodes"
    free = allocator.free_slot_ids()
    freed = np.bincount(free, minlength=allocator.size)
    assert freed.max(initial=0) <= 1, "slots: a slot is free twice"
    assert not (owners[: allocator.size] & freed[: allocator.size]).any(), (
        "slots: a tree slot is also free"
    )
