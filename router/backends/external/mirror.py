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

KV groups (hybrid models): vLLM tags each event with its cache group (`group_idx`; stores also
`kv_cache_spec_kind` and `kv_cache_spec_sliding_window`) and sends every group's events of a
step in one batch. Block hashes are equal across groups. A sliding-window group stores only
the blocks of the last window, yet its event carries every token since its parent (or since
the sequence start, with a null parent): the hashes are the event's LAST blocks. Decode steps
send sliding-group events with no hash at all. Copies are counted per (medium, group, hash):
vLLM keeps duplicate physical copies and removes each with its own `BlockRemoved`. The router
events carry the group as `mem_cache.events.KVGroup`; events without `group_idx` (older vLLM,
SGLang) carry none, as before. Within a batch, full-attention stores are applied first, so
that a sliding group's blocks take the chain (and the namespace: the cache salt sits only in a
sequence's first block) its full-attention twin gave them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from mem_cache.events import (
    DEVICE,
    FULL_ATTENTION,
    HOST,
    RECURRENT,
    SLIDING_WINDOW,
    AllCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVGroup,
    extend_block_states,
    hash_block_states,
)

MEDIA = {None: DEVICE, "GPU": DEVICE, "CPU": HOST}
EngineHash = int | bytes
# vLLM's `kv_cache_spec_kind`s -> how a group's blocks allow a resume; other kinds (chunked
# local attention, encoder, cross attention, unknown) are not indexed
KINDS = {
    "full_attention": FULL_ATTENTION,
    "mla_attention": FULL_ATTENTION,
    "sink_full_attention": FULL_ATTENTION,
    "sliding_window": SLIDING_WINDOW,
    "sliding_window_mla": SLIDING_WINDOW,
    "mamba": RECURRENT,
}


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
    group: int | None = None  # vLLM's group_idx; None: the engine sends no groups
    kind: str | None = None  # its kv_cache_spec_kind
    window: int | None = None  # its kv_cache_spec_sliding_window


@dataclass(frozen=True, slots=True)
class EngineRemoved:
    hashes: list[EngineHash]
    medium: str | None
    group: int | None = None


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


def _optional_int(raw: dict, key: str) -> int | None:
    value = raw.get(key)
    _need(value is None or type(value) is int, f"{key} must be an int or null")
    return value


def _stored(raw: dict) -> EngineStored:
    hashes = _hashes(raw)
    parent = raw.get("parent_block_hash")
    _need(parent is None or _is_hash(parent), "parent_block_hash must be an int, bytes or null")
    tokens = raw.get("token_ids")
    _need(isinstance(tokens, list) and all(type(t) is int for t in tokens),
          "token_ids must be a list of ints")
    block_size = raw.get("block_size")
    _need(type(block_size) is int and block_size > 0, "block_size must be a positive int")
    # a sliding-window group's hashes are the last blocks of the tokens since the parent
    _need(len(tokens) % block_size == 0 and len(hashes) <= len(tokens) // block_size,
          "token_ids must hold whole blocks, at least one per hash")
    lora_name = _optional_str(raw, "lora_name")
    namespace, opaque = _namespace(lora_name, raw.get("extra_keys"), len(hashes))
    group = _optional_int(raw, "group_idx")
    _need(group is None or group >= 0, "group_idx must be >= 0")
    kind = _optional_str(raw, "kv_cache_spec_kind")
    window = _optional_int(raw, "kv_cache_spec_sliding_window")
    medium = _optional_str(raw, "medium")
    return EngineStored(hashes, parent, tokens, block_size, medium, namespace, opaque, group,
                        kind, window)


def _event(raw: object) -> EngineEvent:
    if not isinstance(raw, dict):
        raise BadEvent("bad_field", "an event must be a map")
    kind = raw.get("type")
    if kind == "BlockStored":
        return _stored(raw)
    if kind == "BlockRemoved":
        group = _optional_int(raw, "group_idx")
        return EngineRemoved(_hashes(raw), _optional_str(raw, "medium"), group)
    if kind == "AllBlocksCleared":
        return EngineCleared()
    raise BadEvent("unknown_event", f"unknown event type {kind!r}")


