"""`VllmWorker`: one vLLM engine as a worker of the fleet (`radixray serve --engine vllm`).

The actor takes the worker's bundle (its GPUs through `CUDA_VISIBLE_DEVICES`, as Ray sets it, or
its CPUs) and runs vLLM's OpenAI server as a child process on free ports of its node, with
prefix caching and KV events on:

    <vllm python> -m vllm.entrypoints.openai.api_server --model DIR --host NODE_IP --port P
        --enable-prefix-caching --enable-prompt-tokens-details
        --kv-events-config '{"publisher": "zmq", "endpoint": "tcp://*:E",
                             "replay_endpoint": "tcp://*:R", ...}'  <--vllm-args>

`ready()` answers once the server does, with its `endpoints`: the same `{"url", "events",
"replay"}` that `radixray route` takes for an engine it did not start, at the node's IP, so a
router on any node reaches them. The routers make an `HttpBackend` that follows its events
(`cluster/route.py`, `spec_backend`). Before its first answer the worker probes its engine's
prefill speed and decode step (`router.backends.external.probe`, as `radixray route` does at
join) and answers them too (`speeds`): one probe per engine, while it is idle, where each
router replica probing it at join would time its prompts among the other replicas' (and then
discard them).

Lifetimes. vLLM's server starts processes of its own (the engine core and its workers) that
outlive it when it is killed, so it runs under a reaper: a few lines of Python in a process
group of its own, that waits for the server and then kills the whole group, and does the same as
soon as this actor is gone, however it went (`ray.kill`, a crash): the actor holds the only
write end of a pipe the reaper reads, which the kernel closes when the actor's process ends. No
vLLM process outlives its worker. When the server dies after it served (killed, out of
memory), the actor exits with it, so that Ray restarts the actor (`max_restarts`): the new one
starts a new server on new ports and comes back empty; the fleet tells the routers, which purge
the old engine's index entries when it dies and attach the new one's endpoints. A server that
fails before it ever served fails the worker's first start with the end of its log; in an actor
Ray restarted it exits again, so Ray tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch

from router.backends.external.probe import PROBE_TOKENS
from router.backends.http import HttpBackend
from worker.loader.builtin import resolve_model
from worker.loader.weights import cpu_compute_dtype

log = logging.getLogger("radixray.cluster")

WORKER_ID_ENV = "RADIXRAY_WORKER_ID"  # in the server's environment: which worker it is
PORT_ATTEMPTS = 3  # a free port picked here can be taken before vLLM binds it: try anew
HEALTH_POLL_S = 0.5

# The reaper: argv = [life fd, report fd, the server's command...]. Started in a new process
# group (start_new_session), it forks away from the actor at once (Ray kills an actor's own
# children when it exits, which would leave vLLM's processes behind), runs the server, and kills
# the whole group when the server exits (after writing its exit status to `report`) or when the
# life pipe, whose write end only the actor holds, reads EOF: the actor is gone.
REAPER = """
import os, signal, subprocess, sys, threading
life, report = int(sys.argv[1]), int(sys.argv[2])
if os.fork():
    os._exit(0)
def reap():
    os.killpg(0, signal.SIGKILL)
def watch():
    while os.read(life, 1):
        pass
    reap()
