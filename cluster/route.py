"""`radixray route`: the router alone, in front of OpenAI-compatible servers it did not start.

    radixray route --model /models/Qwen2.5-7B-Instruct \\
        --worker http://10.0.0.5:8000,events=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558 \\
        --worker http://10.0.0.6:8000

Each `--worker` is one engine (vLLM, SGLang, another radixray): its URL, and where it publishes
KV events (`events=`, its ZMQ PUB endpoint) and replays them (`replay=`), when it does. The
router serves the same API as `radixray serve` (policies, sessions, failover, `/v1/workers`,
`/metrics`, admin endpoints); `POST /v1/workers` with `{"url", "events", "replay"}` adds an
engine live, and removing one only stops routing to it (the engine keeps running).

The router's block size (`RouterConfig.block_size`, the index granularity) is `--block-size`,
else the smallest the engines report on `/metrics` (vLLM does), else the router's default; every
engine's events are re-hashed at it, and each backend reports it as its engine shape's. The
context length comes from the engines' `/v1/models`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily

from cluster.config import (
    ADMIN_KEY_ENV,
    API_KEY_ENV,
    add_access_args,
    add_deadline_args,
    exposure,
    json_object,
)
from router.backends.base import Backend
from router.backends.external.events import EngineEventsConfig, EngineEventStream
from router.backends.external.metrics import parse_engine_metrics
from router.backends.external.probe import PROBE_TOKENS
from router.backends.http import HttpBackend
from router.config import RouterConfig
from router.errors import bad_request
from router.routing.policies import POLICY_NAMES
from router.routing.registry import WorkerRegistry

_ZMQ_SCHEMES = ("tcp", "ipc")


@dataclass(frozen=True)
class WorkerSpec:
    """One external engine: its base URL and, optionally, its KV event endpoints."""

    url: str
    events: str | None = None
    replay: str | None = None

    @property
    def worker_id(self) -> str:
        return urllib.parse.urlsplit(self.url).netloc


def _check_url(url: object, schemes: tuple[str, ...], what: str) -> str:
    parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    where = parts and (parts.path if parts.scheme == "ipc" else parts.netloc)
    if parts is None or parts.scheme not in schemes or not where:
        raise ValueError(f"{what} must be a {'/'.join(schemes)}:// address, got {url!r}")
    return url


def worker_spec(url: object, events: object = None, replay: object = None) -> WorkerSpec:
    """A validated spec; ValueError names what is wrong."""
    url = _check_url(url, ("http", "https"), "url").rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if events is not None:
        events = _check_url(events, _ZMQ_SCHEMES, "events")
    if replay is not None:
        if events is None:
            raise ValueError("replay needs events")
        replay = _check_url(replay, _ZMQ_SCHEMES, "replay")
    return WorkerSpec(url, events, replay)


def parse_worker(text: str) -> WorkerSpec:
    """`URL[,events=tcp://H:P][,replay=tcp://H:P]` as given to `--worker`."""
    url, *options = text.split(",")
    keys: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in ("events", "replay") or key in keys:
            raise ValueError(f"unknown or repeated worker option {option!r} (events=, replay=)")
        keys[key] = value
    return worker_spec(url, keys.get("events"), keys.get("replay"))


def spec_backend(spec: WorkerSpec, worker_id: str, block_size: int | None,
                 api_key: str | None, probe_tokens: int = PROBE_TOKENS) -> HttpBackend:
    """The router's backend of one engine, following its KV events where it publishes them
    (hashed at `block_size`; None: the engine's own block size), its speeds probed at join
    with a prompt of `probe_tokens` (0: not probed)."""
    events = None
    if spec.events is not None:
        events = EngineEventsConfig(spec.events, spec.replay)
    return HttpBackend(worker_id, spec.url, api_key=api_key, events=events,
                       block_size=block_size, probe_tokens=probe_tokens)


class ExternalWorkers:
    """The router's control over external engines: it makes their backends (the router's
    registry then holds them).

    `add_worker()` (a count) cannot start an engine: it answers 400. `url_worker(spec)` makes
    the backend of one engine; `remove_worker(id)` has nothing to stop (the router has already
    stopped routing to it and closed its backend; the engine keeps running).
    """

    def __init__(self, block_size: int, api_key: str | None = None,
                 probe_tokens: int = PROBE_TOKENS) -> None:
        self.block_size = block_size
        self.api_key = api_key
        self.probe_tokens = probe_tokens

    def backend(self, spec: WorkerSpec) -> HttpBackend:
        return spec_backend(spec, spec.worker_id, self.block_size, self.api_key,
                            self.probe_tokens)

    def add_worker(self) -> Backend:
        raise bad_request('radixray route adds engines by address: POST /v1/workers with '
                          '{"url": ..., "events": ..., "replay": ...}', param="url")

    def url_worker(self, body: dict) -> Backend:
        """The backend of the engine `body` names (`url`, `events`, `replay`); 400 when the
        body is not such a spec (the router refuses an engine that is already a worker)."""
        unknown = sorted(set(body) - {"url", "events", "replay"})
        if unknown:
            raise bad_request(f"unknown keys {unknown}", param=unknown[0])
        try:
            spec = worker_spec(body.get("url"), body.get("events"), body.get("replay"))
        except ValueError as exc:
            raise bad_request(str(exc), param="url") from None
        return self.backend(spec)

    def remove_worker(self, worker_id: str) -> None:
        """Nothing to stop: the engine is not ours."""


class EngineEventsCollector:
    """`radixray_engine_events_total{worker, outcome}`: each engine's event messages by
    outcome (applied, gap_filled, resync, restart, malformed_frame, unknown_event, ...), for
    the registry's workers that follow an engine's events."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry

    def streams(self) -> Iterator[EngineEventStream]:
        for worker in self.registry:
            events = getattr(worker.backend, "events", None)
            if isinstance(events, EngineEventStream):
                yield events

    def collect(self) -> Iterable[CounterMetricFamily]:
        family = CounterMetricFamily(
            "radixray_engine_events", "KV event messages from external engines by outcome",
            labels=["worker", "outcome"],
        )
        for stream in self.streams():
            for outcome, count in sorted(stream.outcomes.items()):
                family.add_metric([stream.worker_id, outcome], count)
        yield family


