"""How low can routing take p99 TTFT on the CPU pair's shared-prefix workload? A bound in
hindsight, on the simulator of bench/sim_cpu_pair.py (two vLLM-CPU engines, 8 system prompts x 8
questions, 1 request/s).

Per seed (arrival order and timing), every assignment of the groups to the two engines is run:
each group's requests all go to its engine, so every system prompt is computed once (2^(G-1)
assignments, up to swapping the engines). With `--overflow S`, also each assignment where a
request whose engine would make it wait more than S s goes to the other engine instead. The
best of them for that seed, chosen knowing the whole future, is what no online router can
beat by placement alone (within those families); it is printed beside `cache_aware` (SGLang's
rule) and `cost` on the same seed.

    python bench/sim_assignment_bound.py --seeds 12 \
        --profile bench/profiles/vllm_cpu_smollm2_intel.json --overflow inf,3,5

The policy here reads each request's group from its id (`g<group>p<prompt>`): knowledge a
router does not have, which is the point of a bound; it exists only in this script.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from cluster.sim.report import summarize
from cluster.sim.simulator import SimConfig, SimResult, Simulator
from cluster.sim.time_model import TimeProfile
from cluster.sim.workloads import SharedPrefixConfig, Workload, generated_shared_prefix
from router.routing.candidates import Decision, RouteRequest, WorkerView
from router.routing.policies import Policy

PROFILE = Path(__file__).parent / "profiles" / "vllm_cpu_smollm2.json"


def group_of(request_id: str) -> int:
    """The group of a generated shared-prefix request (`g<group>p<prompt>`)."""
    return int(request_id.split("p")[0][1:])


class Assigned(Policy):
    """Each group to the engine its bit in `mask` names; past `overflow_s` of predicted wait
    there, the other engine."""

    name = "assigned"

    def __init__(self, mask: int, overflow_s: float) -> None:
        super().__init__()
        self.mask = mask
        self.overflow_s = overflow_s

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        group = group_of(request.request_id)
        ordered = sorted(workers, key=lambda w: w.worker_id)
        home = ordered[(self.mask >> group) & 1]
        if home.estimate.wait_s > self.overflow_s:
            other = min(ordered, key=lambda w: w.estimate.wait_s)
            return Decision(other.worker_id, "overflow")
        return Decision(home.worker_id, "assigned")


def simulate(policy: str, mask: int, overflow_s: float, seed: int,
             args: argparse.Namespace) -> tuple[Workload, SimResult]:
    """One policy (`assigned` with its mask and overflow, or a router policy by name) on the
    workload of one seed."""
    workload = generated_shared_prefix(SharedPrefixConfig(
        groups=args.groups, prompts_per_group=args.per_group, system_prompt_len=args.system_len,
        question_len=args.question_len, output_len=16, rate=args.rate), seed)
    config = SimConfig(workers=2, kv_tokens=args.kv_tokens, event_delay_s=args.event_delay,
                       seed=seed, policy="round_robin" if policy == "assigned" else policy)
    sim = Simulator(workload, config, TimeProfile.load(args.profile))
    if policy == "assigned":
        sim.core.policy = Assigned(mask, overflow_s)
    return workload, sim.run()


def run(job: tuple[str, int, float, int, argparse.Namespace]) -> tuple[float, float, float]:
    """(hit rate, mean TTFT, p99 TTFT) of `simulate(*job)`."""
    s = summarize(simulate(*job)[1])
    return s["hit_rate"], s["ttft_mean"], s["ttft_p99"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=12)
    parser.add_argument("--profile", default=str(PROFILE))
    parser.add_argument("--rate", type=float, default=1.0, help="requests/s")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--system-len", type=int, default=640)
    parser.add_argument("--question-len", type=int, default=200)
    parser.add_argument("--kv-tokens", type=int, default=5120, help="per engine")
    parser.add_argument("--event-delay", type=float, default=0.25)
    parser.add_argument("--overflow", default="inf",
                        help="comma-separated waits (s) past which a request leaves its group's "
                             "engine; inf: never")
    args = parser.parse_args()
    overflows = [float(x) for x in args.overflow.split(",")]
    masks = range(0, 1 << args.groups, 2)  # group 0 on engine 0: the engines are alike
    jobs = [(p, 0, math.inf, seed, args) for seed in range(args.seeds)
            for p in ("cache_aware", "cost")]
    jobs += [("assigned", m, o, seed, args) for seed in range(args.seeds) for o in overflows
             for m in masks]
    with ProcessPoolExecutor(2) as pool:
        results = dict(zip(((j[0], j[1], j[2], j[3]) for j in jobs),
                           pool.map(run, jobs, chunksize=16), strict=True))
    print(f"profile {Path(args.profile).name}, {args.rate} requests/s, {args.seeds} seeds; "
          "hit / mean TTFT / p99 TTFT")
    print(f"{'seed':>4}  {'cache_aware':>22}  {'cost':>22}  {'best assignment (p99)':>30}")
    rows = []
    for seed in range(args.seeds):
        ca, co = results[("cache_aware", 0, math.inf, seed)], results[("cost", 0, math.inf, seed)]
        mine = [(k, v) for k, v in results.items() if k[0] == "assigned" and k[3] == seed]
        (_, mask, over, _), best = min(mine, key=lambda kv: kv[1][2])
        rows.append((ca, co, best))
        print(f"{seed:>4}  {_fmt(ca)}  {_fmt(co)}  {_fmt(best)} mask {mask:#04x} over {over:g}")
    p99s = [statistics.median(r[i][2] for r in rows) for i in range(3)]
    hits = [statistics.median(r[i][0] for r in rows) for i in range(3)]
    print(f"median p99: cache_aware {p99s[0]:.2f} s, cost {p99s[1]:.2f} s, best assignment "
          f"{p99s[2]:.2f} s ({p99s[2] / p99s[0]:.2f}x cache_aware's)")
    print(f"median hit: cache_aware {hits[0]:.1%}, cost {hits[1]:.1%}, best assignment "
          f"{hits[2]:.1%}")


def _fmt(r: tuple[float, float, float]) -> str:
    return f"{r[0]:6.1%} {r[1]:6.3f}s {r[2]:6.2f}s"


if __name__ == "__main__":
    main()
