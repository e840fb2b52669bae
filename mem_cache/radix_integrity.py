"""`check_integrity()` of the radix cache: one full walk that re-derives every invariant.

Each check raises `AssertionError` whose message starts with the invariant's name, so a failing
test names what broke. It walks the whole tree, so it is for tests and idle-time self-checks,
never for the request path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mem_cache.allocator import pages_to_slots
from mem_cache.events import extend_block_states, hash_block_states
from mem_cache.radix_host_integrity import check_host_tier
from mem_cache.radix_node import TreeNode

if TYPE_CHECKING:
    from mem_cache.radix_cache import RadixCache


def check_tree(cache: RadixCache) -> None:
    """Raise `AssertionError` naming the first violated invariant of `cache`."""
    root = cache.root
    assert root.lock_ref == 0, "root: lock count must stay 0 (a miss must not count it)"
    assert root.parent is None and not root.key and not root.hashes, "root: must stay empty"
    nodes = _walk_nodes(cache)
    _check_sizes(cache, nodes)
    _check_eviction_heap(cache, nodes)
    _check_block_refs(cache, nodes)
    if cache.allocator is not None:
        _check_slots(cache, nodes)
    if cache.host_allocator is not None:
        check_host_tier(cache, nodes)


def _walk_nodes(cache: RadixCache) -> list[TreeNode]:
    """Every node but the root, parents first, after checking each node's own invariants."""
    nodes: list[TreeNode] = []
    stack = [cache.root]
    while stack:
        parent = stack.pop()
        for key, child in parent.children.items():
            _check_node(cache, parent, key, child)
            nodes.append(child)
            stack.append(child)
    assert len(nodes) == cache.num_nodes(), "structure: node count drifted"
    return nodes


def _check_node(cache: RadixCache, parent: TreeNode, key: object, node: TreeNode) -> None:
    page, length = cache.page_size, len(node)
    assert node.parent is parent, "structure: child's parent pointer is wrong"
    first = node.key[: page * 8]
    expected_key = (node.namespace, first) if parent is cache.root else first
    assert key == expected_key, "structure: child filed under the wrong first page"
    assert length > 0 and length % page == 0, "page alignment: key length not whole pages"
    assert len(node.key) % 8 == 0, "page alignment: key is not int64 tokens"
    assert node.start == parent.end, "structure: node start != parent end"
    if parent is not cache.root:
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
    elif cache.allocator is not None:
        raise AssertionError("values: a node without slots in a cache with an allocator")
    _check_hashes(cache, parent, node)


def _check_hashes(cache: RadixCache, parent: TreeNode, node: TreeNode) -> None:
    bs = cache.block_size
    assert len(node.hashes) == node.end // bs - node.start // bs, (
        "events: node does not hold exactly the blocks that end inside it"
    )
    states, state = extend_block_states(node.tokens(), node.start, parent.hash_state, bs)
    assert hash_block_states(states, node.namespace) == list(node.hashes), (
        "events: block hashes do not match the node's tokens"
    )
    assert np.array_equal(states, node.block_states), "events: block states do not match"
    assert state == node.hash_state, "events: hash state does not match the node's tokens"


def _check_sizes(cache: RadixCache, nodes: list[TreeNode]) -> None:
    evictable = sum(len(n) for n in nodes if n.lock_ref == 0 and not n.evicted)
    protected = sum(len(n) for n in nodes if n.lock_ref > 0 and not n.evicted)
    ev, pr = cache.evictable_size(), cache.protected_size()
    assert ev >= 0 and pr >= 0, "sizes: negative evictable or protected size"
    assert ev == evictable, f"sizes: evictable_size {ev} != {evictable} in unlocked nodes"
    assert pr == protected, f"sizes: protected_size {pr} != {protected} in locked nodes"
    assert cache.total_size() == ev + pr, "sizes: total != evictable + protected"


def _check_eviction_heap(cache: RadixCache, nodes: list[TreeNode]) -> None:
    live = {seq: (access, node) for access, seq, node in cache._heap if node.heap_seq == seq}
    assert all(node is not cache.root for _, node in live.values()), (
        "eviction: the root is a candidate"
    )
    for node in nodes:
        if node.evicted or node.lock_ref or any(not c.evicted for c in node.children.values()):
            continue
        entry = live.get(node.heap_seq)
        assert entry is not None and entry[1] is node, (
            "eviction: an unlocked leaf is missing from the candidates"
        )
        assert entry[0] == node.last_access, "eviction: candidate ranked by a stale last use"


def _check_block_refs(cache: RadixCache, nodes: list[TreeNode]) -> None:
    ledgers = [(cache._device_blocks.refs, lambda n: not n.evicted)]
    if cache.host_allocator is not None:
        ledgers.append((cache._host_blocks.refs, lambda n: n.host_ready))
    for refs, holds in ledgers:
        if refs is None:
            continue
        counts: dict[int, int] = {}
        for node in nodes:
            if holds(node):
                for h in node.hashes:
                    counts[h] = counts.get(h, 0) + 1
        assert counts == refs, "events: block holder counts do not match the tree"


def _check_slots(cache: RadixCache, nodes: list[TreeNode]) -> None:
    allocator = cache.allocator
    assert allocator is not None
    values = [n.value for n in nodes if n.value is not None and not n.evicted]
    pages = np.concatenate(values) if values else np.zeros(0, dtype=np.int64)
    tree = pages_to_slots(pages, cache.page_size)
    assert len(tree) == cache.total_size(), "slots: tree slot count != total_size"
    if len(tree):
        assert tree.min() >= 0 and tree.max() < allocator.size, "slots: out of range"
    assert len(np.unique(tree)) == len(tree), "slots: a slot is owned by two nodes"
    free = allocator.free_slot_ids()
    assert len(np.unique(free)) == len(free), "slots: a slot is free twice"
    assert not np.isin(tree, free).any(), "slots: a tree slot is also free"
