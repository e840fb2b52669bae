"""`EngineEventStream` against a stand-in publisher: plain ZMQ PUB and ROUTER sockets on
127.0.0.1 that speak vLLM's wire format but can also send what a broken publisher would
(malformed frames, unknown tags, wrong types) and skip sequence numbers on purpose. The same
stream against a real vLLM is in tests/vllm/."""

from __future__ import annotations

import asyncio

import msgpack
import zmq
import zmq.asyncio

from mem_cache.events import AllCleared, BlockStored, block_hashes, decode_batch
from router.backends.external.events import EngineEventsConfig, EngineEventStream

BS = 4


def stored(hashes, tokens, parent=None):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": "GPU",
            "lora_name": None}


def payload(*events):
    return msgpack.packb([1.0, list(events), 0])


class StandInPublisher:
    """vLLM's publisher protocol, driven by hand: `send(seq, payload)` publishes; the replay
    socket answers from `buffer` (seq -> payload) starting at the requested seq."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        self.buffer: dict[int, bytes] = {}
        self.replays: list[int] = []
        self.task = asyncio.get_running_loop().create_task(self._serve_replay())

    def endpoints(self) -> tuple[str, str]:
        return (self.pub.getsockopt_string(zmq.LAST_ENDPOINT),
                self.router.getsockopt_string(zmq.LAST_ENDPOINT))

    async def send(self, seq: int, body: bytes, keep: bool = True) -> None:
        if keep:
            self.buffer[seq] = body
        await self.pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), body])

    async def send_frames(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replays.append(first)
            for seq in sorted(self.buffer):
                if seq >= first:
                    await self.router.send_multipart(
                        [client, b"", b"kv-events", seq.to_bytes(8, "big"), self.buffer[seq]])
            await self.router.send_multipart(
                [client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self.task.cancel()
        self.pub.close(0)
        self.router.close(0)


async def _until(predicate, timeout=5.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def held(stream: EngineEventStream) -> list[int]:
    """What the index holds after reading the stream from scratch (snapshot + batches)."""
    out: list[int] = []
    for raw in stream.batches_after(-1, -1):
        for event in decode_batch(raw).events:
            if isinstance(event, AllCleared):
                out = []
            elif isinstance(event, BlockStored):
                out.extend(event.hashes)
    return out


async def _connected(pub: StandInPublisher, stream: EngineEventStream) -> None:
    """Publish seq 0 until the subscription is live (ZMQ drops what a PUB sends before)."""
    await stream.subscribed.wait()
    while stream.engine_seq is None:
        await pub.send(0, payload(stored([1], [1, 2, 3, 4])))
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)  # a repeated seq 0 still in flight reads as a restart: let it land
    stream.outcomes.clear()


def with_rig(test):
    """Runs `test(pub, stream)` on a fresh loop with a stand-in publisher and a live stream."""

    def run() -> None:
        async def body() -> None:
            pub = StandInPublisher()
            events, replay = pub.endpoints()
            config = EngineEventsConfig(events, replay, replay_timeout_s=1)
            stream = EngineEventStream("e0", config, BS)
            stream.start()
            try:
                await asyncio.wait_for(_connected(pub, stream), 10)
                await asyncio.wait_for(test(pub, stream), 20)
            finally:
                await stream.close()
                pub.close()

        asyncio.run(body())

    run.__name__ = test.__name__
    run.__doc__ = test.__doc__
    return run


@with_rig
async def test_malformed_messages_are_counted_and_skipped(pub, stream):
    """A stand-in for a broken publisher: every bad message is counted by reason, the stream
    goes on, and the good message after them is applied."""
    await pub.send_frames([b"kv-events", b"\x00" * 8])  # two frames
    await pub.send_frames([b"kv-events", b"\x01", payload()])  # a 1-byte seq
    await pub.send(1, b"\xc1not msgpack")
    await pub.send(2, msgpack.packb({"ts": 1}))
    await pub.send(3, payload({"type": "BlockMoved", "block_hashes": [1]}))
    await pub.send(4, payload(stored([2], [5, 6, 7, "8"], parent=1)))
    await pub.send(5, payload(stored([2], [5, 6, 7, 8], parent=1)))
    await _until(lambda: stream.engine_seq == 5)
    assert stream.outcomes["malformed_frame"] == 2
    assert stream.outcomes["malformed_payload"] == 2
    assert stream.outcomes["unknown_event"] == 1
    assert stream.outcomes["bad_field"] == 1
    assert held(stream) == block_hashes([1, 2, 3, 4, 5, 6, 7, 8], None, BS)


@with_rig
async def test_gap_is_filled_from_replay(pub, stream):
    await pub.send(1, payload(stored([2], [5, 6, 7, 8], parent=1)), keep=True)
    await _until(lambda: stream.engine_seq == 1)
    pub.buffer[2] = payload(stored([3], [9, 9, 9, 9], parent=2))  # published, but lost
    await pub.send(3, payload(stored([4], [7, 7, 7, 7], parent=3)))
    await _until(lambda: stream.engine_seq == 3)
    assert pub.replays == [2]
    assert stream.outcomes["gap_filled"] == 1 and stream.outcomes["resync"] == 0
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9, 7, 7, 7, 7]
    assert held(stream) == block_hashes(tokens, None, BS)


@with_rig
async def test_gap_beyond_the_replay_buffer_resyncs_from_empty(pub, stream):
    epoch = stream.epoch
    pub.buffer.clear()  # the engine's buffer no longer reaches back
    pub.buffer[7] = payload(stored([8], [3, 3, 3, 3]))
    await pub.send(8, payload(stored([9], [4, 4, 4, 4], parent=8)))
    await _until(lambda: stream.engine_seq == 8)
    assert stream.outcomes["resync"] == 1 and stream.epoch == epoch + 1
    # what came before the gap is gone; what the buffer still had is applied
    assert held(stream) == block_hashes([3, 3, 3, 3, 4, 4, 4, 4], None, BS)
    old = stream.batches_after(epoch, 0)
    assert len(old) == 1 and isinstance(decode_batch(old[0]).events[0], AllCleared)


@with_rig
async def test_restart_purges_and_rejoins(pub, stream):
    """A live seq that goes backwards is a new engine: everything is dropped (a new epoch, so
    a reader of the old one gets a snapshot), then its events are applied from its seq 0."""
    await pub.send(1, payload(stored([2], [5, 6, 7, 8], parent=1)))
    await _until(lambda: stream.engine_seq == 1)
    epoch, seq = stream.epoch, stream.seq
    pub.buffer.clear()
    await pub.send(0, payload(stored([50], [9, 8, 7, 6])))
    await _until(lambda: stream.epoch == epoch + 1 and stream.engine_seq == 0)
    assert stream.outcomes["restart"] == 1
    assert held(stream) == block_hashes([9, 8, 7, 6], None, BS)
    snapshot = decode_batch(stream.batches_after(epoch, seq)[0])
    assert isinstance(snapshot.events[0], AllCleared) and snapshot.epoch == epoch + 1


@with_rig
async def test_reader_gets_batches_after_its_cursor(pub, stream):
    first = stream.batches_after(-1, -1)
    snap = decode_batch(first[0])
    await pub.send(1, payload(stored([2], [5, 6, 7, 8], parent=1)))
    await _until(lambda: stream.engine_seq == 1)
    after = [decode_batch(b) for b in stream.batches_after(snap.epoch, snap.seq)]
    assert [b.seq for b in after] == [snap.seq + 1]
    assert after[0].events == [BlockStored(block_hashes([1, 2, 3, 4, 5, 6, 7, 8], None, BS)[1:],
                                           None, "device")]
