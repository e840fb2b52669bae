"""LoadLedger.first_token: the booked prefill queue follows the worker's real progress."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.routing.bookings import Booking, LoadLedger
from router.routing.core import RoutingCore
from router.routing.policies import make_policy


def booking(request_id: str, prefill_s: float = 1.0, worker: str = "w0") -> Booking:
    return Booking(
        request_id, worker, prefill_tokens=1000, decode_tokens=50, active_tokens=1050,
        prefill_s=prefill_s, prefill_done_at=0.0,
    )  # fmt: skip


def test_an_early_first_token_pulls_the_queue_behind_it_forward() -> None:
    ledger = LoadLedger()
    for rid in "abc":
        ledger.book(booking(rid), now=0.0)
    assert ledger.queue_s("w0", 0.0) == 3.0
    ledger.first_token("a", now=0.4)  # predicted at 1.0
    assert ledger.queue_s("w0", 0.4) == pytest.approx(2.0)
    assert ledger.load("w0", 0.4).prefill_tokens == 2000  # a's prefill left the queue
    ledger.first_token("b", now=1.4)  # predicted 2.0, corrected to 1.4: on time now
    assert ledger.queue_s("w0", 1.4) == pytest.approx(1.0)


def test_a_late_worker_is_charged_once_not_once_per_request_behind() -> None:
    ledger = LoadLedger()
    for rid in "abc":
        ledger.book(booking(rid), now=0.0)
    ledger.first_token("a", now=2.0)  # one second late: b and c will be too
    assert ledger.queue_s("w0", 2.0) == pytest.approx(2.0)
    ledger.first_token("b", now=3.0)  # late by the same second only
    assert ledger.queue_s("w0", 3.0) == pytest.approx(1.0)
    ledger.first_token("b", now=3.5)  # a second first token changes nothing
    assert ledger.queue_s("w0", 3.5) == pytest.approx(0.5)


def test_release_after_the_first_token_leaves_the_queue_alone() -> None:
    ledger = LoadLedger()
    ledger.book(booking("a"), now=0.0)
    ledger.book(booking("b"), now=0.0)
    ledger.first_token("a", now=0.5)
    ledger.release("a", now=0.6)  # a decoded and ended: its prefill was taken off already
    assert ledger.queue_s("w0", 0.6) == pytest.approx(0.9)
    assert ledger.load("w0", 0.6).prefill_tokens == 1000
    assert ledger.first_token("gone", now=0.7) is None


@given(
    st.lists(st.floats(0.01, 2.0), min_size=1, max_size=12),
    st.lists(st.floats(-0.5, 0.5), min_size=12, max_size=12),
)
def test_corrected_queue_matches_a_fifo_worker(prefills: list[float], noise: list[float]) -> None:
    """A FIFO worker whose real prefill times differ from the predicted ones: after each first
    token, the ledger's queue equals the rest of the predicted work from that moment."""
    ledger = LoadLedger()
    for i, p in enumerate(prefills):
        ledger.book(booking(f"r{i}", p), now=0.0)
    now = 0.0
    for i, p in enumerate(prefills):
        now += max(0.001, p + noise[i] * p)  # the real prefill time
        ledger.first_token(f"r{i}", now)
        assert ledger.queue_s("w0", now) == pytest.approx(sum(prefills[i + 1:]), abs=1e-9)
        assert ledger.load("w0", now).prefill_tokens == 1000 * (len(prefills) - i - 1)


def test_the_core_books_and_corrects_on_its_own_clock() -> None:
    now = [0.0]
    core = RoutingCore(make_policy("least_load"), clock=lambda: now[0], block_size=16)
    core.add_worker("w0")
    core.route("a", [1, 2, 3], 48, 8)
    core.route("b", [4, 5, 6], 48, 8)
    before = core.ledger.queue_s("w0", 0.0)
    assert before > 0
    core.first_token("a")  # at t=0: far earlier than predicted
    assert core.ledger.queue_s("w0", 0.0) < before
