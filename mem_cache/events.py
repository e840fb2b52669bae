"""Block hashes and KV events: the language the workers' caches and the router's index share.

A prompt is cut into blocks of `block_size` tokens. Block `i` gets one unsigned 64-bit hash that
depends on the namespace and on every token of blocks `0..i`, so two sequences share hash `i`
exactly when (up to a 2^-64 chance) their first `i + 1` blocks are identical. Only full blocks
get a hash. Router and workers call the same `block_hashes`, so they agree bit for bit.

The hash is a prefix hash rather than a per-block hash chain so that it vectorises: every token
is mixed with its position (splitmix64), the mixed values are summed along the sequence, and the
running sum at each block end is mixed once more with the namespace seed. 8k tokens take ~70 us.
It is not a cryptographic hash: a crafted collision can only misroute a request, never serve
wrong tokens, because the workers' radix trees match on the token ids themselves.
"""

from __future__ import annotations

import array
import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_POS_MULT = np.uint64(0xD6E8FEB86659FD93)
# 0-d arrays: numpy applies them to an array faster than it converts a scalar each call.
_K_GOLDEN = np.array(_GOLDEN)
_K_MUL1 = np.array(np.uint64(0xBF58476D1CE4E5B9))
_K_MUL2 = np.array(np.uint64(0x94D049BB133111EB))
_K_30, _K_27, _K_31 = (np.array(np.uint64(s)) for s in (30, 27, 31))
_NONE_SEED = 0x5A17C0DE2A11CE55
_MASK = (1 << 64) - 1

_add, _xor, _mul, _shift = np.add, np.bitwise_xor, np.multiply, np.right_shift

_positions = np.zeros(0, dtype=np.uint64)


def _mix_inplace(x: np.ndarray) -> np.ndarray:
    """splitmix64 of a uint64 array, in place (one scratch row, no other temporaries).

    uint64 array arithmetic wraps silently (no np.errstate needed: it costs more than this).
    `out` is passed by position: by keyword, a 128-block mix takes ~15% longer.
    """
    tmp = np.empty_like(x)
    _add(x, _K_GOLDEN, x)
    _shift(x, _K_30, tmp)
    _xor(x, tmp, x)
    _mul(x, _K_MUL1, x)
    _shift(x, _K_27, tmp)
    _xor(x, tmp, x)
    _mul(x, _K_MUL2, x)
    _shift(x, _K_31, tmp)
    return _xor(x, tmp, x)


def _position_keys(n: int) -> np.ndarray:
    global _positions
    if len(_positions) < n:
        size = max(n, 2 * len(_positions), 4096)
        _positions = np.arange(size, dtype=np.uint64) * _POS_MULT
    return _positions[:n]


