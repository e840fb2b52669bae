"""The CPU decode-attention kernel (`worker.kernels.decode_attention`) on one layer, as a decode
step calls it.

B sequences over a shared prefix of P keys (one segment, all their queries; with `--groups`
N, N groups of sequences over a prefix each, as a workload of several system prompts) and OWN
keys of each one's own (a segment each), SmolLM2-135M's heads by default, at contiguous slots of a
pool. `cold`: `--layers` pools of their own called in turn, as a step walks its layers (what
the other layers read in between has pushed this one's rows out of the caches); `hot`: one
layer's pool again and again. Printed: ms per layer (median of `--repeat` rounds) and the KV
bytes read per second. With `--base-tree DIR` the same calls also go to another checkout's
kernel (its `worker/kernels/csrc/decode_attention.c`, built beside this tree's; the ctypes
signature must be this tree's), the two alternating within each round, and the ratio is printed: a
change side by side with the code it changes, on a machine whose speed drifts. With `--model
DIR` the kernels serve whole decode steps of an engine instead (the model's own heads; random
prompts of the same shape, prefilled first), each kernel one step in turn: what a kernel's
change does to a step, next to the linears and everything else a step does.

    python bench/bench_decode_kernel.py                          # float32, 1 / 8 / 32 sequences
    python bench/bench_decode_kernel.py --dtype bfloat16 --prefix 2048
    python bench/bench_decode_kernel.py --sequences 32 --groups 4  # 4 prefixes, 8 on each
    python bench/bench_decode_kernel.py --base-tree /tmp/before  # against a checkout
    python bench/bench_decode_kernel.py --base-tree /tmp/before --model DIR --sequences 32 \
        --groups 4                                               # in an engine's steps
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import worker.attention.native as attention_native
import worker.kernels.build as builder
import worker.kernels.decode_attention as decode_kernel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def base_kernel(tree: Path, dtype: torch.dtype) -> decode_kernel.DecodeKernel:
    """The kernel of another checkout: its C source (and the headers beside it) built here as a
    library of its own, called as this tree's."""
    source = tree / "worker" / "kernels" / "csrc" / decode_kernel.SOURCE
    library = builder.build_for("decode_attention_base", source, dtype)
    if library is None:
        raise SystemExit(f"the kernel of {tree} does not build here")
    return decode_kernel.DecodeKernel(library, dtype)


def layout(sequences: int, prefix: int, own: int, groups: int = 1) -> tuple[torch.Tensor, ...]:
    """slots, segments and members: the sequences in `groups` groups (as even as they go), each
    group's shared prefix at slots of its own (one segment, all its members), each sequence's
    own keys after all the prefixes (a segment each)."""
    groups = min(groups, sequences)
    slots, segments, members = [], [], []
    if prefix:
        for g in range(groups):
            mine = range(g, sequences, groups)
            segments.append([len(slots), prefix, len(members), len(mine)])
            members += mine
            slots += range(g * prefix, (g + 1) * prefix)
    for b in range(sequences):
        start = groups * prefix + b * own
        segments.append([len(slots), own, len(members), 1])
        members.append(b)
        slots += range(start, start + own)
    return torch.tensor(slots), torch.tensor(segments), torch.tensor(members)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--sequences", type=int, nargs="*", default=[1, 8, 32])
    parser.add_argument("--prefix", type=int, default=1024, help="shared prefix keys")
    parser.add_argument(
        "--groups", type=int, default=1, help="groups of sequences, a prefix each"
    )
    parser.add_argument("--own", type=int, default=64, help="keys of each sequence's own")
    parser.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("Q", "KV"))
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30, help="pools called in turn (cold)")
    parser.add_argument("--repeat", type=int, default=12)
    parser.add_argument("--base-tree", type=Path, default=None)
    parser.add_argument(
        "--model", default=None, help="time whole decode steps of an engine on this model"
    )
    parser.add_argument("--steps", type=int, default=30, help="with --model: steps per kernel")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = DTYPES[args.dtype]
    kernels = {"this tree": decode_kernel.load(dtype)}
    if kernels["this tree"] is None:
        raise SystemExit("the kernel does not build here (no C compiler?)")
    if args.base_tree is not None:
        kernels["base"] = base_kernel(args.base_tree, dtype)
    if args.model is not None:
        load = attention_native.decode_kernel.load
        variants = {  # each kernel served by the native backend's `decode_kernel.load`
            name: lambda k=kernel: setattr(
                attention_native.decode_kernel, "load", lambda dtype=None: k
            )
            for name, kernel in kernels.items()
        }
        try:
            engine_steps(args, variants)
        finally:
            attention_native.decode_kernel.load = load
    else:
        layer_calls(args, kernels, dtype)


