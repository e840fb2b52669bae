"""Engine benchmarks on one device (issue 3): prefix-cache TTFT and batched decode throughput.

1. TTFT of a 2k- and an 8k-token prompt with none of it cached vs 95% of it cached (the first
   95% was run before by another request). Goal: cached <= 0.15x uncached.
2. Output tokens/s with continuous batching at 1, 8 and 32 concurrent requests vs HF
   transformers `generate` on the same model and prompts, both one request at a time (what a
   plain HF server does) and as one static padded batch of the same size. Goal: >= 3x at 32.

3. With `--decode-steps N`, only the time of one decode step (process CPU time and wall) at 1, 8
   and 32 concurrent requests behind one shared 1024-token system prompt (64 own tokens each),
   all decoding: the median of N steps per run. CPU time barely moves with the machine's load.

Every figure is the median over `--runs` runs. Timings on a shared machine are noisy: compare
medians, not single runs.

    python bench/bench_engine.py                      # small model, CPU, 3 runs
    python bench/bench_engine.py --runs 5 --json out.json
    python bench/bench_engine.py --model DIR --dtype bfloat16   # engine and HF in bf16
    python bench/bench_engine.py --model DIR --dtype bfloat16 --decode-steps 25
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from worker.engine import Engine, EngineConfig
from worker.loader import resolve_model
from worker.protocol import GenerateRequest, SamplingParams


def random_prompt(length: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(length)]


def ttft(engine: Engine, rid: str, tokens: list[int]) -> tuple[float, int]:
    """Seconds from add_request to the first token, and the reported cached tokens. The clock
    stops when the step hands the token on, before the engine, idle again, checks its KV slots
    (`settle_if_idle`): the worker actor settles after delivering the chunks too."""
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(GenerateRequest(rid, tokens, sp))
    while True:
        for chunk in engine.step(settle=False):
            if chunk.request_id == rid and chunk.token_ids:
                elapsed = time.perf_counter() - start
                while engine.has_work():
                    engine.step()
                engine.settle_if_idle()
                return elapsed, chunk.cached_tokens


def bench_ttft(engine: Engine, lengths: list[int], runs: int, vocab: int) -> dict:
    results = {}
    for length in lengths:
        if length >= engine.max_context:  # a prompt and its one output token must fit
            print(f"TTFT {length:5d} tokens: skipped, past the context ({engine.max_context})")
            continue
        cold, warm, cached = [], [], []
        for run in range(runs):
            seed = 1000 * length + run
            cold.append(ttft(engine, f"cold-{length}-{run}", random_prompt(length, seed, vocab))[0])
            prompt = random_prompt(length, seed + 500, vocab)
            ttft(engine, f"prime-{length}-{run}", prompt[: int(0.95 * length)])
            seconds, hit = ttft(engine, f"warm-{length}-{run}", prompt)
            warm.append(seconds)
            cached.append(hit)
        c, w = statistics.median(cold), statistics.median(warm)
        results[length] = {"uncached_s": c, "cached_s": w, "ratio": w / c, "cached_tokens": cached}
        print(
            f"TTFT {length:>5} tokens: uncached {c * 1000:8.1f} ms  95% cached {w * 1000:8.1f} ms"
            f"  ratio {w / c:.3f}  (cached tokens {cached[0]}, runs {runs}; uncached prefill "
            f"{length / c:,.0f} tok/s)",
            flush=True,
        )
    return results


def engine_throughput(
    engine: Engine, prompts: list[list[int]], out_len: int, tag: str
) -> tuple[float, float]:
    """Output tokens/s of all `prompts` run concurrently, and the median inter-token latency
    (seconds between a request's consecutive tokens, over every request)."""
    sp = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(f"{tag}-{i}", p, sp))
    produced = 0
    last: dict[str, float] = {}
    gaps: list[float] = []
    while engine.has_work():
        chunks = engine.step()
        now = time.perf_counter()
        for c in chunks:
            if not c.token_ids:
                continue
            produced += len(c.token_ids)
            if c.request_id in last:
                gaps.append((now - last[c.request_id]) / len(c.token_ids))
            last[c.request_id] = now
    assert produced == len(prompts) * out_len
    return produced / (time.perf_counter() - start), statistics.median(gaps)