threading.Thread(target=watch, daemon=True).start()
code = subprocess.call(sys.argv[3:])
os.write(report, str(code).encode())
reap()
"""


@dataclass(frozen=True)
class VllmConfig:
    """What every vLLM worker of a fleet runs.

    model: a model name, .gguf file or HF directory (`worker.loader.builtin.resolve_model`; it
    must exist on every node). python: the interpreter of an environment with vLLM installed.
    args: more flags for vLLM's server (`--vllm-args`, e.g. `--max-model-len 4096`). device:
    cuda or cpu. dtype: vLLM's `--dtype`; None or "auto": vLLM's own choice, except on a CPU
    that computes float32 faster than bfloat16 (`cpu_compute_dtype`: no bf16 units), where
    float32 (vLLM takes bfloat16 on any x86 CPU, and emulates it ~4x slower there:
    `worker.loader.weights.auto_dtype`). cpu_threads: torch threads of a CPU engine
    (`OMP_NUM_THREADS`). api_key: the engines require it, as the routers do.
    probe_tokens: the long prompt of the probe each worker runs on its engine before it first
    answers `ready()` (module docstring; 0: none, the routers learn the speeds from traffic).
    """

    model: str
    python: str
    args: tuple[str, ...] = ()
    device: str = "cpu"
    dtype: str | None = None
    cpu_threads: int = 1
    api_key: str | None = field(default=None, repr=False)
    probe_tokens: int = PROBE_TOKENS  # the probe's long prompt (0: no probe)

    def command(self, model_dir: str, host: str, ports: VllmPorts) -> list[str]:
        """The server's command line."""
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events",
                  # vLLM binds its sockets only for a wildcard (or ipc) endpoint
                  "endpoint": f"tcp://*:{ports.events}",
                  "replay_endpoint": f"tcp://*:{ports.replay}"}
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--host", host, "--port", str(ports.http), "--enable-prefix-caching",
               "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(events),
               "--disable-uvicorn-access-log"]
        dtype = self.engine_dtype()
        if dtype is not None:
            cmd += ["--dtype", dtype]
        return cmd + list(self.args)

    def engine_dtype(self) -> str | None:
        """The `--dtype` this node's engine gets (see the class docstring); None: none."""
        cpu_float32 = self.device == "cpu" and cpu_compute_dtype() == torch.float32
        if self.dtype in (None, "auto") and cpu_float32:
            return "float32"
        return self.dtype

    def environment(self, worker_id: str) -> dict[str, str]:
        """The server's environment: this process's (CUDA_VISIBLE_DEVICES as Ray set it), plus
        the worker's id, the key, and on CPU its threads, left unpinned: vLLM-CPU would pin
        every engine of a node to the same cores."""
        env = dict(os.environ, **{WORKER_ID_ENV: worker_id})
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        if self.device == "cpu":
            env["OMP_NUM_THREADS"] = str(self.cpu_threads)
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        return env


@dataclass(frozen=True)
class VllmPorts:
    http: int
    events: int
    replay: int


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on this node now."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class Reaped:
    """`cmd` run under the reaper (`REAPER`), in a process group of its own, output to `log`.

    The group lives no longer than the command, this process, or `close()`: nothing of it is
    left behind. `exited()` polls; `wait()` returns the command's exit status once the reaper
    has killed the group ("killed" when the reaper itself was killed: then `wait` kills the
    group)."""

    def __init__(self, python: str, cmd: list[str], env: dict[str, str], log: Path) -> None:
        life, self._life = os.pipe()  # only this process holds the write end
        self._report, report = os.pipe()
        with open(log, "ab") as out:
            shim = subprocess.Popen(
                [python, "-c", REAPER, str(life), str(report), *cmd],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True, pass_fds=(life, report),
            )
        os.close(life)
        os.close(report)
        shim.wait()  # it has forked the reaper and exited
        self.group = shim.pid  # the process group of the reaper and everything it starts

    def exited(self) -> bool:
        return bool(select.select([self._report], [], [], 0)[0])

    def wait(self) -> str:
        status = b""
        while chunk := os.read(self._report, 64):  # EOF: the reaper is gone
            status += chunk
        if not status:  # the reaper was killed before it could: kill its group from here
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.group, signal.SIGKILL)
        return status.decode() or "killed"

    def close(self) -> None:
        """Kill the group (the reaper sees its life pipe close) and release the pipes."""
        os.close(self._life)
        os.close(self._report)