def layer_calls(args: argparse.Namespace, kernels: dict, dtype: torch.dtype) -> None:
    """The kernels over one layer's pools of random K/V, cold and hot."""
    heads, kv_heads = args.heads
    longest = (args.prefix * args.groups) + max(args.sequences) * args.own
    g = torch.Generator().manual_seed(0)
    pools = [
        tuple(torch.randn(longest, kv_heads, args.head_dim, generator=g).to(dtype) for _ in "kv")
        for _ in range(args.layers)
    ]
    for sequences in args.sequences:
        slots, segments, members = layout(sequences, args.prefix, args.own, args.groups)
        q = torch.randn(sequences, heads, args.head_dim, generator=g).to(dtype)
        runs = {"cold": pools, "hot": pools[:1] * args.layers}
        times = {(name, run): [] for name in kernels for run in runs}
        for _ in range(args.repeat):
            for name, kernel in kernels.items():
                for run, layers in runs.items():
                    start = time.perf_counter()
                    for k_buf, v_buf in layers:
                        kernel(q, k_buf, v_buf, slots, segments, members)
                    times[(name, run)].append((time.perf_counter() - start) / len(layers))
        kv_bytes = 2 * len(slots) * kv_heads * args.head_dim * pools[0][0].element_size()
        for run in runs:
            figures = []
            for name in kernels:
                ms = statistics.median(times[(name, run)]) * 1e3
                figures.append(f"{name} {ms:6.3f} ms ({kv_bytes / ms / 1e6:5.1f} GB/s)")
            if len(kernels) == 2:
                ratio = statistics.median(times[("this tree", run)]) / statistics.median(
                    times[("base", run)]
                )
                figures.append(f"ratio {ratio:.2f}x")
            print(
                f"{sequences:3d} sequences in {min(args.groups, sequences)} groups, "
                f"{args.prefix} + {args.own} keys, {run:4s}: "
                + ", ".join(figures),
                flush=True,
            )


def engine_steps(args: argparse.Namespace, variants: dict[str, Callable[[], None]]) -> None:
    """Variants of an engine's decode steps (`--model`): the sequences' prompts are random
    token ids (`--prefix` tokens a group, then `--own` each), prefilled; then each variant in
    turn serves one whole step, `--steps` rounds, put in place by its function before the step.
    Printed: the median step of each, and the first's ratio to the second's. (Also
    `bench_linears.py --model`'s, over the same arguments.)"""
    from worker.engine import Engine, EngineConfig
    from worker.protocol import GenerateRequest, SamplingParams

    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, seed=0))
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def words(n: int) -> list[int]:
        return torch.randint(vocab, (n,), generator=gen).tolist()

    for sequences in args.sequences:
        groups = min(args.groups, sequences)
        prefixes = [words(args.prefix) for _ in range(groups)]
        sp = SamplingParams(
            max_tokens=len(variants) * args.steps + 2, temperature=0.0, ignore_eos=True
        )
        for b in range(sequences):
            prompt = prefixes[b % groups] + words(args.own)
            engine.add_request(GenerateRequest(f"steps{sequences}-{b}", prompt, sp))
        running = engine.scheduler.running
        while engine.scheduler.waiting or any(r.num_computed < len(r.tokens) - 1 for r in running):
            engine.step()  # prefill (chunked) until every request decodes
        times = {name: [] for name in variants}
        for _ in range(args.steps):
            for name, put in variants.items():
                put()
                start = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - start)
        while engine.has_work():
            engine.step()
        figures = [f"{name} {statistics.median(t) * 1e3:6.1f} ms" for name, t in times.items()]
        if len(variants) == 2:
            first, second = (statistics.median(t) for t in times.values())
            figures.append(f"ratio {first / second:.3f}x")
        print(
            f"{sequences:3d} sequences in {groups} groups, {args.prefix} + {args.own} tokens, "
            f"decode step (median of {args.steps}): " + ", ".join(figures),
            flush=True,
        )


if __name__ == "__main__":
    main()
