"""sse_json: the payloads of an OpenAI SSE stream (HTTP backend and `radixray bench`)."""

import asyncio

import pytest

from router.backends.sse import sse_json


async def _lines(*lines: bytes):
    for line in lines:
        yield line


def _collect(*lines: bytes) -> list:
    async def run():
        return [body async for body in sse_json(_lines(*lines))]

    return asyncio.run(run())


def test_payloads_up_to_done_skipping_comments_and_blank_lines():
    got = _collect(
        b": keep-alive\n", b"\n", b'data: {"a": 1}\n', b"event: x\n", b'data:{"b": 2}\r\n',
        b"data: [DONE]\n", b'data: {"after": "done"}\n',
    )
    assert got == [{"a": 1}, {"b": 2}]


def test_a_stream_cut_before_done_yields_what_came():
    assert _collect(b'data: {"a": 1}\n') == [{"a": 1}]


def test_a_payload_that_is_not_json_raises_value_error():
    with pytest.raises(ValueError):
        _collect(b"data: {not json\n")
