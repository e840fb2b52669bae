"""SIGTERM to `radixray serve` while a stream is in flight: the stream completes in full,
then the process exits 0 (the routers drain before the workers stop)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from cluster.cli import build_parser
from cluster.config import ClusterConfig
from cluster.router_link import router_config
from router.config import RouterConfig

MAX_TOKENS = 1500


def _command() -> list[str]:
    exe = shutil.which("radixray")
    return [exe] if exe else [sys.executable, "-m", "cluster.cli"]


def test_deadline_flags_reach_the_routers_config():
    parse = build_parser().parse_args
    default = router_config(ClusterConfig.from_args(parse(["serve"])), "dir")
    assert (default.stall_timeout_s, default.max_concurrent, default.drain_timeout_s) == (
        RouterConfig.stall_timeout_s, RouterConfig.max_concurrent, RouterConfig.drain_timeout_s)
    args = parse(["serve", "--stall-timeout", "7.5", "--max-concurrent", "3",
                  "--drain-timeout", "12"])
    config = router_config(ClusterConfig.from_args(args), "dir")
    assert (config.stall_timeout_s, config.max_concurrent, config.drain_timeout_s) == (7.5, 3, 12)


@pytest.mark.ray
def test_sigterm_drains_a_stream_in_flight_then_exits_0(helpers):
    port = helpers.free_port()
    env = {k: v for k, v in os.environ.items() if k != "RADIXRAY_API_KEY"}
    proc = subprocess.Popen(
        [*_command(), "serve", "--model", "tiny", "--workers", "1", "--port", str(port),
         "--kv-tokens", "4096", "--num-cpus", "2", "--drain-timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        helpers.wait_for(lambda: any("Press Ctrl-C" in x for x in lines) or proc.poll() is not None,
                         240, "radixray serve to answer")
        assert proc.poll() is None, "".join(lines)
        body = {"model": "tiny", "prompt": "drain me", "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": True}
        tokens, finish, done, after_signal = 0, None, False, 0
        signalled_at = None
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            with client.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                        continue
                    if not line.startswith("data: "):
                        continue
                    data = json.loads(line[6:])
                    assert "error" not in data, data
                    choice = data["choices"][0]
                    if choice["text"]:
                        tokens += 1
                        if signalled_at is None:
                            proc.send_signal(signal.SIGTERM)  # what docker stop / k8s send
                            signalled_at = time.monotonic()
                        else:
                            after_signal += 1
                    finish = choice["finish_reason"] or finish
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    print(f"{after_signal} chunks arrived after SIGTERM; exit {time.monotonic() - signalled_at:.1f}"
          " s after it")
    assert done and finish == "length" and tokens >= MAX_TOKENS // 2, "".join(lines)
    assert after_signal > 0  # the stream was still going when the signal came
    assert code == 0, "".join(lines)
