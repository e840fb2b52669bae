"""The KV groups of a hybrid worker, and where a cached prefix can resume on it.

A hybrid model keeps several kinds of KV (`mem_cache.events.KVGroup`): full attention (every
block of the prefix), a sliding window of `window` tokens (the blocks of the last window), a
recurrent state (one state per saved block end). A prefix of `l` blocks can be resumed only
where every group allows it (vLLM's `HybridKVCacheCoordinator.find_longest_cache_hit`):

- full attention: blocks `0..l-1` are held;
- sliding window: the `need = ceil((window - 1) / block_size)` blocks before `l` are held
  (blocks `0..l-1` when `l < need`), so a hit never needs the prefix before the window;
- recurrent: `l == 0`, or block `l - 1` is held (a state saved exactly there).

The predicted hit is the largest such `l` up to a bound (the full-attention match, and the
engine's cap: at most prompt length - 1, in whole blocks). Each rule below returns the largest
`l` it allows up to a bound; `resume_blocks` iterates them to their common fixed point, as
vLLM does, which is the largest `l` they all allow.

`WorkerGroups` is one worker's map from groups to index tiers: the first full-attention group
(or an engine that sends no groups) is the `device` tier, exactly as a model with full
attention only; every other group gets a tier of its own (`group<i>`), read by the rules.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from mem_cache.events import DEVICE, FULL_ATTENTION, RECURRENT, SLIDING_WINDOW, KVGroup


def window_blocks(window: int, block_size: int) -> int:
    """Blocks a sliding-window group must hold before a resume point (vLLM's rule)."""
    return -(-(window - 1) // block_size)


def allows(group: KVGroup, held: Container[int], hashes: Sequence[int], bound: int,
           block_size: int) -> int:
    """The largest `l <= bound` (blocks) that `group`, holding `held`, allows (module
    docstring)."""
    if group.kind == FULL_ATTENTION:
        for i in range(bound):
            if hashes[i] not in held:
                return i
        return bound
    if group.kind == RECURRENT:
        for i in range(bound - 1, -1, -1):
            if hashes[i] in held:
                return i + 1
        return 0
    need = window_blocks(group.window or 1, block_size)
    if need <= 0:
        return bound
    run = 0
    for i in range(bound - 1, -1, -1):
        if hashes[i] in held:
            run += 1
            if run >= need:
                return i + need
        else:
            run = 0
    return run  # a leading run shorter than the window: blocks 0..run-1


def resume_blocks(hashes: Sequence[int], bound: int,
                  groups: Sequence[tuple[KVGroup, Container[int]]], block_size: int) -> int:
    """The largest `l <= bound` every group allows: each group lowers the bound to what it
    allows, until none lowers it."""
    length = min(bound, len(hashes))
    while length > 0:
        lowered = length
        for group, held in groups:
            lowered = allows(group, held, hashes, lowered, block_size)
            if lowered == 0:
                return 0
        if lowered == length:
            return length
        length = lowered
    return 0


def expected_blocks(group: KVGroup, num_blocks: int, block_size: int) -> range:
    """The blocks of a prompt of `num_blocks` full blocks that the group will hold once the
    prompt is computed: all of them (full attention), those of the last window (sliding), the
    state at the last block (recurrent). What routing guesses until events confirm it."""
    if group.kind == FULL_ATTENTION:
        return range(num_blocks)
    if group.kind == SLIDING_WINDOW:
        return range(max(0, num_blocks - window_blocks(group.window or 1, block_size)),
                     num_blocks)
    return range(max(0, num_blocks - 1), num_blocks)


class WorkerGroups:
    """One worker's KV groups and the index tier each one's blocks live in."""

    __slots__ = ("full", "extra")

    def __init__(self) -> None:
        self.full: int | None = None  # the group whose blocks are the device tier
        self.extra: dict[str, KVGroup] = {}  # tier -> every other group

    @property
    def hybrid(self) -> bool:
        return bool(self.extra)

    def tier(self, group: KVGroup | None) -> str:
        """The tier of a device block of `group` (registering the group on first sight)."""
        if group is None:
            return DEVICE
        if group.kind == FULL_ATTENTION and self.full in (None, group.index):
            self.full = group.index
            return DEVICE
        tier = f"group{group.index}"
        self.extra.setdefault(tier, group)
        return tier

    def is_primary(self, group: KVGroup | None) -> bool:
        """True for the group whose blocks are the device tier (or may become it)."""
        return group is None or (group.kind == FULL_ATTENTION and self.full in (None,
                                                                                 group.index))