def engine_block_size(urls: list[str], wait_s: float) -> int | None:
    """The smallest block size the engines report on `/metrics` (None when none does), waiting up
    to `wait_s` for engines that do not answer yet (those are left to join later)."""
    deadline = time.monotonic() + wait_s
    sizes: list[int] = []
    for url in urls:
        while True:
            try:
                with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
                    size = parse_engine_metrics(resp.read().decode()).block_size
                    if size:
                        sizes.append(size)
                break
            except urllib.error.HTTPError:
                break  # answers, but has no /metrics
            except (OSError, ValueError):
                if time.monotonic() >= deadline:
                    print(f"radixray: {url} does not answer yet; it joins when it does",
                          file=sys.stderr)
                    break
                time.sleep(1.0)
    return min(sizes) if sizes else None


def add_route_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="NAME|DIR",
                        help="the model the engines serve: a built-in name or an HF directory "
                        "(its tokenizer and chat template are the router's); clients name it "
                        "in `model`")
    parser.add_argument("--worker", action="append", required=True, metavar="SPEC",
                        help="an engine: URL[,events=tcp://H:P][,replay=tcp://H:P] (repeatable)")
    parser.add_argument("--host", default="127.0.0.1", metavar="ADDR",
                        help="address the router listens on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, metavar="PORT",
                        help="router port (default: %(default)s)")
    parser.add_argument("--policy", default="cost", choices=POLICY_NAMES, metavar="NAME",
                        help="routing policy: " + ", ".join(POLICY_NAMES)
                        + " (default: %(default)s)")
    parser.add_argument("--cost-config", type=json_object, default=None, metavar="JSON",
                        help="overrides of the cost policy's CostConfig")
    parser.add_argument("--block-size", type=int, default=None, metavar="N",
                        help="tokens per index block (default: the engines' block size)")
    parser.add_argument("--kv-groups", default="all", choices=("all", "full"),
                        help="which KV groups of a hybrid model (sliding-window, recurrent "
                        "layers beside full attention) the index reads: all, to predict where "
                        "a prefix can really resume; full, the full-attention group only, as "
                        "routers blind to hybrid models do (default: %(default)s)")
    add_access_args(parser)  # the engines are called with the API key too
    add_deadline_args(parser, RouterConfig.body_timeout_s, RouterConfig.send_timeout_s)
    parser.add_argument("--probe-tokens", type=int, default=PROBE_TOKENS, metavar="N",
                        help="at join, time a few prompts of the router's own (the longest N "
                        "tokens) on each idle engine, to price requests by its real speeds "
                        "before its traffic measures them; 0: no probe (default: %(default)s)")
    parser.add_argument("--wait-s", type=float, default=600.0, metavar="S",
                        help="how long to wait for the engines at start (default: %(default)s)")
    parser.add_argument("--log-level", default="warning",
                        choices=["debug", "info", "warning", "error"],
                        help="the router's log level on stderr; debug logs every routing "
                        "decision with each engine's match and estimate (default: %(default)s)")


