"""The CPU image answers: `radixray serve --model tiny` in a container, its port published on
127.0.0.1, a chat request from the host, the answer and the `X-Radixray-Worker` header checked,
and the API and admin keys taken from the container's environment (as the manifests pass the
Secrets).

Needs podman and the image `radixray:cpu` (`BASE_IMAGE=debian k8s/build-image.sh cpu`); skips,
saying which is missing, elsewhere. CI builds the image and sets RADIXRAY_REQUIRE_IMAGE=1, and
the test then fails without it (podman missing fails whenever CI=true).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

IMAGE = os.environ.get("RADIXRAY_TEST_IMAGE", "localhost/radixray:cpu")
KEY = "test-key-" + uuid.uuid4().hex[:8]
ADMIN = "test-admin-" + uuid.uuid4().hex[:8]


def _podman(kube: Any) -> str:
    podman = shutil.which("podman")
    if podman is None:
        kube.skip_or_fail("podman is not installed (k8s/host-setup.sh installs it)")
    found = subprocess.run([podman, "image", "exists", IMAGE], capture_output=True)
    if found.returncode != 0:
        reason = f"image {IMAGE} not built: BASE_IMAGE=debian k8s/build-image.sh cpu"
        if os.environ.get("RADIXRAY_REQUIRE_IMAGE") == "1":  # .ci/run built it, or tried
            pytest.fail(reason + " (.ci/run's build failed: see its log)")
        pytest.skip(reason)
    return podman


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def container(kube: Any) -> Iterator[str]:
    podman = _podman(kube)
    name, port = f"radixray-test-{uuid.uuid4().hex[:8]}", _free_port()
    subprocess.run(
        [podman, "run", "-d", "--name", name, "--shm-size=1g",
         "-p", f"127.0.0.1:{port}:8000", "-e", f"RADIXRAY_API_KEY={KEY}",
         "-e", f"RADIXRAY_ADMIN_KEY={ADMIN}",
         IMAGE, "radixray", "serve", "--model", "tiny", "--host", "0.0.0.0", "--port", "8000"],
        check=True, capture_output=True, timeout=120,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            state = subprocess.run([podman, "inspect", "-f", "{{.State.Running}}", name],
                                   capture_output=True, text=True).stdout.strip()
            if state != "true" or time.monotonic() > deadline:
                logs = subprocess.run([podman, "logs", name], capture_output=True, text=True)
                pytest.fail(f"the container did not serve (running={state}):\n"
                            f"{logs.stdout[-3000:]}{logs.stderr[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        subprocess.run([podman, "rm", "-f", "-t", "10", name], capture_output=True, timeout=120)


def test_container_answers_a_chat_request_from_the_host(container: str) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Hello from the host"}]}
    r = httpx.post(container + "/v1/chat/completions", json=body, headers=auth, timeout=120)
    assert r.status_code == 200, r.text
    answer = r.json()
    (choice,) = answer["choices"]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    assert choice["finish_reason"] in ("length", "stop")
    assert 1 <= answer["usage"]["completion_tokens"] <= 8
    assert answer["model"] == "tiny"
    admin = {"Authorization": f"Bearer {ADMIN}"}
    workers = httpx.get(container + "/v1/workers", headers=admin, timeout=30).json()["data"]
    ids = {w["id"] for w in workers}
    assert len(ids) == 2  # `radixray serve`'s default on CPU
    assert r.headers["X-Radixray-Worker"] in ids
    # the same prompt again: deterministic at temperature 0, served from the cache
    again = httpx.post(container + "/v1/chat/completions", json=body, headers=auth, timeout=120)
    assert again.json()["choices"][0]["message"]["content"] == choice["message"]["content"]
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_container_takes_its_api_key_from_the_environment(container: str) -> None:
    body = {"model": "tiny", "max_tokens": 2,
            "messages": [{"role": "user", "content": "no key"}]}
    r = httpx.post(container + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 401
    assert r.json()["error"]["type"] in ("invalid_request_error", "authentication_error")
    wrong = httpx.post(container + "/v1/chat/completions", json=body, timeout=60,
                       headers={"Authorization": "Bearer not-the-key"})
    assert wrong.status_code == 401
    assert httpx.get(container + "/health", timeout=30).status_code == 200  # no key needed
    # the host is not a loopback client of the container: observing and the admin verbs need
    # the admin key, which the inference key does not replace
    api = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(container + "/v1/workers", headers=api, timeout=30).status_code in (401, 403)
    assert httpx.post(container + "/v1/workers", headers=api, json={"count": 1},
                      timeout=30).status_code in (401, 403)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    assert httpx.get(container + "/v1/workers", headers=admin, timeout=30).status_code == 200
