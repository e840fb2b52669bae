"""The router's polling of workers: KV events into the index, gap -> snapshot, death, stats.

FakeWorker (app_testkit) stands in for a worker and publishes numbered event batches.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from app_testkit import FakeWorker  # noqa: E402

from mem_cache.events import SessionHeld, block_hashes  # noqa: E402
from router.backends.sync import WorkerSync  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.metrics import RouterMetrics  # noqa: E402
from router.routing.core import RoutingCore  # noqa: E402

PROMPT = list(range(100, 164))  # 4 blocks


def registry() -> WorkerSync:
    return WorkerSync(RouterConfig(), RoutingCore(), RouterMetrics())


def held(reg: WorkerSync, worker_id: str, tokens: list[int]) -> int:
    return reg.core.index.match(block_hashes(tokens)).device.get(worker_id, 0)


def test_join_applies_snapshot_then_follows_batches():
    async def run():
        worker = FakeWorker("w0")
        worker._store(PROMPT[:32], None)  # cached before the router knew it
        reg = registry()
        await reg.add(worker)
        assert held(reg, "w0", PROMPT) == 2
        worker._store(PROMPT, None)
        await reg.poll_events("w0")
        assert held(reg, "w0", PROMPT) == 4
        assert reg.registry["w0"].cursor == (worker.epoch, worker.seq)

    asyncio.run(run())


def test_a_gap_in_seq_is_healed_by_a_snapshot():
    async def run():
        worker = FakeWorker("w0")
        reg = registry()
        await reg.add(worker)
        worker._store(PROMPT[:32], None)
        worker._store(PROMPT, None)
        real = worker.kv_events

        async def lossy(epoch: int, after_seq: int) -> list[bytes]:
            worker.kv_events = real
            return [worker.batches[1][1]]  # seq 2 without seq 1: a gap

        worker.kv_events = lossy
        await reg.poll_events("w0")
        assert reg.registry["w0"].cursor is None  # gap detected: ask for a snapshot next
        await reg.poll_events("w0")
        assert held(reg, "w0", PROMPT) == 4

    asyncio.run(run())


def test_polling_loop_marks_a_dead_worker_and_refreshes_stats():
    async def run():
        alive, dead = FakeWorker("w0"), FakeWorker("w1")
        reg = registry()
        await reg.join([alive, dead])
        dead._store(PROMPT, None)
        await reg.poll_events("w1")
        assert held(reg, "w1", PROMPT) == 4
        dead.dead = True
        alive.active.add("busy")
        reg.config.event_poll_s = 0.01
        reg.start()
        for _ in range(200):
            w0, w1 = reg.registry["w0"], reg.registry["w1"]
            if w1.state == "dead" and w0.stats is not None and w0.stats.running == 1:
                break
            await asyncio.sleep(0.01)
        await reg.stop()
        assert reg.registry["w1"].state == "dead" and held(reg, "w1", PROMPT) == 0
        assert {v.worker_id for v in reg.core.workers()} == {"w0"}
        assert reg.registry["w0"].stats.running == 1

    asyncio.run(run())



def test_a_session_that_moved_is_closed_on_the_worker_it_left():
    """w0 held the session; a turn of it starts on w1 (another replica moved it): the router
    closes w0's stale copy, whose protected KV would otherwise wait for its TTL."""

    async def run():
        w0, w1 = FakeWorker("w0"), FakeWorker("w1")
        reg = registry()
        await reg.join([w0, w1])
        w0.sessions.add("s")
        w0._publish([SessionHeld("s")])
        await reg.poll_events("w0")
        assert reg.core.sessions.get("s") == "w0" and "s" in w0.sessions
        w1.sessions.add("s")
        w1._publish([SessionHeld("s")])
        await reg.poll_events("w1")
        await asyncio.gather(*reg._pending)
        assert "s" not in w0.sessions and "s" in w1.sessions
        assert reg.core.sessions.get("s") == "w1"

    asyncio.run(run())
