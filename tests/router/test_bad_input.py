"""Bad client input: every case gets the OpenAI error body with the right 4xx, never a 5xx,
and leaves nothing behind (no request on a worker, no booking, no session).

FakeWorker (app_testkit) stands in for the worker behind the router.
"""

from __future__ import annotations

import json
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

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def live():
    worker = FakeWorker("w0", max_context=256)
    config = RouterConfig(model="tiny", api_key="k", max_body_bytes=64 * 1024)
    app = create_app(config, [worker], tokenizer=Tokenizer(tiny_dir()))
    with LiveServer(app) as server:
        server.worker, server.router = worker, app.state.router
        server.http = httpx.Client(base_url=server.url, headers={"Authorization": "Bearer k"})
        yield server


def post(live, path, body=None, raw: bytes | None = None, headers=None):
    data = raw if raw is not None else json.dumps(body).encode()
    h = {"Content-Type": "application/json", **(headers or {})}
    return live.http.post(path, content=data, headers=h)


def assert_error(resp, status, param=None, code=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    assert resp.headers["x-radixray-worker"] == "none"


CASES = [
    ("malformed json", CHAT, None, b'{"model": "tiny", "messages": [', 400, None),
    ("not an object", CHAT, [1, 2], None, 400, None),
    ("invalid utf-8", CHAT, None, b'{"model": "tiny", "messages": "\xff\xfe"}', 400, None),
    ("deep nesting", CHAT, None, b"[" * 30000 + b"]" * 30000, 400, None),
    ("missing messages", CHAT, {"model": "tiny"}, None, 400, "messages"),
    ("missing prompt", COMP, {"model": "tiny"}, None, 400, "prompt"),
    ("empty messages", CHAT, {"model": "tiny", "messages": []}, None, 400, "messages"),
    (
        "bad role",
        CHAT,
        {"model": "tiny", "messages": [{"role": "x", "content": "a"}]},
        None,
        400,
        "messages.0.role",
    ),
    ("messages wrong type", CHAT, {"model": "tiny", "messages": "hi"}, None, 400, "messages"),
    (
        "max_tokens wrong type",
        CHAT,
        {"model": "tiny", "messages": MSG, "max_tokens": "ten"},
        None,
        400,
        "max_tokens",
    ),
    (
        "negative max_tokens",
        CHAT,
        {"model": "tiny", "messages": MSG, "max_tokens": -5},
        None,
        400,
        "max_tokens",
    ),
    (
        "zero max_tokens",
        COMP,
        {"model": "tiny", "prompt": "a", "max_tokens": 0},
        None,
        400,
        "max_tokens",
    ),
    (
        "huge max_tokens",
        CHAT,
        {"model": "tiny", "messages": MSG, "max_tokens": 10**12},
        None,
        400,
        "max_tokens",
    ),
    (
        "absurd max_tokens",
        COMP,
        {"model": "tiny", "prompt": "a", "max_tokens": 10**40},
        None,
        400,
        "max_tokens",
    ),
    (
        "temperature too high",
        CHAT,
        {"model": "tiny", "messages": MSG, "temperature": 2.5},
        None,
        400,
        "temperature",
    ),
    (
        "temperature negative",
        COMP,
        {"model": "tiny", "prompt": "a", "temperature": -1},
        None,
        400,
        "temperature",
    ),
    (
        "temperature NaN",
        COMP,
        None,
        b'{"model": "tiny", "prompt": "a", "temperature": NaN}',
        400,
        "temperature",
    ),
    ("top_p zero", COMP, {"model": "tiny", "prompt": "a", "top_p": 0}, None, 400, "top_p"),
    ("n too large", COMP, {"model": "tiny", "prompt": "a", "n": 1000}, None, 400, "n"),
    (
        "stream not bool",
        COMP,
        {"model": "tiny", "prompt": "a", "stream": "yes"},
        None,
        400,
        "stream",
    ),
    ("prompt too long", COMP, {"model": "tiny", "prompt": "word " * 400}, None, 400, None),
    (
        "prompt + max_tokens too long",
        COMP,
        {"model": "tiny", "prompt": "a b c", "max_tokens": 255},
        None,
        400,
        "max_tokens",
    ),
    ("empty prompt", COMP, {"model": "tiny", "prompt": ""}, None, 400, "prompt"),
    (
        "token id out of vocab",
        COMP,
        {"model": "tiny", "prompt": [1, 2, 10**9]},
        None,
        400,
        "prompt",
    ),
    ("negative token id", COMP, {"model": "tiny", "prompt": [-1]}, None, 400, "prompt"),
    (
        "stop_token_ids out of vocab",
        COMP,
        {"model": "tiny", "prompt": "a", "stop_token_ids": [99999999]},
        None,
        400,
        "stop_token_ids",
    ),
    (
        "min_tokens over max_tokens",
        COMP,
        {"model": "tiny", "prompt": "a", "max_tokens": 2, "min_tokens": 5},
        None,
        400,
        "min_tokens",
    ),
    (
        "logprobs too many",
        COMP,
        {"model": "tiny", "prompt": "a", "logprobs": 50},
        None,
        400,
        "logprobs",
    ),
    (
        "top_logprobs without logprobs",
        CHAT,
        {"model": "tiny", "messages": MSG, "top_logprobs": 2},
        None,
        400,
        "top_logprobs",
    ),
    (
        "image content part",
        CHAT,
        {
            "model": "tiny",
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
        },
        None,
        400,
        "messages[0].content",
    ),
    ("seed too large", COMP, {"model": "tiny", "prompt": "a", "seed": 1 << 70}, None, 400, "seed"),
    # strict numbers: a string or a boolean is not an integer (OpenAI and vLLM answer 400)
    *[
        (f"{field} {value!r}", path, {**base, field: value}, None, 400, param)
        for field, value, path, base, param in [
            ("max_tokens", "5", CHAT, {"model": "tiny", "messages": MSG}, "max_tokens"),
            ("max_tokens", True, CHAT, {"model": "tiny", "messages": MSG}, "max_tokens"),
            ("max_tokens", 5.0, COMP, {"model": "tiny", "prompt": "a"}, "max_tokens"),
            ("max_completion_tokens", "5", CHAT, {"model": "tiny", "messages": MSG},
             "max_completion_tokens"),
            ("n", True, COMP, {"model": "tiny", "prompt": "a"}, "n"),
            ("seed", "7", COMP, {"model": "tiny", "prompt": "a"}, "seed"),
            ("top_k", False, COMP, {"model": "tiny", "prompt": "a"}, "top_k"),
            ("min_tokens", "1", COMP, {"model": "tiny", "prompt": "a"}, "min_tokens"),
            ("logprobs", True, COMP, {"model": "tiny", "prompt": "a"}, "logprobs"),
            ("top_logprobs", "2", CHAT, {"model": "tiny", "messages": MSG, "logprobs": True},
             "top_logprobs"),
            ("stop_token_ids", [True], COMP, {"model": "tiny", "prompt": "a"},
             "stop_token_ids.0"),
            ("prompt", [5, True], COMP, {"model": "tiny"}, "prompt"),
            ("temperature", "0.5", COMP, {"model": "tiny", "prompt": "a"}, "temperature"),
            ("top_p", True, COMP, {"model": "tiny", "prompt": "a"}, "top_p"),
        ]
    ],
    (
        "tool message without tool_call_id",
        CHAT,
        {"model": "tiny", "messages": [*MSG, {"role": "tool", "content": "42"}]},
        None,
        400,
        "messages.1.tool_call_id",
    ),
    (
        "session id empty",
        COMP,
        {"model": "tiny", "prompt": "a", "session_id": ""},
        None,
        400,
        "session_id",
    ),
]


@pytest.mark.parametrize("name,path,body,raw,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_openai_error(live, name, path, body, raw, status, param):
    assert_error(post(live, path, body, raw), status, param)


def test_unknown_model_is_404_model_not_found(live):
    resp = post(live, CHAT, {"model": "gpt-17", "messages": MSG})
    assert_error(resp, 404, "model", "model_not_found")


def test_bad_or_missing_api_key_is_401(live):
    for headers in ({"Authorization": "Bearer nope"}, {"Authorization": "k"}):
        resp = httpx.post(live.url + CHAT, json={"model": "tiny", "messages": MSG}, headers=headers)
        assert_error(resp, 401, code="invalid_api_key")
    assert_error(httpx.get(live.url + "/v1/models"), 401, code="invalid_api_key")


def test_oversized_body_is_413(live):
    big = {"model": "tiny", "prompt": "a" * (100 * 1024)}
    assert_error(post(live, COMP, big), 413)

    def chunks():  # no Content-Length: the limit holds while reading
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(100):
            yield b"a" * 1024
        yield b'"}'

    resp = live.http.post(COMP, content=chunks(), headers={"Content-Type": "application/json"})
    assert_error(resp, 413)


def test_unknown_route_and_wrong_method_use_openai_body(live):
    assert_error(live.http.get("/v1/nothing"), 404)
    assert_error(live.http.get(CHAT), 405)


def test_admin_without_control_is_501_and_unknown_worker_404(live):
    assert_error(live.http.post("/v1/admin/workers", json={"count": 1}), 501)
    assert_error(live.http.delete("/v1/admin/workers/nope"), 404)
    assert_error(live.http.post("/v1/admin/workers/nope/drain"), 404)
    assert_error(live.http.post("/v1/admin/workers", content=b"{bad"), 400)


def test_router_keeps_serving_and_nothing_leaked(live):
    resp = post(live, CHAT, {"model": "tiny", "messages": MSG, "max_tokens": 3})
    assert resp.status_code == 200 and resp.headers["x-radixray-worker"] == "w0"
    time.sleep(0.05)
    assert len(live.worker.requests) == 1  # no bad request ever reached the worker
    assert not live.worker.active and live.router.registry["w0"].in_flight == 0
    assert len(live.router.core.sessions) == 0
    assert live.router.core.ledger.load("w0", time.monotonic()).requests == 0
