"""A node of the radix tree, and the token-key helpers the tree uses.

A node holds one edge of the tree: `key`, the token ids of that edge as int64 bytes (8 bytes a
token, one object per node rather than one per token), and `value`, the ids of the pages that
hold them (one int64 per page, so 1/page_size of a slot list) as a numpy array that the node
owns (a copy, never a view); `None` in a pure index. `start` is how many tokens precede the
edge on its path from the root; `hashes` are the block hashes of the blocks that END inside the
edge (block `j` ends at token `(j + 1) * block_size`), so splitting a node splits that list and
a block is reported exactly once, by the node where it ends. `block_states` are the running
hash states at those block ends and `hash_state` the state after the edge (see
`events.extend_block_states`): with them the tree hashes only the tokens it adds and finds the
state at a split point by mixing fewer than `block_size` tokens.
"""

from __future__ import annotations

import numpy as np

from mem_cache.events import extend_block_states

TOKEN_BYTES = 8


class TreeNode:
    """One edge of the radix tree. Fields are public to the cache and its integrity checker."""

    __slots__ = (
        "parent",
        "children",
        "key",
        "value",
        "namespace",
        "start",
        "hashes",
        "block_states",
        "hash_state",
        "lock_ref",
        "locks_here",
        "last_access",
        "heap_seq",
        "evicted",
        "host_value",
        "host_ready",
        "host_ref",
        "host_here",
        "host_heap_seq",
        "hits",
    )

    def __init__(
        self,
        parent: TreeNode | None,
        key: bytes,
        value: np.ndarray | None,
        namespace: str | None,
        start: int,
        hashes: list[int],
        block_states: np.ndarray,
        hash_state: int,
        last_access: int,
    ) -> None:
        self.parent = parent
        self.children: dict[object, TreeNode] = {}
        self.key = key
        self.value = value
        self.namespace = namespace
        self.start = start
        self.hashes = hashes
        self.block_states = block_states
        self.hash_state = hash_state
        self.lock_ref = 0  # locks on paths through this node
        self.locks_here = 0  # of which end at this node (only these may be unlocked here)
        self.last_access = last_access
        self.heap_seq = -1  # sequence number of this node's live eviction-heap entry, -1 if none
        self.evicted = False  # off the device (its KV then lives only on host)
        # The host tier's fields (radix_host.py): backed up on host when `host_value` (host page
        # ids) is set, and that copy is complete once `host_ready`. `host_ref` counts host
        # protections on paths through the node (in-flight copies, protect_host), `host_here`
        # those that end at it.
        self.host_value: np.ndarray | None = None
        self.host_ready = False
        self.host_ref = 0
        self.host_here = 0
        self.host_heap_seq = -1
        self.hits = 0  # uses, for the write-through-selective policy

    def __len__(self) -> int:
        return len(self.key) // TOKEN_BYTES

    @property
    def end(self) -> int:
        """Tokens on the path from the root to the end of this node."""
        return self.start + len(self.key) // TOKEN_BYTES

    def tokens(self) -> np.ndarray:
        return np.frombuffer(self.key, dtype=np.int64)

    def state_at(self, length: int, block_size: int) -> int:
        """The running hash state after the first `length` tokens of this edge: from the last
        block end before that point (or the edge's start), mixing fewer than a block of tokens."""
        bs, start = block_size, self.start
        end = start + length
        last_block_end = end // bs * bs
        if last_block_end > start:
            base_pos = last_block_end
            base = int(self.block_states[(last_block_end // bs) - start // bs - 1])
            if base_pos == end:  # at a block end: nothing to mix
                return base
        else:
            base_pos, base = start, self.parent.hash_state  # type: ignore[union-attr]
        tokens = self.tokens()[base_pos - start : length]
        return extend_block_states(tokens, base_pos, base, bs)[1]

    def split(self, length: int, page_size: int, block_size: int) -> TreeNode:
        """Cut this edge after `length` tokens (whole pages): a new upper node takes the first
        part and this node's place under its parent (the caller files it in the parent's
        children), this node keeps the rest and so still denotes the same path end. Both
        halves keep the lock count, last use and residency; blocks go to the half they end in."""
        assert 0 < length < len(self) and length % page_size == 0, "split off the pages"
        cut, cut_pages = length * TOKEN_BYTES, length // page_size
        num_blocks = (self.start + length) // block_size - self.start // block_size
        upper = self.new_node(
            self.parent,
            self.key[:cut],
            None if self.value is None else self.value[:cut_pages].copy(),
            self.namespace,
            self.start,
            self.hashes[:num_blocks],
            self.block_states[:num_blocks].copy(),
            self.state_at(length, block_size),
            self.last_access,
        )
        upper.lock_ref = self.lock_ref
        upper.evicted = self.evicted
        self.key = self.key[cut:]
        if self.value is not None:
            self.value = self.value[cut_pages:].copy()
        self.start += length
        self.hashes = self.hashes[num_blocks:]
        self.block_states = self.block_states[num_blocks:].copy()
        self.parent = upper
        upper.children[self.key[: page_size * TOKEN_BYTES]] = self
        return upper

    def new_node(self, *args: object) -> TreeNode:
        """A new node of this node's kind (`split` makes its upper half with it)."""
        return TreeNode(*args)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"TreeNode(start={self.start}, len={len(self)}, lock={self.lock_ref})"


def make_root() -> TreeNode:
    """The root: an empty edge, never counted, locked or evicted."""
    return TreeNode(None, b"", None, None, 0, [], np.zeros(0, dtype=np.uint64), 0, 0)


def last_block_hash(node: TreeNode) -> int | None:
    """Hash of the last full block on the path root..node (None if there is none)."""
    while not node.hashes and node.parent is not None:
        node = node.parent
    return node.hashes[-1] if node.hashes else None


def path_below(top: TreeNode, node: TreeNode) -> list[TreeNode]:
    """The nodes under `top` down to `node`, parents first (all of root..node, root excluded,
    when `top` is not above `node`)."""
    path = []
    while node is not top and node.parent is not None:
        path.append(node)
        node = node.parent
    path.reverse()
    return path


def common_prefix_tokens(key: bytes, query: bytes, offset: int) -> int:
    """How many leading int64 tokens `key` shares with `query[offset:]` (offset in bytes)."""
    n = min(len(key), len(query) - offset) // TOKEN_BYTES
    if n <= 0:
        return 0
    x = np.frombuffer(key, dtype=np.int64, count=n)
    y = np.frombuffer(query, dtype=np.int64, count=n, offset=offset)
    differs = x != y
    first = int(differs.argmax())  # argmax of a bool array stops at the first True
    return first if differs[first] else n


def descendants(root: TreeNode) -> list[TreeNode]:
    """Every node below `root` (not `root` itself), each after its parent."""
    nodes, stack = [], list(root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        nodes.append(node)
    return nodes
