"""An external engine's KV events, read and mirrored in the router's own block hashes.

vLLM and SGLang publish what their prefix cache stores and evicts (`vllm/distributed/kv_events.py`):
each message is `[topic, seq as 8 bytes big-endian, msgpack payload]`, the payload an array
`[ts, events, data_parallel_rank]`, each event a map tagged by `type`: `BlockStored`
(`block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_name`, `medium`,
`extra_keys`, ...), `BlockRemoved` (`block_hashes`, `medium`) or `AllBlocksCleared`.
`parse_payload` validates one payload; anything malformed raises `BadEvent` naming why.

`EngineMirror` keeps, for one engine, what its cache holds, keyed by the engine's block hashes,
and turns every change into the router's own events (`mem_cache.events`): a stored engine block
becomes the router hashes of the router blocks that END inside it, computed from its `token_ids`
and the running hash state after its parent (`extend_block_states`), so the router never
reproduces an engine's hash function and any engine block size maps onto the index's. A router
block is taken as held while the engine block holding its last token is: engines evict a chain
from its tail, and a chain whose inner block went would no longer be matched past it anyway.

Namespaces: the engine's LoRA name and the cache salt (in the first block's `extra_keys`) seed
the chain exactly as `block_hashes(..., namespace)` does: the salt alone is the namespace
(a router with `namespace=S` sends `cache_salt=S`), a LoRA adapter gets `lora:<name>[|<salt>]`.
Blocks with other extra keys (multimodal inputs, prompt embeddings) are not indexed: their
token ids do not identify their content. Media: `GPU` (or none) is the device tier, `CPU` the
host tier; other media (disk, remote) are not indexed. A block whose parent the mirror does
not know (events missed before a resync) cannot be chained and is skipped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from mem_cache.events import (
    DEVICE,
    HOST,
    AllCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    extend_block_states,
    hash_block_states,
)

MEDIA = {None: DEVICE, "GPU": DEVICE, "CPU": HOST}
EngineHash = int | bytes


class BadEvent(ValueError):
    """A message or event that does not follow the format; `reason` labels the metric."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class EngineStored:
    hashes: list[EngineHash]
    parent: EngineHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None
    namespace: str | None
    opaque: bool  # extra keys other than the LoRA name and cache salt: not indexable


@dataclass(frozen=True, slots=True)
class EngineRemoved:
    hashes: list[EngineHash]
    medium: str | None


@dataclass(frozen=True, slots=True)
class EngineCleared:
    pass


EngineEvent = EngineStored | EngineRemoved | EngineCleared


# --- parsing ------------------------------------------------------------------------------------


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise BadEvent("bad_field", what)


def _is_hash(value: object) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or isinstance(value, bytes)


def _optional_str(raw: dict, key: str) -> str | None:
    value = raw.get(key)
    _need(value is None or isinstance(value, str), f"{key} must be a string or null")
    return value


def _hashes(raw: dict) -> list[EngineHash]:
    hashes = raw.get("block_hashes")
    _need(isinstance(hashes, list) and all(_is_hash(h) for h in hashes),
          "block_hashes must be a list of ints or bytes")
    return hashes


def _namespace(lora_name: str | None, extra_keys: object, n: int) -> tuple[str | None, bool]:
    """(namespace, opaque) from the LoRA name and the per-block untagged extra keys."""
    if extra_keys is None:
        return (None if lora_name is None else f"lora:{lora_name}"), False
    _need(isinstance(extra_keys, list) and len(extra_keys) == n,
          "extra_keys must be a list with one entry per block")
    salt = None
    opaque = False
    for i, keys in enumerate(extra_keys):
        _need(keys is None or isinstance(keys, list), "extra_keys entries must be lists or null")
        rest = list(keys or [])
        if lora_name is not None and rest and rest[0] == lora_name:
            rest = rest[1:]
        if i == 0 and rest and isinstance(rest[-1], str):
            salt = rest.pop()  # the cache salt only keys a sequence's first block
        opaque = opaque or bool(rest)
    if lora_name is not None:
        return f"lora:{lora_name}" + (f"|{salt}" if salt is not None else ""), opaque
    return salt, opaque


def _stored(raw: dict) -> EngineStored:
    hashes = _hashes(raw)
    parent = raw.get("parent_block_hash")
    _need(parent is None or _is_hash(parent), "parent_block_hash must be an int, bytes or null")
    tokens = raw.get("token_ids")
    _need(isinstance(tokens, list) and all(type(t) is int for t in tokens),
          "token_ids must be a list of ints")
    block_size = raw.get("block_size")
    _need(type(block_size) is int and block_size > 0, "block_size must be a positive int")
    _need(len(tokens) == len(hashes) * block_size,
          "token_ids must hold block_size tokens per block")
    lora_name = _optional_str(raw, "lora_name")
    namespace, opaque = _namespace(lora_name, raw.get("extra_keys"), len(hashes))
    group = raw.get("group_idx")
    _need(group is None or type(group) is int, "group_idx must be an int or null")
    opaque = opaque or bool(group)  # other KV cache groups (sliding window, mamba) share hashes
    medium = _optional_str(raw, "medium")
    return EngineStored(hashes, parent, tokens, block_size, medium, namespace, opaque)