def hf_throughput(model, prompts: list[list[int]], out_len: int) -> float:
    """Static batch: all prompts (equal lengths, so no padding) in one `generate` call."""
    ids = torch.tensor(prompts, dtype=torch.int64, device=model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=out_len,
            min_new_tokens=out_len,
            do_sample=False,
            pad_token_id=0,
        )
    out = out.cpu()  # waits for a GPU's work
    assert out.shape[1] == ids.shape[1] + out_len
    return len(prompts) * out_len / (time.perf_counter() - start)


def bench_throughput(engine: Engine, model_dir: str, args: argparse.Namespace, vocab: int) -> dict:
    from transformers import AutoModelForCausalLM

    results = {}
    if not args.concurrency:
        return results
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
    hf = hf.to(engine.device).eval()
    for n in args.concurrency:
        ours, itl, hf_batch, hf_seq, vs_seq, vs_batch = [], [], [], [], [], []
        for run in range(args.runs):
            # prompts of their own per concurrency and run: the engine caches what an earlier
            # run sent, and HF's batch, which caches nothing, must not be measured against hits
            seed = 10_000_000 * (run + 1) + 1_000 * n
            prompts = [random_prompt(args.prompt_len, seed + i, vocab) for i in range(n)]
            # measured back to back, so each run's ratios see about the same machine load
            o, gap = engine_throughput(engine, prompts, args.output_len, f"tp{n}-{run}")
            itl.append(gap)
            b = hf_throughput(hf, prompts, args.output_len)
            one = [hf_throughput(hf, [p], args.output_len) for p in prompts[:2]]  # one at a time
            s = len(one) / sum(1 / x for x in one)
            for values, x in (
                (ours, o),
                (hf_batch, b),
                (hf_seq, s),
                (vs_seq, o / s),
                (vs_batch, o / b),
            ):
                values.append(x)
        med = statistics.median
        results[n] = {
            "engine_tok_s": med(ours),
            "engine_itl_p50_s": med(itl),
            "hf_batched_tok_s": med(hf_batch),
            "hf_sequential_tok_s": med(hf_seq),
            "vs_hf_sequential": med(vs_seq),
            "vs_hf_batched": med(vs_batch),
        }
        print(
            f"{n:>3} concurrent: engine {med(ours):7.1f} tok/s, ITL p50 {med(itl) * 1e3:6.1f} ms"
            f" | HF one at a time "
            f"{med(hf_seq):7.1f} tok/s, engine/HF {med(vs_seq):.2f}x | HF static batch "
            f"{med(hf_batch):7.1f} tok/s, engine/HF {med(vs_batch):.2f}x | runs {args.runs} "
            "(ratios: median of per-run ratios)",
            flush=True,
        )
    return results


def decode_step(
    engine: Engine, n: int, steps: int, tag: str, vocab: int, profile: bool = False
) -> tuple[float, float]:
    """Median seconds (process CPU time, wall) of a decode-only step of `n` requests behind one
    shared system prompt; with `profile`, then where 5 more steps' time went."""
    system = random_prompt(1024, 99, vocab)
    # enough tokens that every request still decodes through the profiled steps too
    sp = SamplingParams(max_tokens=steps + 4 + 10 * profile, temperature=0.0, ignore_eos=True)
    for i in range(n):
        prompt = system + random_prompt(64, 10_000 + i, vocab)
        engine.add_request(GenerateRequest(f"{tag}-{i}", prompt, sp))
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed < len(r.tokens) - 1 for r in sched.running):
        engine.step()  # prefill (chunked) until every request decodes
    engine.step()
    cpu, wall = [], []
    for _ in range(steps):
        c, w = time.process_time(), time.perf_counter()
        engine.step()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    if profile:
        profile_steps(engine, n, 5)
    while engine.has_work():
        engine.step()
    return statistics.median(cpu), statistics.median(wall)


