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
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_POS_MULT = np.uint64(0xD6E8FEB86659FD93)
_NONE_SEED = 0x5A17C0DE2A11CE55

_positions = np.zeros(0, dtype=np.uint64)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


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


def _as_uint64(tokens: Sequence[int], n: int) -> np.ndarray:
    if hasattr(tokens, "numpy"):  # torch tensor
        return tokens[:n].cpu().numpy().astype(np.uint64)
    if isinstance(tokens, np.ndarray):
        return tokens[:n].astype(np.uint64)
    return np.frombuffer(array.array("q", tokens[:n]), dtype=np.int64).astype(np.uint64)


def block_hashes(
    tokens: Sequence[int], namespace: str | None = None, block_size: int = 16
) -> list[int]:
    """One unsigned 64-bit hash per full block of `tokens`, chained from the namespace seed."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n = len(tokens) // block_size * block_size
    if n == 0:
        return []
    mixed = _splitmix64(_as_uint64(tokens, n) ^ _position_keys(n))
    with np.errstate(over="ignore"):
        prefix = np.cumsum(mixed, dtype=np.uint64)[block_size - 1 :: block_size]
    return _splitmix64(prefix ^ np.uint64(namespace_seed(namespace))).tolist()


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
    mixed = _splitmix64(_as_uint64(tokens, n) ^ _position_keys(start + n)[start:])
    # uint64 array arithmetic wraps silently (no np.errstate needed: it costs more than this).
    sums = np.cumsum(mixed, dtype=np.uint64) + np.uint64(state)
    first_end = (block_size - 1 - start) % block_size  # index of the first block end in `tokens`
    return sums[first_end::block_size].copy(), int(sums[-1])


def hash_block_states(states: np.ndarray, namespace: str | None = None) -> list[int]:
    """Block hashes from the running states at the blocks' ends (see `extend_block_states`)."""
    if len(states) == 0:
        return []
    return _splitmix64(states ^ np.uint64(namespace_seed(namespace))).tolist()


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


@dataclass(frozen=True, slots=True)
class BlockStored:
    """`hashes` became fully cached, in sequence order; `parent` is the block before hashes[0]."""

    hashes: list[int]
    parent: int | None
    medium: str = DEVICE


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """`hashes` stopped being cached on `medium`."""

    hashes: list[int]
    medium: str = DEVICE


@dataclass(frozen=True, slots=True)
class AllCleared:
    """Everything the worker had cached is gone (reset, restart, or the start of a snapshot)."""


KVEvent = BlockStored | BlockRemoved | AllCleared


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


def _encode_event(event: KVEvent) -> list:
    if isinstance(event, BlockStored):
        return [0, event.hashes, event.parent, event.medium]
    if isinstance(event, BlockRemoved):
        return [1, event.hashes, event.medium]
    if isinstance(event, AllCleared):
        return [2]
    raise TypeError(f"not a KV event: {event!r}")


def _decode_event(raw: list) -> KVEvent:
    kind = raw[0]
    if kind == 0:
        return BlockStored(list(raw[1]), raw[2], raw[3])
    if kind == 1:
        return BlockRemoved(list(raw[1]), raw[2])
    if kind == 2:
        return AllCleared()
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

