"""Real vLLM servers for tests: started on 127.0.0.1 with prefix caching and KV events on.

The model is the built-in `tiny` with its attention re-cut to vLLM-CPU's smallest supported
head size (2 heads of 32 instead of 4 of 16; the weight shapes are the same), so the tests load
in seconds. The KV pool is a few 128-token blocks so that evictions happen.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BLOCK = 128  # vLLM-CPU's block size


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_dtype() -> str:
    """The dtype to run a vLLM-CPU engine in on this machine: bfloat16 where the CPU computes it
    natively, else float32 (vLLM's own choice, bfloat16 on any x86 CPU, is emulated there and
    ~4x slower; `worker.loader.weights.auto_dtype`)."""
    sys.path.insert(0, str(Path(__file__).parents[2]))
    from worker.loader.weights import cpu_compute_dtype

    return str(cpu_compute_dtype()).removeprefix("torch.")


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """The benches' `--dtype` for their vLLM engines (and radixray's, where a bench runs one),
    defaulting to `cpu_dtype()`."""
    parser.add_argument("--dtype", default=cpu_dtype(), choices=("bfloat16", "float32"),
                        help="the engines' dtype (default: bfloat16 "
                        "where the CPU computes it natively, vLLM's own choice on a float32 "
                        "checkpoint; else float32, where vLLM would emulate bfloat16 ~4x slower)")


def vllm_model_dir(root: Path) -> Path:
    """The built-in tiny model with 32-wide attention heads, written under `root`."""
    sys.path.insert(0, str(Path(__file__).parents[2]))
    from worker.loader.builtin import resolve_model

    out = root / "tiny-vllm"
    if not out.exists():
        shutil.copytree(resolve_model("tiny"), out)
        config = json.loads((out / "config.json").read_text())
        config.update(num_attention_heads=2, num_key_value_heads=1, head_dim=32)
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


class VllmServer:
    """One vLLM OpenAI server in its own process group; `start`, `wait`, `kill`."""

    def __init__(self, python: str, model: Path, log: Path, kv_blocks: int = 12,
                 max_model_len: int = 1024, dtype: str | None = None) -> None:
        self.python = python
        self.dtype = dtype  # None: vLLM's own choice (bfloat16 for a float32 checkpoint on x86)
        self.model = model
        self.log = log
        self.kv_blocks = kv_blocks
        self.max_model_len = max_model_len
        self.port = free_port()
        # ipc, not tcp: vLLM binds its PUB socket only for wildcard or ipc endpoints (it
        # connects to any other), and a tcp port picked here can be taken by one of the ports
        # vLLM picks for its own processes before it binds it
        self.events = f"ipc://{log.parent / log.stem}-events.sock"
        self.replay = f"ipc://{log.parent / log.stem}-replay.sock"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spec(self) -> str:
        """This engine as a `radixray route --worker` argument."""
        return f"{self.url},events={self.events},replay={self.replay}"

    def start(self) -> None:
        kv_events = {"enable_kv_cache_events": True, "publisher": "zmq",
                     "endpoint": self.events, "topic": "kv-events",
                     "replay_endpoint": self.replay}
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
               "--enforce-eager", "--max-model-len", str(self.max_model_len),
               "--num-gpu-blocks-override", str(self.kv_blocks), "--max-num-seqs", "8",
               "--enable-prefix-caching", "--enable-prompt-tokens-details",
               "--kv-events-config", json.dumps(kv_events)]
        if self.dtype is not None:
            cmd += ["--dtype", self.dtype]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                   OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="WARNING")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def wait(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited; see {self.log}:\n" + self._tail())
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"vLLM did not start in {timeout_s}s; see {self.log}")

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def kill(self) -> None:
        """SIGKILL the server and its engine processes (its own process group)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None