def namespace_seed(namespace: str | None) -> int:
    """The chain seed of a namespace; `None` has its own fixed seed."""
    if namespace is None:
        return _NONE_SEED
    digest = hashlib.blake2b(namespace.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@functools.lru_cache(maxsize=1024)
def _seed_u64(namespace: str | None) -> np.ndarray:
    return np.array(np.uint64(namespace_seed(namespace)))


def _as_uint64(tokens: Sequence[int], n: int) -> np.ndarray:
    """The first `n` token ids as uint64 (two's complement); a read-only view when possible."""
    if isinstance(tokens, np.ndarray):
        head = tokens[:n]
    elif hasattr(tokens, "numpy"):  # torch tensor
        head = tokens[:n].cpu().numpy()
    else:
        return np.frombuffer(array.array("q", tokens[:n]), dtype=np.int64).view(np.uint64)
    if head.dtype == np.int64:
        return head.view(np.uint64)
    return head.astype(np.uint64)


def _mixed_sums(tokens: Sequence[int], start: int, n: int) -> np.ndarray:
    """Running sums of the position-mixed tokens (a new array; without the earlier state)."""
    mixed = np.bitwise_xor(_as_uint64(tokens, n), _position_keys(start + n)[start:])
    _mix_inplace(mixed)
    return np.add.accumulate(mixed, out=mixed)


def block_hashes(
    tokens: Sequence[int], namespace: str | None = None, block_size: int = 16
) -> list[int]:
    """One unsigned 64-bit hash per full block of `tokens`, chained from the namespace seed."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n = len(tokens) // block_size * block_size
    if n == 0:
        return []
    prefix = _mixed_sums(tokens, 0, n)[block_size - 1 :: block_size]
    return _mix_inplace(prefix ^ _seed_u64(namespace)).tolist()


def extend_block_states(
    tokens: Sequence[int], start: int, state: int = 0, block_size: int = 16
) -> tuple[np.ndarray, int]:
    """The running hash state at each block end inside `tokens` (which follow `start` earlier
    tokens whose running state is `state`, 0 at a sequence start), and the state after them.

    A block's hash is `hash_block_states` of the state at its end, so a radix tree that keeps
    the states of its blocks can hash what it adds, or find the state anywhere on a path,
    without going back over earlier tokens.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=np.uint64), state
    sums = _mixed_sums(tokens, start, n)
    first_end = (block_size - 1 - start) % block_size  # index of the first block end in `tokens`
    states = sums[first_end::block_size] + np.uint64(state)  # a new array, not a view
    return states, (int(sums[-1]) + int(state)) & _MASK


def hash_block_states(states: np.ndarray, namespace: str | None = None) -> list[int]:
    """Block hashes from the running states at the blocks' ends (see `extend_block_states`)."""
    if len(states) == 0:
        return []
    return _mix_inplace(states ^ _seed_u64(namespace)).tolist()


def extend_block_hashes(
    tokens: Sequence[int],
    start: int,
    state: int = 0,
    namespace: str | None = None,
    block_size: int = 16,
) -> tuple[list[int], int]:
    """Continue `block_hashes` over `tokens` that follow `start` earlier tokens.

    `state` is the running state after those earlier tokens (0 at the start of a sequence; the
    second value this function returned for them otherwise). Returns the hashes of the blocks
    that end inside `tokens` and the state after them, so that for any split of a sequence
    `block_hashes(a + b) == block_hashes(a) + extend_block_hashes(b, len(a), s_a)[0]` where
    `s_a = extend_block_hashes(a, 0)[1]`.
    """
    states, end = extend_block_states(tokens, start, state, block_size)
    return hash_block_states(states, namespace), end


# --- events -------------------------------------------------------------------------------------

DEVICE = "device"
HOST = "host"

# The kinds of KV a model's layers keep, named as vLLM's KV events name them
# (`kv_cache_spec_kind`): all of the prefix, the last `window` tokens, or one state per point.
FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
RECURRENT = "mamba"
GROUP_KINDS = (FULL_ATTENTION, SLIDING_WINDOW, RECURRENT)


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV group of a hybrid model: the layers that keep the same kind of KV.

    The same fields as vLLM's events (`group_idx`, `kv_cache_spec_kind`,
    `kv_cache_spec_sliding_window`). A block of a sliding-window group is reported stored while
    its window KV is cached; a block of a recurrent group while a state saved at its end is.
    """

    index: int
    kind: str = FULL_ATTENTION
    window: int | None = None  # tokens, for SLIDING_WINDOW only

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"unknown KV group kind {self.kind!r}")
        if (self.kind == SLIDING_WINDOW) != (self.window is not None):
            raise ValueError("a window is given exactly for a sliding-window group")
        if self.window is not None and self.window <= 0:
            raise ValueError(f"window must be positive, got {self.window}")
        if self.index < 0:
            raise ValueError(f"group index must be >= 0, got {self.index}")


@dataclass(frozen=True, slots=True)
class BlockStored:
    """`hashes` became fully cached, in sequence order; `parent` is the block before hashes[0].

    `group` is None for a model with full attention only (its one group)."""

    hashes: list[int]
    parent: int | None
    medium: str = DEVICE
    group: KVGroup | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """`hashes` stopped being cached on `medium` (in `group`, for a hybrid model)."""

    hashes: list[int]
    medium: str = DEVICE
    group: KVGroup | None = None


@dataclass(frozen=True, slots=True)
class AllCleared:
    """Everything the worker had cached is gone (reset, restart, or the start of a snapshot)."""


@dataclass(frozen=True, slots=True)
class SessionHeld:
    """The worker holds the KV of session `session_id` (parked, or in a running turn)."""

    session_id: str


@dataclass(frozen=True, slots=True)
class SessionReleased:
    """The worker no longer holds session `session_id`'s KV (closed, expired, dropped)."""

    session_id: str