@dataclass(frozen=True, slots=True)
class Parsed:
    """One payload's valid events, in order, and the malformed ones left out."""

    events: list[EngineEvent]
    bad: list[BadEvent]


def parse_payload(payload: object) -> Parsed:
    """Events of one decoded payload `[ts, events, data_parallel_rank?]`, validated.

    A malformed payload raises `BadEvent` naming why (nothing of it is applied); a malformed
    event inside a valid payload is left out on its own (`Parsed.bad`): the other events of
    the batch, other groups' among them, still count.
    """
    if not isinstance(payload, list) or len(payload) not in (2, 3):
        raise BadEvent("malformed_payload", "the payload must be [ts, events, dp_rank]")
    ts, events = payload[0], payload[1]
    _need(isinstance(ts, (int, float)) and not isinstance(ts, bool), "ts must be a number")
    _need(isinstance(events, list), "events must be a list")
    if len(payload) == 3:
        _need(payload[2] is None or type(payload[2]) is int, "data_parallel_rank must be an int")
    parsed, bad = [], []
    for raw in events:
        try:
            parsed.append(_event(raw))
        except BadEvent as exc:
            bad.append(exc)
    return Parsed(parsed, bad)


# --- the mirror ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _Chain:
    """Where an engine block ends: position, running hash state, namespace, our hashes."""

    end: int
    state: int
    namespace: str | None
    ours: list[int]


Held = tuple[str, int | None]  # (medium, group index or None)


def _first(event: EngineEvent) -> bool:
    """Applied first within a batch: full-attention (or group-less) stores."""
    return isinstance(event, EngineStored) and KINDS.get(event.kind, FULL_ATTENTION) == (
        FULL_ATTENTION)


