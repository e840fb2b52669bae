"""What a client controls is bounded in time and size, over real HTTP (raw sockets where the
client misbehaves below HTTP): a body that never finishes gets 408 and holds no concurrency
slot meanwhile; headers past the bound get 431 (`X-Session-ID` past 256 characters 400); a
stream whose client stops reading is dropped after the send deadline and its request aborted
on the worker; what uvicorn's parser refuses answers in the OpenAI format; a client that
leaves during its body read logs one line. After each, nothing is left: no admission slot, no
booking on a worker, no session.

FakeWorker (app_testkit) stands in for the worker behind the router.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_testkit import FakeWorker, LiveServer, tiny_dir  # noqa: E402

from router.api.app import create_app  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.tokenizer import Tokenizer  # noqa: E402

LIMIT = 2  # concurrency slots
BODY_TIMEOUT = 1.0
SEND_TIMEOUT = 1.0
OK = {"model": "tiny", "prompt": "fine", "max_tokens": 2}


@pytest.fixture(scope="module")
def live():
    worker = FakeWorker("w0", tokens_per_chunk=16, max_context=1 << 20)
    config = RouterConfig(
        model="tiny", max_concurrent=LIMIT, body_timeout_s=BODY_TIMEOUT,
        send_timeout_s=SEND_TIMEOUT, max_header_bytes=16 * 1024, event_poll_s=0.01,
    )
    app = create_app(config, [worker], tokenizer=Tokenizer(tiny_dir()))
    with LiveServer(app) as server:
        server.worker, server.router = worker, app.state.router
        server.admission = app.state.admission
        yield server


def connect(live, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:  # before connect: the window the client offers stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", live.port))
    return sock


def head(path: str, length: int | None, extra: str = "") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode("latin-1")


def read_response(sock: socket.socket, timeout_s: float) -> tuple[int, dict, bytes]:
    """Status, headers and body of one response (read until its length, or close)."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        assert part, f"closed without a response: {data!r}"
        data += part
    top, _, body = data.partition(b"\r\n\r\n")
    status = int(top.split(b" ")[1])
    headers = {}
    for line in top.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode()] = value.strip().decode()
    length = int(headers.get("content-length", -1))
    while length < 0 or len(body) < length:
        part = sock.recv(65536)
        if not part:
            break
        body += part
    return status, headers, body


def assert_openai_error(status_headers_body, status: int, param=None, code=None) -> dict:
    got, headers, body = status_headers_body
    assert got == status, body
    assert headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def nothing_left(live) -> None:
    deadline = time.monotonic() + 10
    while live.admission.in_flight or live.worker.active:
        assert time.monotonic() < deadline, "a slot or a worker request was left behind"
        time.sleep(0.02)
    assert live.router.registry["w0"].in_flight == 0
    assert live.router.core.ledger.load("w0", time.monotonic()).requests == 0
    assert len(live.router.core.sessions) == 0


def test_unfinished_bodies_get_408_and_hold_no_slot(live):
    # more slow senders than slots: each sent 10 bytes of a longer declared body
    slow = [connect(live) for _ in range(2 * LIMIT)]
    for sock in slow:
        sock.sendall(head("/v1/completions", 100) + b'{"model": ')
    time.sleep(0.2)
    t0 = time.monotonic()
    resp = httpx.post(live.url + "/v1/completions", json=OK, timeout=10)
    assert resp.status_code == 200, resp.text  # they hold no slot: no 429
    assert time.monotonic() - t0 < BODY_TIMEOUT
    for sock in slow:
        error = assert_openai_error(read_response(sock, 5 * BODY_TIMEOUT), 408,
                                    code="request_timeout")
        assert f"{BODY_TIMEOUT:g} s" in error["message"]
        sock.settimeout(5)
        assert sock.recv(1) == b""  # and the connection is closed
        sock.close()
    nothing_left(live)


def test_oversized_and_overlong_headers(live):
    long_session = {"X-Session-ID": "s" * 257}
    resp = httpx.post(live.url + "/v1/completions", json=OK, headers=long_session)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "X-Session-ID"
    ok = httpx.post(live.url + "/v1/completions", json=OK, headers={"X-Session-ID": "s" * 256})
    assert ok.status_code == 200
    assert httpx.delete(live.url + "/v1/sessions/" + "s" * 256).json()["deleted"]
    # many headers, none large: the total is bounded
    many = {f"X-Pad-{i}": "p" * 100 for i in range(200)}
    resp = httpx.post(live.url + "/v1/completions", json=OK, headers=many)
    assert resp.status_code == 431, resp.text
    assert resp.json()["error"]["code"] == "request_header_fields_too_large"
    # one huge header is cut off while it arrives, not buffered whole: the header never ends
    # (no blank line is ever sent), so the 431 can only come from counting it as it arrives.
    # How much the client manages to send first is the kernel's socket buffers, not the router.
    sock = connect(live)
    sock.sendall(head("/v1/completions", 2, "X-Session-ID: ")[:-2])
    try:
        for _ in range(64):  # up to 4 MB
            sock.sendall(b"s" * 65536)
    except OSError:  # the router answered and closed while we were still sending
        pass
    assert_openai_error(read_response(sock, 5), 431, code="request_header_fields_too_large")
    sock.close()
    nothing_left(live)


def test_bad_content_length_gets_the_openai_error_body(live):
    for value in (b"abc", b"-1", b"1, 2"):
        sock = connect(live)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + value
                     + b"\r\n\r\n{}")
        assert_openai_error(read_response(sock, 5), 400)
        sock.close()
    nothing_left(live)


def test_client_gone_during_body_read_logs_one_line(live):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    watched = [logging.getLogger("uvicorn.error"), logging.getLogger("radixray.router")]
    levels = [logger.level for logger in watched]
    for logger in watched:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        for _ in range(3):
            sock = connect(live)
            sock.sendall(head("/v1/chat/completions", 1000) + b'{"model": "tiny"')
            time.sleep(0.1)
            sock.close()
        time.sleep(0.3)
    finally:
        for logger, level in zip(watched, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)
    assert not [r for r in records if r.exc_info], [r.getMessage() for r in records]
    lines = [r.getMessage() for r in records]
    assert len(lines) == 3 and all("left before its request body" in m for m in lines), lines
    nothing_left(live)


def slow_readers(live) -> float:
    text = httpx.get(live.url + "/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("radixray_slow_readers_total"))
    return float(line.split()[1])


@pytest.mark.parametrize("n", [1, 2])
def test_a_client_that_stops_reading_is_dropped_and_its_request_aborted(live, n):
    aborted, dropped = len(live.worker.aborted), slow_readers(live)
    body = json.dumps({"model": "tiny", "prompt": "a long story", "max_tokens": 500_000,
                       "ignore_eos": True, "stream": True, "n": n}).encode()
    sock = connect(live, rcvbuf=4096)
    sock.sendall(head("/v1/completions", len(body)) + body)
    t0 = time.monotonic()
    while len(live.worker.aborted) < aborted + n:  # the router gave up on the client
        assert time.monotonic() - t0 < 60, "the stream was never dropped"
        time.sleep(0.05)
    nothing_left(live)  # every choice aborted on the worker, its slot and booking released
    assert slow_readers(live) == dropped + 1
    # the connection was closed before the end of the stream
    sock.settimeout(10)
    received = bytearray()
    while part := sock.recv(1 << 20):
        received += part
    sock.close()
    assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received
    # the router still serves
    assert httpx.post(live.url + "/v1/completions", json=OK, timeout=10).status_code == 200