def build_app(args: argparse.Namespace) -> object:
    """The router app over the engines of `args` (see `add_route_args`)."""
    import os

    from router.api.app import create_app
    from worker.loader.builtin import resolve_model

    specs = [parse_worker(text) for text in args.worker]
    ids = [s.worker_id for s in specs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"a worker is given twice: {ids}")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    config = RouterConfig(
        model=args.model, tokenizer=str(resolve_model(args.model)), policy=args.policy,
        api_key=api_key, admin_key=args.admin_key or os.environ.get(ADMIN_KEY_ENV) or None,
        metrics_public=bool(args.metrics_public), body_timeout_s=args.body_timeout_s,
        send_timeout_s=args.send_timeout_s, cost_config=args.cost_config or {},
        kv_groups=args.kv_groups == "all",
    )
    block_size = args.block_size or engine_block_size([s.url for s in specs], args.wait_s)
    if block_size is not None:
        config = dataclasses.replace(config, block_size=block_size)
    if args.probe_tokens < 0:
        raise ValueError(f"--probe-tokens must be 0 or more, got {args.probe_tokens}")
    workers = ExternalWorkers(config.block_size, api_key, args.probe_tokens)
    app = create_app(config, [workers.backend(s) for s in specs], control=workers)
    router = app.state.router
    router.metrics.registry.register(EngineEventsCollector(router.registry))
    return app


def run_route(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from router.api.http_server import server_config

    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("radixray").setLevel(args.log_level.upper())  # others stay at warning
    try:
        app = build_app(args)
    except ValueError as exc:
        print(f"radixray route: {exc}", file=sys.stderr)
        return 2
    config = app.state.router.config
    for warning in exposure(args.host, config.api_key, config.admin_key):
        print(f"radixray route: warning: {warning}", file=sys.stderr, flush=True)
    url = f"http://{args.host}:{args.port}"
    body = json.dumps({"model": args.model, "max_tokens": 32,
                       "messages": [{"role": "user", "content": "Hello!"}]})
    print(f"radixray routes {args.model} over {len(args.worker)} engine(s) at {url} (OpenAI "
          f"API). Try:\n\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json'"
          f" -d '{body}'\n", flush=True)
    uvicorn.Server(server_config(app, config.max_header_bytes, host=args.host, port=args.port,
                                 log_level="warning", access_log=False)).run()
    return 0


def main() -> int:  # `python -m cluster.route`, as `radixray route`
    parser = argparse.ArgumentParser(prog="radixray route")
    add_route_args(parser)
    return run_route(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
