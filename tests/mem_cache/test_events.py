"""block_hashes and the KV event wire format: what router and workers must agree on."""

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mem_cache.events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    KVGroup,
    SessionHeld,
    SessionReleased,
    block_hashes,
    decode_batch,
    encode_batch,
    namespace_seed,
)

token_lists = st.lists(st.integers(0, 200_000), max_size=80)


@given(token_lists, token_lists, st.sampled_from([1, 4, 16]))
def test_hashes_agree_exactly_on_the_shared_full_blocks(a, b, block_size):
    ha, hb = block_hashes(a, block_size=block_size), block_hashes(b, block_size=block_size)
    shared = 0
    while shared < min(len(a), len(b)) and a[shared] == b[shared]:
        shared += 1
    same_blocks = shared // block_size
    assert ha[:same_blocks] == hb[:same_blocks]
    # After the first differing block every hash differs (a prefix hash, not a per-block hash).
    for i in range(same_blocks, min(len(ha), len(hb))):
        assert ha[i] != hb[i]


@given(token_lists, st.sampled_from([1, 16]))
def test_one_hash_per_full_block_in_u64(tokens, block_size):
    hashes = block_hashes(tokens, block_size=block_size)
    assert len(hashes) == len(tokens) // block_size
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in hashes)


def test_list_tensor_and_array_inputs_hash_the_same():
    tokens = list(range(1000, 1100))
    expected = block_hashes(tokens)
    assert block_hashes(torch.tensor(tokens)) == expected
    assert block_hashes(np.array(tokens, dtype=np.int64)) == expected
    assert block_hashes(tuple(tokens)) == expected


def test_namespaces_never_share_a_hash():
    tokens = list(range(64))
    plain, lora, salt = (block_hashes(tokens, ns) for ns in (None, "lora-a", "tenant-7"))
    assert not set(plain) & set(lora)
    assert not set(lora) & set(salt)
    assert namespace_seed(None) != namespace_seed("")


def test_block_order_matters():
    a = [1] * 16 + [2] * 16
    b = [2] * 16 + [1] * 16
    assert set(block_hashes(a)).isdisjoint(block_hashes(b))


def test_bad_block_size_is_rejected():
    with pytest.raises(ValueError):
        block_hashes([1, 2, 3], block_size=0)


def test_batch_round_trip_keeps_every_event():
    events = [
        BlockStored([1, 2**64 - 1], None),
        BlockStored([3], 2**64 - 1, "host"),
        BlockRemoved([2**64 - 1]),
        AllCleared(),
        SessionHeld("chat-7"),
        SessionReleased("chat-7"),
        BlockStored([4, 5], 3, group=KVGroup(2, "sliding_window", 512)),
        BlockRemoved([5], "host", KVGroup(0, "mamba")),
        BlockStored([6], None, group=KVGroup(1)),
    ]
    batch = decode_batch(encode_batch("worker-3", 17, 42, events))
    assert (batch.worker_id, batch.epoch, batch.seq) == ("worker-3", 17, 42)
    assert batch.events == events


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        msgpack.packb([1, 2]),
        msgpack.packb(["w", 1, 2, [[9]]]),
        msgpack.packb(["w", 1, 2, [[3, 5]]]),  # a session id that is not a string
        msgpack.packb(["w", 1, 2, [[4]]]),  # a session event without its id
        msgpack.packb(["w", 1, 2, [[0, [1], None, "device", 0, "sliding_window"]]]),  # no window
        msgpack.packb(["w", 1, 2, [[1, [1], "device", 0, "sliding_window", None]]]),
        msgpack.packb(["w", 1, 2, [[1, [1], "device", 0, "cross_attention", None]]]),
        msgpack.packb(["w", 1, 2, [[1, [1], "device", -1, "full_attention", None]]]),
        msgpack.packb(["w", 1, 2, [[1, [1], "device", True, "full_attention", None]]]),
    ],
)
def test_malformed_batches_raise_value_error(data):
    with pytest.raises(ValueError):
        decode_batch(data)


@pytest.mark.parametrize(
    "fields",
    [("sliding_window", None), ("full_attention", 512), ("mamba", 16), ("sliding_window", 0)],
)
def test_a_window_is_given_exactly_for_sliding_window_groups(fields):
    with pytest.raises(ValueError):
        KVGroup(0, *fields)
