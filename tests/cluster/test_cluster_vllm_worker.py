"""The parts of `radixray serve --engine vllm` that need neither Ray nor vLLM: the config it
derives, vLLM's command line, and the reaper that leaves no process behind (a stand-in server
that starts a child of its own, as vLLM's server starts its engine core)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

from cluster.cli import build_parser
from cluster.config import VLLM_PYTHON_ENV, ClusterConfig
from cluster.fleet import Member
from cluster.router_link import member_backend
from cluster.vllm_worker import Reaped, VllmConfig, VllmPorts
from cluster.worker_pool import Worker, engine_config
from router.backends.external.probe import PROBE_TOKENS
from router.backends.http import HttpBackend

REPO = Path(__file__).parents[2]

# a server that starts a child (its "engine core") and runs until killed
SERVER = textwrap.dedent("""
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print("serving", flush=True)
    time.sleep(300)
""")


def group(pgid: int) -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return out


def wait_until(check, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.1)


def started(tmp_path) -> Reaped:
    log = tmp_path / "server.log"
    server = Reaped(sys.executable, [sys.executable, "-c", SERVER], dict(os.environ), log)
    wait_until(lambda: "serving" in log.read_text())
    wait_until(lambda: len(group(server.group)) == 3)  # reaper, server, its child
    return server


def test_engine_flags_make_a_vllm_config(monkeypatch):
    monkeypatch.setenv(VLLM_PYTHON_ENV, "/opt/vllm/bin/python")
    args = build_parser().parse_args(
        ["serve", "--engine", "vllm", "--model", "/models/m", "--dtype", "bfloat16",
         "--cpus-per-worker", "4", "--api-key", "k",
         "--vllm-args", "--max-model-len 4096 --enforce-eager", "--probe-tokens", "256"])
    config = ClusterConfig.from_args(args)
    vllm = engine_config(config, "cpu")
    assert vllm == VllmConfig(model="/models/m", python="/opt/vllm/bin/python",
                              args=("--max-model-len", "4096", "--enforce-eager"), device="cpu",
                              dtype="bfloat16", cpu_threads=4, api_key="k", probe_tokens=256)
    assert engine_config(ClusterConfig(engine="vllm"), "cpu").probe_tokens == PROBE_TOKENS
    with pytest.raises(ValueError, match="probe_tokens"):
        ClusterConfig(engine="vllm", probe_tokens=-1)
    assert ClusterConfig.from_dict({"engine": "vllm", "vllm_python": "/p",
                                    "vllm_args": "--enforce-eager"}).vllm_args == [
        "--enforce-eager"]
    assert ClusterConfig().engine == "radixray"  # the default engine is ours


def test_routers_price_a_vllm_member_with_its_workers_probe():
    """A vLLM worker probes its engine once (`VllmWorker.ready` answers `speeds`); each router
    replica takes those figures and sends no probe of its own."""
    endpoints = {"url": "http://10.0.0.7:8001", "events": "tcp://10.0.0.7:8002",
                 "replay": "tcp://10.0.0.7:8003"}
    worker = Worker("worker-0", actor=None, slot=None)
    worker.served({"endpoints": endpoints,
                   "speeds": {"prefill_tokens_per_s": 310.0, "decode_step_s": 0.03}})
    member = Member("worker-0", None, "ready", 0, None, worker.endpoints, worker.speeds)
    backend = member_backend(member)
    assert isinstance(backend, HttpBackend) and backend.base_url == endpoints["url"]
    assert backend.probe_tokens == 0  # no probe from the router
    assert backend.speed.probed == (310.0, 0.03)
    assert backend.speed.prefill_tokens_per_s == 310.0  # what it reports until timings come
    unmeasured = member_backend(Member("worker-1", None, "ready", 0, None, endpoints, {
        "prefill_tokens_per_s": 0.0, "decode_step_s": 0.0}))
    assert unmeasured.probe_tokens == 0 and unmeasured.speed.probed == (0.0, 0.0)


def test_our_engines_kv_knobs_are_refused_for_vllm():
    with pytest.raises(ValueError, match="vllm_args"):
        ClusterConfig(engine="vllm", kv_tokens=4096)
    with pytest.raises(ValueError, match="engine must be one of"):
        ClusterConfig(engine="sglang")


def test_vllm_command_turns_on_prefix_caching_and_kv_events():
    config = VllmConfig(model="m", python="/p", args=("--enforce-eager",), dtype="float32",
                        api_key="secret")
    cmd = config.command("/models/m", "10.0.0.5", VllmPorts(8001, 5557, 5558))
    assert cmd[:3] == ["/p", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--model") + 1] == "/models/m"
    assert cmd[cmd.index("--host") + 1] == "10.0.0.5"
    assert cmd[cmd.index("--port") + 1] == "8001"
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(cmd)
    events = json.loads(cmd[cmd.index("--kv-events-config") + 1])
    assert events["enable_kv_cache_events"] and events["publisher"] == "zmq"
    # wildcard endpoints: vLLM binds those (it would connect to any other)
    assert (events["endpoint"], events["replay_endpoint"]) == ("tcp://*:5557", "tcp://*:5558")
    assert cmd[-1] == "--enforce-eager" and cmd[cmd.index("--dtype") + 1] == "float32"
    assert "secret" not in cmd  # the key goes in the environment, not on the command line
    env = config.environment("worker-3")
    assert env["VLLM_API_KEY"] == "secret" and env["RADIXRAY_WORKER_ID"] == "worker-3"
    assert env["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize("bf16_units", [False, True])
def test_vllm_runs_float32_on_a_cpu_that_would_emulate_bfloat16(monkeypatch, bf16_units):
    # the CPU's flags stand in for the two kinds of machine (this one has one of them)
    monkeypatch.setattr("cluster.vllm_worker.cpu_compute_dtype",
                        lambda: torch.bfloat16 if bf16_units else torch.float32)
    unasked = None if bf16_units else "float32"  # vLLM's own choice is bfloat16 on any x86

    def dtype_flag(**kwargs) -> str | None:
        cmd = VllmConfig(model="m", python="/p", **kwargs).command("/m", "h", VllmPorts(1, 2, 3))
        return cmd[cmd.index("--dtype") + 1] if "--dtype" in cmd else None

    assert dtype_flag() == unasked
    assert dtype_flag(dtype="auto") == (unasked or "auto")
    assert dtype_flag(dtype="bfloat16") == "bfloat16"  # asked for: given as asked
    assert dtype_flag(device="cuda") is None  # a GPU: vLLM's own choice
    assert dtype_flag(device="cuda", dtype="auto") == "auto"


def test_a_killed_server_takes_its_children_along(tmp_path):
    server = started(tmp_path)
    members = group(server.group)
    main = next(p for p in members if p.cmdline()[1:3] == ["-c", SERVER])
    main.send_signal(signal.SIGKILL)
    assert server.wait() == str(-signal.SIGKILL)
    wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                               for p in members))


def test_a_killed_reaper_still_takes_the_server_along(tmp_path):
    server = started(tmp_path)
    members = group(server.group)
    reaper = next(p for p in members if p.cmdline()[1] == "-c" and "os.killpg" in p.cmdline()[2])
    reaper.send_signal(signal.SIGKILL)
    assert server.wait() == "killed"
    wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                               for p in members))


def test_closing_kills_the_whole_group(tmp_path):
    server = started(tmp_path)
    members = group(server.group)
    server.close()
    wait_until(lambda: not group(server.group))
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in members)


def test_nothing_outlives_the_process_that_started_it(tmp_path):
    """The actor killed outright (`ray.kill`, a crash): its reaped server goes with it."""
    owner_code = textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        from cluster.vllm_worker import Reaped
        server = Reaped(sys.executable, [sys.executable, "-c", {SERVER!r}], dict(os.environ),
                        Path({str(tmp_path / "server.log")!r}))
        print(server.group, flush=True)
        time.sleep(300)
    """)
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE,
                             text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    pgid = int(owner.stdout.readline())
    wait_until(lambda: len(group(pgid)) == 3)
    owner.kill()
    owner.wait()
    wait_until(lambda: not group(pgid))
