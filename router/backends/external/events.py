"""The KV event stream of one external engine, subscribed on ZMQ and served as the router's own
numbered event batches.

`EngineEventStream` runs on the router's event loop. It reads the engine's PUB socket
(`[topic, seq, payload]`, see `external.mirror`), checks the sequence, applies each valid
batch to an `EngineMirror` and keeps the resulting router events as batches numbered in the
router's own `(epoch, seq)` (`mem_cache.events.encode_batch`). `batches_after(epoch, seq)` is
what `Backend.kv_events` returns: the batches after a cursor, or a snapshot when the cursor is of
another epoch or older than what is kept. So the router's registry reads an external engine
exactly as it reads its own workers.

Sequence: the engine numbers its batches 0, 1, 2, ... from its start. A gap (a message lost,
or the router joining late) is filled from the engine's replay socket (a DEALER sends
`[b"", start_seq]`; the ROUTER answers every buffered batch from there, then an end marker
whose seq is -1); when the replay no longer reaches back (or there is none) the mirror resyncs
from empty: it is cleared, and blocks chained to what was missed are skipped. A live seq that
goes backwards is an engine restart: the mirror is cleared and a new epoch begins, so the
router drops everything it had for that worker. `purge()` does the same on the backend's word
(the engine answers again after a failure with a new start time).

Bad input never stops the stream: each malformed frame, payload or event is counted in
`outcomes` (by reason; `radixray route` exports them as `radixray_engine_events_total`),
logged once per reason, and skipped: a malformed event alone, not the rest of its batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, deque
from dataclasses import dataclass

import msgpack
import zmq
import zmq.asyncio

from mem_cache.events import KVEvent, encode_batch
from router.backends.external.mirror import BadEvent, EngineMirror, parse_payload

log = logging.getLogger("radixray.router")

END_SEQ = -1  # seq of the replay's end marker (8 bytes, signed)


@dataclass
class EngineEventsConfig:
    """How one engine's stream is read.

    events: the engine's PUB endpoint, e.g. tcp://10.0.0.5:5557.
    replay: its replay (ROUTER) endpoint, or None when it has none (gaps then resync).
    keep_batches: router batches kept for readers behind; older readers get a snapshot.
    replay_timeout_s: how long a replay may take before the stream resyncs instead.
    """

    events: str
    replay: str | None = None
    keep_batches: int = 4096
    replay_timeout_s: float = 5.0


class EngineEventStream:
    """One engine's events as the router's numbered batches; see the module docstring."""

    def __init__(self, worker_id: str, config: EngineEventsConfig, block_size: int) -> None:
        """`block_size`: the router's hashing block size (the index granularity), which the
        engine's blocks are re-hashed at."""
        self.worker_id = worker_id
        self.config = config
        self.mirror = EngineMirror(block_size)
        self.outcomes: Counter[str] = Counter()
        self.epoch = 0
        self.seq = 0  # of the router's last batch in this epoch (0: none yet)
        self.engine_seq: int | None = None  # last engine seq applied
        self._live_seq: int | None = None  # last engine seq read from the PUB socket
        self._batches: deque[tuple[int, bytes]] = deque(maxlen=config.keep_batches)
        self._logged: set[str] = set()
        self._ctx = zmq.asyncio.Context.instance()
        self._task: asyncio.Task | None = None
        self.subscribed = asyncio.Event()

    # --- the reader's side -------------------------------------------------------------------

    def batches_after(self, epoch: int, after_seq: int) -> list[bytes]:
        """Encoded batches after `after_seq` of `epoch`, or a snapshot (starting with
        AllCleared) when the epoch differs or those batches are no longer kept."""
        oldest = self._batches[0][0] if self._batches else self.seq + 1
        if epoch != self.epoch or after_seq > self.seq or after_seq + 1 < oldest:
            return [encode_batch(self.worker_id, self.epoch, self.seq, self.mirror.snapshot())]
        return [batch for seq, batch in self._batches if seq > after_seq]

    def purge(self, reason: str) -> None:
        """Forget everything the engine held (it restarted): a new epoch, an empty mirror."""
        self._count(reason)
        self.mirror = EngineMirror(self.mirror.block_size)  # its groups too: another model?
        self.epoch += 1
        self.seq = 0
        self._batches.clear()
        self.engine_seq = None

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Starts reading on the running loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.config.events)
        self.subscribed.set()
        try:
            while True:
                frames = await sub.recv_multipart()
                try:
                    await self._receive(frames)
                except Exception as exc:  # noqa: BLE001 - nothing an engine sends may stop us
                    self._reject("internal", repr(exc))
        finally:
            sub.close()

    # --- one message ---------------------------------------------------------------------------

    async def _receive(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._reject("malformed_frame", f"{len(frames)} frames")
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        live, self._live_seq = self._live_seq, seq
        if live is not None and seq <= live:
            log.warning("engine %s restarted (seq %d after %d): purged", self.worker_id, seq, live)
            self.purge("restart")
        if self.engine_seq is not None and seq <= self.engine_seq:
            return  # already applied from a replay
        expected = 0 if self.engine_seq is None else self.engine_seq + 1
        if seq > expected:
            await self._fill(expected, seq)
            if self.engine_seq is not None and seq <= self.engine_seq:
                return
        self._apply(seq, frames[2])

    async def _fill(self, start: int, until: int) -> None:
        """Batches `start..until-1` from the replay socket, or a resync from empty."""
        replayed = await self._replay(start) if self.config.replay else []
        if not replayed or replayed[0][0] > start:
            self._resync(start, until)
            replayed = [(s, p) for s, p in replayed if s < until]
        else:
            self._count("gap_filled")
        for seq, payload in replayed:
            if seq < until and (self.engine_seq is None or seq > self.engine_seq):
                self._apply(seq, payload)

    def _resync(self, start: int, until: int) -> None:
        """Engine batches were lost for good: start over from empty, in a new epoch."""
        log.warning("engine %s: events %d..%d lost, index resynced from empty",
                    self.worker_id, start, until - 1)
        self.purge("resync")

    async def _replay(self, start: int) -> list[tuple[int, bytes]]:
        """The engine's buffered batches from `start` (empty when it does not answer)."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.config.replay)
        out: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(
                    dealer.recv_multipart(), self.config.replay_timeout_s
                )
                if len(frames) != 4 or len(frames[2]) != 8:
                    self._reject("malformed_frame", f"replay answer of {len(frames)} frames")
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return out
                out.append((seq, frames[3]))
        except TimeoutError:
            self._reject("replay_timeout", f"no end marker within {self.config.replay_timeout_s}s")
            return []
        finally:
            dealer.close()

    def _apply(self, seq: int, payload: bytes) -> None:
        self.engine_seq = seq
        try:
            parsed = parse_payload(msgpack.unpackb(payload, raw=False, strict_map_key=False))
        except BadEvent as exc:
            self._reject(exc.reason, str(exc))
            return
        except (ValueError, TypeError, msgpack.exceptions.ExtraData) as exc:
            self._reject("malformed_payload", repr(exc))
            return
        for exc in parsed.bad:
            self._reject(exc.reason, str(exc))
        skipped = sum(self.mirror.skipped.values())
        routed = self.mirror.apply(parsed.events)
        if sum(self.mirror.skipped.values()) > skipped:
            self._count("skipped_blocks")
        self._count("applied")
        if routed:
            self._publish(routed)

    def _publish(self, events: list[KVEvent]) -> None:
        self.seq += 1
        self._batches.append((self.seq, encode_batch(self.worker_id, self.epoch, self.seq, events)))

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] += 1

    def _reject(self, reason: str, detail: str) -> None:
        self._count(reason)
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("engine %s: KV event skipped (%s): %s (logged once per reason)",
                        self.worker_id, reason, detail)