# A worker's events: what its cache stores and evicts, and which streaming sessions it holds
# (so that every router replica, not only the one that routed a turn, can find a session).
KVEvent = BlockStored | BlockRemoved | AllCleared | SessionHeld | SessionReleased


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Events of one worker, numbered: `seq` grows by one per batch within an `epoch`.

    A new epoch (worker restart) or a gap in `seq` tells the reader it missed events and must
    apply a snapshot: a batch that starts with `AllCleared` and re-stores every cached block.
    """

    worker_id: str
    epoch: int
    seq: int
    events: list[KVEvent]


def _encode_group(group: KVGroup | None) -> list:
    return [] if group is None else [group.index, group.kind, group.window]


def _decode_group(raw: list) -> KVGroup | None:
    """The group after an event's fixed fields: absent (full attention only) or three fields."""
    if not raw:
        return None
    index, kind, window = raw
    if not isinstance(index, int) or isinstance(index, bool) or not isinstance(kind, str):
        raise TypeError(f"malformed KV group {raw!r}")
    return KVGroup(index, kind, window)


def _encode_event(event: KVEvent) -> list:
    if isinstance(event, BlockStored):
        return [0, event.hashes, event.parent, event.medium, *_encode_group(event.group)]
    if isinstance(event, BlockRemoved):
        return [1, event.hashes, event.medium, *_encode_group(event.group)]
    if isinstance(event, AllCleared):
        return [2]
    if isinstance(event, SessionHeld):
        return [3, event.session_id]
    if isinstance(event, SessionReleased):
        return [4, event.session_id]
    raise TypeError(f"not a KV event: {event!r}")


def _decode_event(raw: list) -> KVEvent:
    kind = raw[0]
    if kind == 0:
        return BlockStored(list(raw[1]), raw[2], raw[3], _decode_group(raw[4:]))
    if kind == 1:
        return BlockRemoved(list(raw[1]), raw[2], _decode_group(raw[3:]))
    if kind == 2:
        return AllCleared()
    if kind in (3, 4):
        if not isinstance(raw[1], str):
            raise TypeError(f"session id {raw[1]!r} is not a string")
        return SessionHeld(raw[1]) if kind == 3 else SessionReleased(raw[1])
    raise ValueError(f"unknown KV event kind {kind!r}")


def encode_batch(worker_id: str, epoch: int, seq: int, events: list[KVEvent]) -> bytes:
    """msgpack bytes of one numbered batch of events."""
    body = [worker_id, epoch, seq, [_encode_event(e) for e in events]]
    return msgpack.packb(body, use_bin_type=True)


def decode_batch(data: bytes) -> EventBatch:
    """Inverse of `encode_batch`; raises `ValueError` on malformed input."""
    try:
        worker_id, epoch, seq, raw_events = msgpack.unpackb(data, raw=False)
        return EventBatch(worker_id, epoch, seq, [_decode_event(r) for r in raw_events])
    except (TypeError, ValueError, IndexError, msgpack.exceptions.ExtraData) as exc:
        raise ValueError(f"malformed KV event batch: {exc}") from exc
