"""`radixray simulate`: replay a trace or a synthetic workload through every policy asked for.

Entry points for `cluster/cli.py`: `add_simulate_args(parser)` adds the flags to an argparse
parser; `run_simulate(args) -> int` runs and prints (exit status 0, 2 on bad arguments).

Load: `--load X` picks the time scale at which the workload's *uncached* prefill work, at the
time model's speed, fills a fraction X of the cluster: X = sum(prefill_s(prompt)) / (workers x
duration). Cache hits make the real utilisation lower; decode adds to it. `--speed S` instead
divides the trace's timestamps by S directly.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from cluster.config import json_object
from cluster.sim.pooled import pooled_hit_rate
from cluster.sim.report import build_report, format_table, plot
from cluster.sim.simulator import SimConfig, simulate
from cluster.sim.time_model import TimeProfile, h100_llama3_8b
from cluster.sim.workloads import (
    ChatConfig,
    SharedPrefixConfig,
    Workload,
    generated_shared_prefix,
    multi_turn_chat,
    trace_workload,
)
from router.config import cost_config

WORKLOADS = ("trace", "shared-prefix", "chat")


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Flags that choose a workload (shared by `simulate` and `bench`)."""
    parser.add_argument("--trace", help="Mooncake-format JSON lines (.gz ok)")
    parser.add_argument("--workload", choices=WORKLOADS, default=None,
                        help="trace (the default with --trace), shared-prefix or chat")
    parser.add_argument("--speed", type=float, default=None, help="divide timestamps by this")
    parser.add_argument("--limit", type=int, default=None, help="first N trace requests only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--groups", type=int, default=64, help="shared-prefix: system prompts")
    parser.add_argument("--prompts-per-group", type=int, default=16)
    parser.add_argument("--system-prompt-len", type=int, default=2048)
    parser.add_argument("--question-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--sessions", type=int, default=200, help="chat: conversations")
    parser.add_argument("--turns", type=int, default=8, help="chat: turns per conversation")


def add_simulate_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `radixray simulate`."""
    add_workload_args(parser)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--kv-tokens", type=int, default=None,
                        help="KV capacity per worker in tokens (default: the profile's)")
    parser.add_argument("--policy", default="cost,round_robin",
                        help="comma-separated policy names, each simulated separately")
    parser.add_argument("--load", type=float, default=None,
                        help="set the speed so uncached prefill work fills this fraction")
    parser.add_argument("--host-kv-tokens", type=int, default=0,
                        help="host KV tier per worker in tokens (0: none)")
    parser.add_argument("--host-policy", default="write_through",
                        choices=("write_through", "write_through_selective", "write_back"))
    parser.add_argument("--event-delay", type=float, default=0.05,
                        help="seconds before KV events and stats reach the router")
    parser.add_argument("--profile", default=None,
                        help="time profile JSON (default: H100 + Llama 3 8B)")
    parser.add_argument("--speed-error", type=float, default=1.0,
                        help="the prefill speed the workers report, times their real one")
    parser.add_argument("--cost-config", type=json_object, default=None, metavar="JSON",
                        help="overrides of the routing estimate and the cost terms (as for serve)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", default=None, metavar="FILE.png")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--rate", dest="workload_rate", type=float, default=None,
                        help="shared-prefix: requests/s (default: all at once); "
                             "chat: sessions/s")


def build_workload(args: argparse.Namespace, speed: float = 1.0) -> Workload:
    kind = args.workload or ("trace" if args.trace else "shared-prefix")
    if kind == "trace":
        if not args.trace:
            raise ValueError("--workload trace needs --trace FILE")
        return trace_workload(args.trace, speed, args.seed, args.limit)
    if kind == "shared-prefix":
        cfg = SharedPrefixConfig(
            groups=args.groups, prompts_per_group=args.prompts_per_group,
            system_prompt_len=args.system_prompt_len, question_len=args.question_len,
            output_len=args.output_len,
        )
        if getattr(args, "workload_rate", None):
            cfg.rate = args.workload_rate * speed
        return generated_shared_prefix(cfg, args.seed)
    cfg = ChatConfig(sessions=args.sessions, turns=args.turns, output_len=args.output_len)
    if getattr(args, "workload_rate", None):
        cfg.session_rate = args.workload_rate
    cfg.session_rate *= speed
    cfg.think_s /= speed
    return multi_turn_chat(cfg, args.seed)


def speed_for_load(workload: Workload, workers: int, profile: TimeProfile, load: float) -> float:
    """The speed at which `workload` (built at speed 1) offers `load` of uncached prefill work."""
    reqs = workload.requests
    duration = reqs[-1].arrival_s - reqs[0].arrival_s if reqs else 0.0
    if duration <= 0:
        raise ValueError("--load needs a workload whose arrivals span some time")
    work = sum(profile.prefill_s(r.input_length) for r in reqs)
    return load * workers * duration / work


def run_simulate(args: argparse.Namespace) -> int:
    """Run every policy of `args.policy`; print JSON or a table; exit status."""
    try:
        profile = TimeProfile.load(args.profile) if args.profile else h100_llama3_8b()
        speed = args.speed or 1.0
        if args.load is not None:
            base = build_workload(args, 1.0)
            speed = speed_for_load(base, args.workers, profile, args.load)
        workload = build_workload(args, speed)
        policies = [p.strip() for p in args.policy.split(",") if p.strip()]
        if args.workers <= 0 or not policies:
            raise ValueError("need at least one worker and one policy")
        if not args.speed_error > 0:
            raise ValueError(f"--speed-error must be above 0, got {args.speed_error}")
        cost = args.cost_config or {}
        cost_config(overrides=cost)  # unknown keys or bad values, before the runs
    except (ValueError, OSError) as exc:
        print(f"radixray simulate: {exc}", file=sys.stderr)
        return 2
    kv_tokens = args.kv_tokens or profile.kv_tokens
    results = []
    for name in policies:
        config = SimConfig(args.workers, kv_tokens, name, args.event_delay, seed=args.seed,
                           speed_error=args.speed_error,
                           host_kv_tokens=args.host_kv_tokens, host_policy=args.host_policy,
                           cost_config=cost)
        started = time.perf_counter()
        try:
            results.append(simulate(workload, config, profile, not args.no_progress))
        except ValueError as exc:  # unknown policy name
            print(f"radixray simulate: {exc}", file=sys.stderr)
            return 2
        if not args.no_progress:
            print(f"{name}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
    pooled = pooled_hit_rate(workload, (kv_tokens + args.host_kv_tokens) * args.workers)
    report = build_report(results, pooled)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{workload.name}: {len(workload.requests)} requests, {args.workers} workers x "
              f"{kv_tokens} KV tokens, speed {speed:.3g}, profile {profile.name}")
        print(format_table(report))
    if args.plot:
        plot(results, report, args.plot)
    return 0
