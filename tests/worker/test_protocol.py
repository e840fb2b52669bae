"""The router <-> worker messages survive msgpack unchanged, and newer peers stay readable."""

import msgpack

from worker.protocol import (
    GenerateRequest,
    SamplingParams,
    TokenChunk,
    WorkerStats,
    from_msgpack,
    to_msgpack,
)


def test_generate_request_round_trip():
    request = GenerateRequest(
        "req-1",
        [1, 2, 3],
        SamplingParams(max_tokens=7, temperature=0.5, seed=3, stop_token_ids=[9], logprobs=2),
        namespace="lora-a",
        session_id="s1",
        resume_ids=[4, 5],
    )
    assert from_msgpack(GenerateRequest, to_msgpack(request)) == request


def test_token_chunk_round_trip_with_top_logprobs():
    chunk = TokenChunk(
        "req-1",
        [5, 6],
        finish_reason="length",
        prompt_tokens=3,
        cached_tokens=2,
        logprobs=[-0.1, -0.2],
        top_logprobs=[[(5, -0.1), (7, -2.0)], [(6, -0.2), (1, -3.0)]],
    )
    assert from_msgpack(TokenChunk, to_msgpack(chunk)) == chunk


def test_unknown_keys_from_a_newer_peer_are_ignored():
    raw = msgpack.unpackb(to_msgpack(WorkerStats("w0", kv_total=10)), raw=False)
    raw["a_field_from_the_future"] = 1
    stats = from_msgpack(WorkerStats, msgpack.packb(raw))
    assert stats == WorkerStats("w0", kv_total=10)