class VllmWorker:
    """One vLLM server under this actor; see the module docstring."""

    def __init__(self, config: VllmConfig, worker_id: str) -> None:
        self.config = config
        self.worker_id = worker_id
        self.host = ray.util.get_node_ip_address()
        self.log_path = Path(tempfile.gettempdir()) / f"radixray-vllm-{worker_id}-{os.getpid()}.log"
        with warnings.catch_warnings():  # Ray's own property reads a deprecated one
            warnings.simplefilter("ignore")
            self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.ports: VllmPorts | None = None
        self.serving = threading.Event()
        self.failure: str | None = None
        self.started = time.monotonic()
        self._server: Reaped | None = None
        self._speeds: asyncio.Task | None = None  # the probe of this engine, run once
        self._thread = threading.Thread(target=self._supervise, name="vllm", daemon=True)
        self._thread.start()

    async def ready(self) -> dict:
        """Once the server answers and its probe is done: its endpoints, its probed `speeds`
        (and `model`, `log`). Answers at once after that, so it doubles as a liveness ping.
        Raises when the server failed to start."""
        while not self.serving.is_set():
            if self.failure is not None:
                raise RuntimeError(f"{self.worker_id}: vLLM failed to start: {self.failure}")
            await asyncio.sleep(HEALTH_POLL_S)
        ports = self.ports
        url = f"http://{self.host}:{ports.http}"
        if self._speeds is None:
            self._speeds = asyncio.get_running_loop().create_task(probe_speeds(
                self.worker_id, url, self.config.api_key, self.config.probe_tokens))
        prefill, step = await asyncio.shield(self._speeds)  # a ping that times out: not lost
        return {
            "worker_id": self.worker_id,
            "model": self.config.model,
            "endpoints": {
                "url": url,
                "events": f"tcp://{self.host}:{ports.events}",
                "replay": f"tcp://{self.host}:{ports.replay}",
            },
            "speeds": {"prefill_tokens_per_s": prefill, "decode_step_s": step},
            "log": str(self.log_path),
        }

    # --- the supervising thread ---------------------------------------------------------------

    def _supervise(self) -> None:
        try:
            model_dir = str(resolve_model(self.config.model))
        except (ValueError, RuntimeError) as exc:
            self.failure = str(exc)
            return
        for _ in range(PORT_ATTEMPTS):
            self.ports = VllmPorts(*free_ports(3))
            if self._server is not None:  # an attempt that failed: its reaper is gone
                self._server.close()
            cmd = self.config.command(model_dir, self.host, self.ports)
            self._server = Reaped(self.config.python, cmd, self.config.environment(
                self.worker_id), self.log_path)
            code = self._serve(self._server)
            if self.serving.is_set():
                log.warning("%s: vLLM exited (%s) after %.0fs: the worker restarts empty",
                            self.worker_id, code, time.monotonic() - self.started)
                os._exit(1)  # Ray restarts the actor, which starts a new server
            if "Address already in use" not in self._tail():
                break
        self.failure = f"exit status {code}; {self.log_path} ends:\n{self._tail()}"
        if self.restarted:
            os._exit(1)  # it served before this restart: let Ray try again

    def _serve(self, server: Reaped) -> str:
        """Polls the server's health until it answers (then `serving` is set), then waits for
        it to exit; returns its exit status."""
        url = f"http://{self.host}:{self.ports.http}/health"
        while not self.serving.is_set() and not server.exited():
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        self.serving.set()
                        log.info("%s: vLLM serves after %.1fs", self.worker_id,
                                 time.monotonic() - self.started)
            except OSError:
                time.sleep(HEALTH_POLL_S)
        return server.wait()

    def _tail(self, size: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-size:]
        except OSError:
            return ""


async def probe_speeds(worker_id: str, url: str, api_key: str | None,
                       probe_tokens: int) -> tuple[float, float]:
    """The engine at `url`: its probed (prefill tokens/s, decode step), as a router probes an
    engine at join (`HttpBackend.calibrate`); 0: not measured (the probe failed, and the log
    says why, or `probe_tokens` is 0)."""
    if probe_tokens <= 0:
        return 0.0, 0.0
    backend = HttpBackend(worker_id, url, api_key=api_key, probe_tokens=probe_tokens)
    try:
        await backend.ready()
        await backend.calibrate()
    except Exception as exc:  # noqa: BLE001 - a probe never keeps the worker out
        log.warning("%s: probing vLLM failed, its speeds are learnt from traffic: %r",
                    worker_id, exc)
    finally:
        await backend.close()
    return backend.speed.probed


RemoteVllmWorker = ray.remote(VllmWorker)