def _event(raw: object) -> EngineEvent | None:
    if not isinstance(raw, dict):
        raise BadEvent("bad_field", "an event must be a map")
    kind = raw.get("type")
    if kind == "BlockStored":
        return _stored(raw)
    if kind == "BlockRemoved":
        group = raw.get("group_idx")
        _need(group is None or type(group) is int, "group_idx must be an int or null")
        hashes = _hashes(raw)
        return None if group else EngineRemoved(hashes, _optional_str(raw, "medium"))
    if kind == "AllBlocksCleared":
        return EngineCleared()
    raise BadEvent("unknown_event", f"unknown event type {kind!r}")


def parse_payload(payload: object) -> list[EngineEvent]:
    """Events of one decoded payload `[ts, events, data_parallel_rank?]`, validated.

    Raises `BadEvent` on any malformed part: the whole batch is then rejected, so the mirror
    never applies half a batch. Removals from other KV cache groups are dropped (None).
    """
    if not isinstance(payload, list) or len(payload) not in (2, 3):
        raise BadEvent("malformed_payload", "the payload must be [ts, events, dp_rank]")
    ts, events = payload[0], payload[1]
    _need(isinstance(ts, (int, float)) and not isinstance(ts, bool), "ts must be a number")
    _need(isinstance(events, list), "events must be a list")
    if len(payload) == 3:
        _need(payload[2] is None or type(payload[2]) is int, "data_parallel_rank must be an int")
    parsed = [_event(raw) for raw in events]
    return [e for e in parsed if e is not None]


# --- the mirror ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _Chain:
    """Where an engine block ends: position, running hash state, namespace, our hashes."""

    end: int
    state: int
    namespace: str | None
    ours: list[int]


class EngineMirror:
    """One engine's cache in engine hashes, mapped to the router's hashes at `block_size`.

    `apply(events)` returns the router events that mirror the change; `snapshot()` the events
    that rebuild the whole of it from empty. `skipped` counts blocks not indexed, by reason.
    """

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.chains: dict[EngineHash, _Chain] = {}
        self.held: dict[str, dict[EngineHash, int]] = {DEVICE: {}, HOST: {}}  # -> copies
        self.skipped: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self.chains)

    def clear(self) -> None:
        self.chains.clear()
        for blocks in self.held.values():
            blocks.clear()

    def apply(self, events: Sequence[EngineEvent]) -> list[KVEvent]:
        out: list[KVEvent] = []
        for event in events:
            if isinstance(event, EngineStored):
                out.extend(self._store(event))
            elif isinstance(event, EngineRemoved):
                out.extend(self._remove(event))
            else:
                self.clear()
                out.append(AllCleared())
        return out

    def snapshot(self) -> list[KVEvent]:
        """`AllCleared` then every held block's router hashes, per tier, in storing order."""
        out: list[KVEvent] = [AllCleared()]
        for medium, blocks in self.held.items():
            hashes = [h for e in blocks for h in self.chains[e].ours]
            if hashes:
                out.append(BlockStored(hashes, None, medium))
        return out

    def _store(self, event: EngineStored) -> list[KVEvent]:
        medium = MEDIA.get(event.medium)
        n = len(event.hashes)
        if medium is None or event.opaque:
            self.skipped["unsupported"] += n
            return []
        if event.parent is None:
            end, state, namespace = 0, 0, event.namespace
        else:
            parent = self.chains.get(event.parent)
            if parent is None:
                self.skipped["orphan"] += n
                return []
            end, state, namespace = parent.end, parent.state, parent.namespace
        size = event.block_size
        stored: list[int] = []
        for i, h in enumerate(event.hashes):
            tokens = event.token_ids[i * size:(i + 1) * size]
            chain = self.chains.get(h)
            if chain is None:
                states, state = extend_block_states(tokens, end, state, self.block_size)
                chain = _Chain(end + len(tokens), state, namespace, hash_block_states(
                    states, namespace))
                self.chains[h] = chain
            end, state = chain.end, chain.state
            held = self.held[medium]
            held[h] = held.get(h, 0) + 1
            if held[h] == 1:
                stored.extend(chain.ours)
        return [BlockStored(stored, None, medium)] if stored else []

    def _remove(self, event: EngineRemoved) -> list[KVEvent]:
        medium = MEDIA.get(event.medium)
        if medium is None:
            return []
        held = self.held[medium]
        removed: list[int] = []
        for h in event.hashes:
            copies = held.get(h)
            if copies is None:
                continue  # never indexed (skipped, or stored before a resync)
            if copies > 1:
                held[h] = copies - 1
                continue
            del held[h]
            chain = self.chains[h]
            removed.extend(chain.ours)
            if not any(h in blocks for blocks in self.held.values()):
                del self.chains[h]
        return [BlockRemoved(removed, medium)] if removed else []