def profile_steps(engine: Engine, n: int, steps: int) -> None:
    """Torch's profiler over `steps` decode steps: the device's kernel time against the wall
    (the rest is launch gaps and host work), and the ops that took the most device time; then
    Python's profiler over `steps` more: the host functions that took the most time."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
    wall = (time.perf_counter() - t0) / steps
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time_total for e in kernels) / 1e6 / steps
    print(f"  profile, {n} concurrent: {wall * 1e3:.2f} ms a step under the profiler, kernels "
          f"{busy * 1e3:.2f} ms ({len(kernels) / steps:.0f} launches a step), device idle "
          f"{max(0.0, wall - busy) * 1e3:.2f} ms", flush=True)
    sort = "self_cuda_time_total" if engine.device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=12), flush=True)
    host = cProfile.Profile()
    host.enable()
    for _ in range(steps):
        engine.step()
    host.disable()
    print(f"  host profile, {n} concurrent, {steps} steps (cProfile, by own time):", flush=True)
    pstats.Stats(host).sort_stats("tottime").print_stats(14)


def bench_decode_steps(engine: Engine, args: argparse.Namespace, vocab: int) -> dict:
    results = {}
    for n in args.concurrency:
        runs = [decode_step(engine, n, args.decode_steps, f"ds{n}-{r}", vocab,
                            profile=r == 0 and n in args.profile)
                for r in range(args.runs)]
        cpu = statistics.median(c for c, _ in runs)
        wall = statistics.median(w for _, w in runs)
        results[n] = {"decode_step_cpu_s": cpu, "decode_step_wall_s": wall}
        print(
            f"{n:>3} concurrent over a shared 1024-token prefix: decode step {cpu * 1e3:7.1f} ms"
            f" CPU, {wall * 1e3:7.1f} ms wall (median of {args.decode_steps} steps, "
            f"median of {args.runs} runs)",
            flush=True,
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ttft-lengths", type=int, nargs="*", default=[2048, 8192])
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prefill-budget", type=int, default=EngineConfig.prefill_budget)
    parser.add_argument("--max-running", type=int, default=64, help="EngineConfig.max_running")
    parser.add_argument("--kv-tokens", type=int, default=65536, help="KV pool slots")
    parser.add_argument("--attention", default="auto", help="attention backend")
    parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                        help="on a GPU: decode eagerly, no CUDA graphs")
    parser.add_argument("--compile", action="store_true", help="torch.compile the layers")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the engine's and HF's dtype")
    # 1 by default: on a shared machine several OpenMP threads per process oversubscribe the
    # cores and a step can get 10x slower; --threads 0 keeps torch's default
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: default)")
    parser.add_argument("--decode-steps", type=int, default=0,
                        help="only time decode steps over a shared prefix, this many per run")
    parser.add_argument("--profile", type=int, nargs="*", default=[],
                        help="with --decode-steps: profile 5 more steps at these concurrencies")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = EngineConfig(
        model=args.model,
        device=args.device,
        kv_tokens=args.kv_tokens,
        prefill_budget=args.prefill_budget,
        max_running=args.max_running,
        attention=args.attention,
        compile=args.compile,
        cuda_graphs=args.cuda_graphs,
        dtype=args.dtype,
        seed=0,
    )
    engine = Engine(config)
    vocab = engine.model.config.vocab_size
    print(
        f"model {args.model} on {args.device}, torch threads {torch.get_num_threads()}, "
        f"prefill budget {args.prefill_budget}, attention {engine.model.backend.name}, "
        f"compile {args.compile}, dtype {args.dtype}, cuda graphs "
        f"{engine.runner.graphs is not None}",
        flush=True,
    )
    for what, g in (("decode", engine.runner.graphs), ("chunk", engine.runner.chunk_graphs)):
        if g is not None and g.capture:
            print(f"captured {len(g.sizes)} {what} graphs (up to {g.sizes[-1]}) in "
                  f"{g.capture_s:.1f} s, {g.capture_bytes / 2**20:.0f} MiB reserved", flush=True)
    ttft(engine, "warmup", random_prompt(64, 0, vocab))
    if args.decode_steps:
        figures = {"decode_step": bench_decode_steps(engine, args, vocab)}
    else:
        figures = {"ttft": bench_ttft(engine, args.ttft_lengths, args.runs, vocab)}
        figures["throughput"] = bench_throughput(
            engine, str(resolve_model(args.model)), args, vocab
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **figures}, f, indent=2)


if __name__ == "__main__":
    main()
