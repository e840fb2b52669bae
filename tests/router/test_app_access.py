"""Who may call what (router/api/access.py), over real HTTP: the inference key never opens the
admin verbs; without an admin key they answer loopback clients only; `/metrics` and
`GET /v1/workers` answer the admin key or loopback, or everyone with `metrics_public`. A
refused call changes nothing: both workers stay and keep serving.

A client on another host is a request through a proxy on the router's host that names it in
`X-Forwarded-For` (uvicorn takes the client from it when the peer is on loopback).
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from app_testkit import FakeWorker, LiveServer, tiny_dir  # noqa: E402

from router.api.access import ADMIN, INFERENCE, OBSERVE, OPEN, is_loopback, route_class  # noqa: E402
from router.api.app import create_app  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.tokenizer import Tokenizer  # noqa: E402

REMOTE = {"X-Forwarded-For": "203.0.113.7"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class Control:
    def __init__(self) -> None:
        self.started = 0

    async def add_worker(self):
        self.started += 1
        return FakeWorker(f"added{self.started}")

    def remove_worker(self, worker_id: str) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(tiny_dir())


def serve(tokenizer, **config):
    app = create_app(RouterConfig(model="tiny", **config), [FakeWorker("w0"), FakeWorker("w1")],
                     control=Control(), tokenizer=tokenizer)
    return LiveServer(app)


def bearer(key: str, **extra: str) -> dict:
    return {"Authorization": f"Bearer {key}", **extra}


def admin_calls(url: str, headers: dict) -> list[httpx.Response]:
    """Every admin verb once: add, drain, remove (both spellings of the paths)."""
    return [
        httpx.post(url + "/v1/workers", json={"count": 1}, headers=headers),
        httpx.post(url + "/v1/workers/w0/drain", headers=headers),
        httpx.delete(url + "/v1/workers/w1", headers=headers),
        httpx.post(url + "/v1/admin/workers", json={"count": 1}, headers=headers),
        httpx.delete(url + "/v1/admin/workers/w0", headers=headers),
    ]


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def still_serving(server, key: str | None = None) -> None:
    assert {w.worker_id for w in server.app.state.router.registry} == {"w0", "w1"}
    headers = bearer(key) if key else {}
    resp = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=headers)
    assert resp.status_code == 200, resp.text
    assert httpx.get(server.url + "/health").status_code == 200


def test_the_inference_key_never_opens_admin(tokenizer):
    with serve(tokenizer, api_key="k", admin_key="a") as server:
        for resp in admin_calls(server.url, bearer("k")):
            error = error_of(resp, 403)
            assert error["code"] == "admin_forbidden" and "admin key" in error["message"]
        for headers in ({}, bearer("wrong")):
            for resp in admin_calls(server.url, headers):
                assert error_of(resp, 401)["code"] == "invalid_admin_key"
        for resp in admin_calls(server.url, bearer("k", **REMOTE)):
            assert resp.status_code == 403
        still_serving(server, "k")
        # the admin key opens admin (from anywhere), and not inference
        assert error_of(httpx.post(server.url + "/v1/chat/completions", json=CHAT,
                                   headers=bearer("a")), 401)["code"] == "invalid_api_key"
        added = httpx.post(server.url + "/v1/workers", json={"count": 1},
                           headers=bearer("a", **REMOTE))
        assert added.json()["added"] == ["added1"]
        removed = httpx.delete(server.url + "/v1/workers/added1", headers=bearer("a"))
        assert removed.json() == {"id": "added1", "state": "removed"}
        still_serving(server, "k")


def test_without_an_admin_key_admin_answers_loopback_only(tokenizer):
    with serve(tokenizer, api_key="k") as server:
        for resp in admin_calls(server.url, bearer("k", **REMOTE)):
            error = error_of(resp, 403)
            assert "loopback" in error["message"] and "--admin-key" in error["message"]
        still_serving(server, "k")
        # the same call from the router's own host is served, with or without a key
        added = httpx.post(server.url + "/v1/workers", json={"count": 1})
        assert added.json()["added"] == ["added1"]
        assert httpx.delete(server.url + "/v1/workers/added1").status_code == 200
        still_serving(server, "k")


def test_metrics_and_worker_list_follow_the_documented_rule(tokenizer):
    with serve(tokenizer, api_key="k", admin_key="a") as server:
        for path in ("/metrics", "/v1/workers"):
            assert httpx.get(server.url + path).status_code == 200  # loopback
            assert httpx.get(server.url + path, headers=bearer("a", **REMOTE)).status_code == 200
            assert error_of(httpx.get(server.url + path, headers=REMOTE), 401)
            assert error_of(httpx.get(server.url + path, headers=bearer("k", **REMOTE)), 403)
        assert httpx.get(server.url + "/health", headers=REMOTE).status_code == 200
    with serve(tokenizer, metrics_public=True) as server:
        for path in ("/metrics", "/v1/workers"):
            assert httpx.get(server.url + path, headers=REMOTE).status_code == 200
        for resp in admin_calls(server.url, REMOTE):  # the switch opens no verb
            assert resp.status_code == 403
        still_serving(server)


def test_route_classes_and_loopback_addresses():
    assert route_class("POST", "/v1/workers") == ADMIN
    assert route_class("DELETE", "/v1/workers/worker-0") == ADMIN
    assert route_class("POST", "/v1/workers/worker-0/drain") == ADMIN
    assert route_class("GET", "/v1/admin/anything") == ADMIN
    assert route_class("GET", "/v1/workers") == OBSERVE
    assert route_class("GET", "/metrics") == OBSERVE
    assert route_class("POST", "/v1/chat/completions") == INFERENCE
    assert route_class("DELETE", "/v1/sessions/s") == INFERENCE
    assert route_class("GET", "/v1/models") == INFERENCE
    assert route_class("GET", "/health") == OPEN
    for host in ("127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1"):
        assert is_loopback((host, 1))
    for client in (("10.0.0.1", 1), ("::ffff:10.0.0.1", 1), ("203.0.113.7", 1), ("x", 1), None):
        assert not is_loopback(client)
