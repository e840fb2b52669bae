"""An engine's KV events (vLLM's format) mapped onto the router's own block hashes."""

from __future__ import annotations

import itertools

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mem_cache.events import DEVICE, HOST, AllCleared, BlockRemoved, BlockStored, block_hashes
from router.backends.external.mirror import (
    BadEvent,
    EngineCleared,
    EngineMirror,
    EngineRemoved,
    EngineStored,
    parse_payload,
)

_ids = itertools.count(1000)


def stored(tokens, engine_bs, parent=None, medium="GPU", namespace=None):
    """BlockStored events of `tokens` (whole engine blocks) chained after `parent`."""
    n = len(tokens) // engine_bs
    hashes = [next(_ids) for _ in range(n)]
    event = EngineStored(hashes, parent, list(tokens[: n * engine_bs]), engine_bs, medium,
                         namespace, False)
    return event, hashes


def router_hashes(events):
    held: list[int] = []
    for e in events:
        if isinstance(e, BlockStored):
            held.extend(e.hashes)
        elif isinstance(e, BlockRemoved):
            held = [h for h in held if h not in set(e.hashes)]
        elif isinstance(e, AllCleared):
            held = []
    return held


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50_000), min_size=0, max_size=300),
    engine_bs=st.sampled_from([1, 4, 16, 32, 128]),
    router_bs=st.sampled_from([1, 4, 16, 48, 128]),
    cut=st.integers(0, 20),
    namespace=st.sampled_from([None, "salt", "lora:a"]),
)
def test_stored_chain_gets_the_routers_own_hashes(tokens, engine_bs, router_bs, cut, namespace):
    """Stored in two events (a parent, then its continuation), the mirror reports exactly the
    router hashes `block_hashes` gives for the stored tokens, whatever both block sizes."""
    n = len(tokens) // engine_bs
    split = min(cut, n)
    mirror = EngineMirror(router_bs)
    first, h1 = stored(tokens[: split * engine_bs], engine_bs, namespace=namespace)
    out = mirror.apply([first])
    parent = h1[-1] if h1 else None
    rest = tokens[split * engine_bs:n * engine_bs]
    second, h2 = stored(rest, engine_bs, parent, namespace=namespace)
    if h2:
        out += mirror.apply([second])
    expected = block_hashes(tokens[: n * engine_bs], namespace, router_bs)
    assert router_hashes(out) == expected
    snap = mirror.snapshot()
    assert isinstance(snap[0], AllCleared)
    assert router_hashes(snap) == expected
    # evicting the tail block (as engines do) removes exactly the router blocks ending in it
    if h2 or h1:
        last = (h2 or h1)[-1]
        removed = mirror.apply([EngineRemoved([last], "GPU")])
        kept = block_hashes(tokens[: (n - 1) * engine_bs], namespace, router_bs)
        assert router_hashes(out + removed) == kept
        assert router_hashes(mirror.snapshot()) == kept


def test_copies_and_media_are_counted_apart():
    mirror = EngineMirror(4)
    tokens = list(range(8))
    event = EngineStored([1, 2], None, tokens, 4, "GPU", None, False)
    ours = block_hashes(tokens, None, 4)
    assert mirror.apply([event]) == [BlockStored(ours, None, DEVICE)]
    assert mirror.apply([event]) == []  # a second copy: nothing new for the index
    host = EngineStored([1, 2], None, tokens, 4, "CPU", None, False)
    assert mirror.apply([host]) == [BlockStored(ours, None, HOST)]
    assert mirror.apply([EngineRemoved([2], "GPU")]) == []  # one copy left on the device
    assert mirror.apply([EngineRemoved([2], "GPU")]) == [BlockRemoved(ours[1:], DEVICE)]
    assert mirror.apply([EngineRemoved([1, 2], "CPU")]) == [BlockRemoved(ours, HOST)]
    assert len(mirror) == 1 and router_hashes(mirror.snapshot()) == ours[:1]
    assert mirror.apply([EngineRemoved([9], "GPU"), EngineCleared()]) == [AllCleared()]
    assert len(mirror) == 0 and mirror.snapshot() == [AllCleared()]


def test_unknown_parent_and_opaque_blocks_are_skipped():
    mirror = EngineMirror(4)
    assert mirror.apply([EngineStored([5], 404, [1, 2, 3, 4], 4, "GPU", None, False)]) == []
    assert mirror.apply([EngineStored([6], None, [1, 2, 3, 4], 4, "GPU", None, True)]) == []
    assert mirror.apply([EngineStored([7], None, [1, 2, 3, 4], 4, "DISK", None, False)]) == []
    assert mirror.skipped == {"orphan": 1, "unsupported": 2}
    assert len(mirror) == 0


def _raw(**fields):
    event = {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": None,
             "token_ids": [1, 2, 3, 4], "block_size": 4, "lora_id": None, "medium": "GPU",
             "lora_name": None}
    event.update(fields)
    return event


def test_parse_reads_vllm_payloads():
    payload = msgpack.unpackb(msgpack.packb([1.5, [
        _raw(extra_keys=[["tenant-a"]]),
        _raw(lora_name="ad", extra_keys=[["ad", "s"]]),
        _raw(extra_keys=[[["mm-hash", 0]]]),
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 1},
        {"type": "AllBlocksCleared"},
    ], 0]))
    salted, lora, mm, removed, removed_group, cleared = parse_payload(payload).events
    assert (salted.namespace, salted.opaque) == ("tenant-a", False)
    assert (lora.namespace, lora.opaque) == ("lora:ad|s", False)
    assert mm.opaque
    assert removed == EngineRemoved([7], "GPU")
    assert removed_group == EngineRemoved([7], "GPU", 1)
    assert cleared == EngineCleared()


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ("not a list", "malformed_payload"),
        ([1.0], "malformed_payload"),
        (["ts", []], "bad_field"),
        ([1.0, [], "rank"], "bad_field"),
    ],
)
def test_parse_rejects_malformed_payloads(payload, reason):
    with pytest.raises(BadEvent) as info:
        parse_payload(payload)
    assert info.value.reason == reason


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        ({"type": "BlockEvicted", "block_hashes": []}, "unknown_event"),
        (["BlockStored"], "bad_field"),
        (_raw(token_ids=[1, 2, 3]), "bad_field"),
        (_raw(block_hashes=[1, 2]), "bad_field"),
        (_raw(block_hashes="x"), "bad_field"),
        (_raw(block_size=0), "bad_field"),
        (_raw(token_ids=[1, 2, "3", 4]), "bad_field"),
        (_raw(medium=3), "bad_field"),
        (_raw(extra_keys=[None, None]), "bad_field"),
        (_raw(parent_block_hash=1.5), "bad_field"),
        (_raw(group_idx="0"), "bad_field"),
        (_raw(group_idx=-1), "bad_field"),
        (_raw(kv_cache_spec_kind=5), "bad_field"),
        (_raw(kv_cache_spec_sliding_window="512"), "bad_field"),
        ({"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 1.0},
         "bad_field"),
    ],
)
def test_a_malformed_event_is_left_out_alone(event, reason):
    """Only the malformed event is dropped: the valid events around it in the batch stay."""
    good = _raw(block_hashes=[5])
    parsed = parse_payload([1.0, [good, event, good], 0])
    assert [b.reason for b in parsed.bad] == [reason]
    assert len(parsed.events) == 2 and all(e.hashes == [5] for e in parsed.events)
