"""The CPU decode-attention kernel (`worker.decode_kernel`) on one layer, as a decode step calls it.

B sequences over a shared prefix of P keys (one segment, all their queries; with `--groups`
N, N groups of sequences over a prefix each, as a workload of several system prompts) and OWN
keys of each one's own (a segment each), SmolLM2-135M's heads by default, at contiguous slots of a
pool. `cold`: `--layers` pools of their own called in turn, as a step walks its layers (what
the other layers read in between has pushed this one's rows out of the caches); `hot`: one
layer's pool again and again. Printed: ms per layer (median of `--repeat` rounds) and the KV
bytes read per second. With `--base-tree DIR` the same calls also go to another checkout's
kernel (its `worker/decode_kernel.py` source, built beside this tree's; the ctypes signature
must be this tree's), the two alternating within each round, and the ratio is printed: a
change side by side with the code it changes, on a machine whose speed drifts.

    python bench/bench_decode_kernel.py                          # float32, 1 / 8 / 32 sequences
    python bench/bench_decode_kernel.py --dtype bfloat16 --prefix 2048
    python bench/bench_decode_kernel.py --sequences 32 --groups 4  # 4 prefixes, 8 on each
    python bench/bench_decode_kernel.py --base-tree /tmp/before  # against a checkout
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
import types
from pathlib import Path

import torch

import worker.decode_kernel as decode_kernel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def base_kernel(tree: Path, dtype: torch.dtype) -> decode_kernel.DecodeKernel:
    """The kernel of another checkout: its c_library and decode_kernel modules loaded under
    names of their own, its source built as a library of its own."""
    spec = importlib.util.spec_from_file_location(
        "base_c_library", tree / "worker" / "models" / "c_library.py"
    )
    c_library = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(c_library)
    source = (tree / "worker" / "decode_kernel.py").read_text()
    source = source.replace("import worker.models.c_library as c_library", "")
    module = types.ModuleType("base_decode_kernel")
    module.c_library = c_library
    exec(compile(source, str(tree / "worker" / "decode_kernel.py"), "exec"), module.__dict__)
    library = c_library.build_for("decode_attention_base", module.SOURCE, dtype)
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
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = DTYPES[args.dtype]
    kernels = {"this tree": decode_kernel.load(dtype)}
    if kernels["this tree"] is None:
        raise SystemExit("the kernel does not build here (no C compiler?)")
    if args.base_tree is not None:
        kernels["base"] = base_kernel(args.base_tree, dtype)
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


if __name__ == "__main__":
    main()