class EngineMirror:
    """One engine's cache in engine hashes, mapped to the router's hashes at `block_size`.

    `apply(events)` returns the router events that mirror the change; `snapshot()` the events
    that rebuild the whole of it from empty. `skipped` counts blocks not indexed, by reason.
    `groups` holds the engine's KV groups as its stores described them.
    """

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.chains: dict[EngineHash, _Chain] = {}
        # (medium, group) -> engine hash -> copies
        self.held: dict[Held, dict[EngineHash, int]] = {(DEVICE, None): {}, (HOST, None): {}}
        self.groups: dict[int, KVGroup | None] = {}  # None: a kind the router does not index
        self.skipped: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self.chains)

    def clear(self) -> None:
        self.chains.clear()
        for blocks in self.held.values():
            blocks.clear()

    def apply(self, events: Sequence[EngineEvent]) -> list[KVEvent]:
        out: list[KVEvent] = []
        for event in _full_attention_first(events):
            if isinstance(event, EngineStored):
                out.extend(self._store(event))
            elif isinstance(event, EngineRemoved):
                out.extend(self._remove(event))
            else:
                self.clear()
                out.append(AllCleared())
        return out

    def snapshot(self) -> list[KVEvent]:
        """`AllCleared` then every held block's router hashes, per tier and group, in storing
        order."""
        out: list[KVEvent] = [AllCleared()]
        for (medium, index), blocks in self.held.items():
            hashes = [h for e in blocks for h in self.chains[e].ours]
            if hashes:
                group = None if index is None else self.groups[index]
                out.append(BlockStored(hashes, None, medium, group))
        return out

    def _group(self, event: EngineStored) -> KVGroup | None | bool:
        """The router's group of a stored event; False: not indexed. Events of a group
        without a kind (a vLLM that sends only `group_idx`) count as full attention in group
        0 and are not indexed in the others, as group-less engines are."""
        if event.group is None:
            return None
        if event.kind is None:
            return None if event.group == 0 else False
        kind = KINDS.get(event.kind)
        window = event.window if kind == SLIDING_WINDOW else None
        try:
            group = None if kind is None else KVGroup(event.group, kind, window)
        except ValueError:
            group = None
        known = self.groups.setdefault(event.group, group)
        return False if known is None or known != group else group

    def _store(self, event: EngineStored) -> list[KVEvent]:
        medium = MEDIA.get(event.medium)
        group = self._group(event)
        n = len(event.hashes)
        if medium is None or event.opaque or group is False or (
                medium == HOST and group is not None and group.kind != FULL_ATTENTION):
            self.skipped["unsupported"] += n
            return []
        if n == 0:
            return []  # a decode step's sliding-window event: nothing of it is kept
        key = (medium, None if group is None else group.index)
        known = [self.chains.get(h) for h in event.hashes]
        if all(chain is not None for chain in known):  # another group's twins placed them
            return self._hold(key, group, event.hashes, known)
        if event.parent is None:
            end, state, namespace = 0, 0, event.namespace
        else:
            parent = self.chains.get(event.parent)
            if parent is None:
                self.skipped["orphan"] += n
                return []
            end, state, namespace = parent.end, parent.state, parent.namespace
        size = event.block_size
        # Without twins, a window's hashes are taken as the last blocks: vLLM keeps a
        # finished prompt's last window (and, past a shared prefix, the window before it)
        first = len(event.token_ids) // size - n  # blocks before the hashed ones
        chains: list[_Chain] = []
        for i in range(first + n):
            h = event.hashes[i - first] if i >= first else None
            chain = None if h is None else self.chains.get(h)
            if chain is None:
                tokens = event.token_ids[i * size:(i + 1) * size]
                states, state = extend_block_states(tokens, end, state, self.block_size)
                chain = _Chain(end + len(tokens), state, namespace, hash_block_states(
                    states, namespace))
                if h is not None:
                    self.chains[h] = chain
            end, state = chain.end, chain.state
            if h is not None:
                chains.append(chain)
        return self._hold(key, group, event.hashes, chains)

    def _hold(self, key: Held, group: KVGroup | None, hashes: list[EngineHash],
              chains: Sequence[_Chain | None]) -> list[KVEvent]:
        """One more copy of each block in `key`; the router events of the first copies."""
        held = self.held.setdefault(key, {})
        stored: list[int] = []
        for h, chain in zip(hashes, chains, strict=True):
            held[h] = held.get(h, 0) + 1
            if held[h] == 1:
                stored.extend(chain.ours)
        return [BlockStored(stored, None, key[0], group)] if stored else []

    def _remove(self, event: EngineRemoved) -> list[KVEvent]:
        medium = MEDIA.get(event.medium)
        if medium is None:
            return []
        index = event.group
        if index == 0 and 0 not in self.groups:
            index = None  # a kind-less group 0 is stored group-less (see `_group`)
        group = None if index is None else self.groups.get(index)
        held = self.held.get((medium, index))
        if held is None or (index is not None and group is None):
            return []  # a group never indexed
        removed: list[int] = []
        for h in event.hashes:
            copies = held.get(h)
            if copies is None:
                continue  # never indexed (skipped, or stored before a resync)
            if copies > 1:
                held[h] = copies - 1
                continue
            del held[h]
            removed.extend(self.chains[h].ours)
            if not any(h in blocks for blocks in self.held.values()):
                del self.chains[h]
        return [BlockRemoved(removed, medium, group)] if removed else []


def _full_attention_first(events: Sequence[EngineEvent]) -> list[EngineEvent]:
    """The batch with, between clears, full-attention stores ahead of the other events (each
    group's own events keep their order: groups are independent but for the chains)."""
    out: list[EngineEvent] = []
    segment: list[EngineEvent] = []
    for event in [*events, None]:
        if event is None or isinstance(event, EngineCleared):
            out.extend(e for e in segment if _first(e))
            out.extend(e for e in segment if not _first(e))
            segment = []
            if event is not None:
                out.append(event)
        else:
            segment.append(event)
    return out
