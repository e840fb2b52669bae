"""Helpers for the cluster tests: free ports, the idle-accounting check, worker lookups."""

from __future__ import annotations

import socket
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def workers_json(url: str) -> list[dict]:
    return httpx.get(url + "/v1/workers", timeout=30).json()["data"]


def balanced(row: dict, allow_session: bool = False) -> bool:
    """A worker at idle: every slot is free or evictable cache, nothing locked or held."""
    return (
        row["kv_free"] + row["kv_evictable"] + row["kv_session"] == row["kv_total"] > 0
        and row["kv_protected"] == 0
        and (allow_session or row["kv_session"] == 0)
        and row["running"] == 0
        and row["waiting"] == 0
    )


def assert_idle_accounting(url: str, timeout_s: float = 30.0) -> None:
    """Every ready worker's KV accounting balances at idle (stats lag a poll, so wait a bit)."""
    deadline = time.monotonic() + timeout_s
    rows: list[dict] = []
    while time.monotonic() < deadline:
        rows = [r for r in workers_json(url) if r["state"] == "ready"]
        if rows and all(balanced(r) for r in rows):
            return
        time.sleep(0.5)
    pytest.fail(f"idle KV accounting does not balance: {rows}")


def wait_for(predicate, timeout_s: float, what: str, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}")


@pytest.fixture(scope="session")
def helpers():
    """The helpers above, for test modules (importlib mode: they cannot import conftest)."""

    class Helpers:
        pass

    h = Helpers()
    for fn in (free_port, workers_json, balanced, assert_idle_accounting, wait_for):
        setattr(h, fn.__name__, staticmethod(fn))
    return h
