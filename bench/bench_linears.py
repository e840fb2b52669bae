"""Linears at decode sizes: the few-rows C kernels against oneDNN's packed linear.

`worker.kernels.pair_gemm` in bfloat16 (the default), `worker.kernels.f32_gemm` with `--dtype
float32`. For each row count, every layer's weights of one shape (distinct tensors, so the
weights come from memory as in a decode step, not from cache) go through oneDNN's packed
linear, then through the kernel; printed: ms per pass, the weight stream in GB/s, the ratio,
and the share of outputs with the same bits. One torch thread (the kernels' own condition).

`--dense`: prefill sizes instead, `F.linear` over the dense weights (torch's BLAS: MKL in
float32) against oneDNN's packed linear, in GFLOP/s, and the rows from which the engine takes
`F.linear` on this core (`packed.dense_from`).

`--blocks 4|8`: `worker.kernels.quant_gemm` over random GGUF blocks of that many bits (Q4_1,
Q8_0) against `f32_gemm` over their float32 values instead (the same bits expected). With
`--model DIR` (a model made from a GGUF, e.g. the default SmolLM2): an engine's whole decode
steps with its GGUF blocks on and off, one step each in turn (`bench_decode_kernel.py`'s
`engine_steps`, its `--sequences`, `--groups`, `--prefix`, `--own` and `--steps`).

`--base-tree DIR`: `f32_gemm` as built here against another checkout's (its source built
beside this tree's; the layout and call must be this tree's), alternating within each
round: each row count's ms and GFLOP/s over the layers' weights from memory and over one
weight in cache, and the ratio of the times. With `--model DIR`: whole decode steps of an
engine, the two serving alternate steps (as `--blocks` does blocks on and off).

    python bench/bench_linears.py                      # SmolLM2-135M's shapes, 30 layers
    python bench/bench_linears.py --dtype float32 --rows 1 8 32 --shape 49152x576 --layers 2
    python bench/bench_linears.py --rows 1 8 --layers 8 --shape 4096x4096
    python bench/bench_linears.py --variant dpbf16     # bf16: one build, not the calibrated
    python bench/bench_linears.py --dense --dtype float32 --rows 64 256 512 1088 2048 --layers 4
    python bench/bench_linears.py --blocks 4 --rows 1 2 4 8 32
    python bench/bench_linears.py --base-tree /tmp/before --rows 4 8 16 32
    python bench/bench_linears.py --base-tree /tmp/before --model DIR --sequences 8 32
    python bench/bench_linears.py --model DIR --sequences 1 2 4 8 --groups 4
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import worker.kernels.build as builder
import worker.kernels.f32_gemm as f32_gemm
import worker.kernels.linear as packed_linears
import worker.kernels.quant_gemm as quant_gemm
from worker.kernels.calibration import median_seconds, per_weight
from worker.kernels.linear import FEW_ROWS

SMOLLM2 = ("960x576", "576x576", "3072x576", "576x1536")  # qkv, o, gate_up, down (out x in)



def _onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4, 6, 8, 12, 16])
    parser.add_argument("--shape", nargs="*", default=list(SMOLLM2), help="OUTxIN")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--variant", choices=["dpbf16", "fma", "amx"], default=None,
                        help="bf16: this build of the kernel (default: the one `load` picks)")
    parser.add_argument("--dense", action="store_true",
                        help="F.linear over the dense weights against oneDNN (prefill sizes)")
    parser.add_argument("--blocks", type=int, choices=[4, 8], default=None,
                        help="the GGUF-blocks kernel at these bits against f32_gemm")
    parser.add_argument("--model", default=None,
                        help="decode steps of an engine on this GGUF-made model, blocks on / off")
    parser.add_argument("--base-tree", type=Path, default=None,
                        help="f32_gemm against this checkout's (float32)")
    parser.add_argument("--sequences", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--own", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.base_tree is not None:
        return against_base(args)
    if args.model is not None:
        return engine_steps(args)
    if args.blocks is not None:
        return blocks(args)
    if args.dense:
        return dense_against_onednn(args)
    dtype = getattr(torch, args.dtype)
    module = FEW_ROWS[dtype]
    if args.variant:
        kernel = module.variants().get(args.variant)
    elif dtype == torch.float32:  # timed whether or not the engine takes it here (`load`)
        kernel = module.build()
    else:
        kernel = module.load()
    if kernel is None:
        print(f"no {module.__name__} here (bf16 needs AVX512-BF16; both need a C compiler)")
        return 1
    gen = torch.Generator().manual_seed(0)
    print(f"{'rows':>4} {'shape':>10} {'oneDNN ms':>10} {'GB/s':>6} {'kernel ms':>9} {'GB/s':>6} "
          f"{'speed-up':>8} {'same bits':>9}")
    for shape in args.shape:
        out_f, in_f = (int(n) for n in shape.split("x"))
        dense = [torch.randn(out_f, in_f, generator=gen).to(dtype)
                 for _ in range(args.layers)]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in dense]
        packed = [module.pack(w) for w in dense]
        gb = args.layers * out_f * in_f * dense[0].element_size() / 1e9
        for rows in args.rows:
            x = torch.randn(rows, in_f, generator=gen).to(dtype)
            a = median_seconds(lambda x=x, ws=onednn: [_onednn(x, w) for w in ws], args.repeat)
            b = median_seconds(lambda x=x, ps=packed, n=out_f: [kernel(x, p, None, n) for p in ps],
                         args.repeat)
            ref = _onednn(x, onednn[0])
            same = (kernel(x, packed[0], None, out_f) == ref).double().mean().item()
            print(f"{rows:>4} {shape:>10} {a * 1e3:>10.2f} {gb / a:>6.1f} {b * 1e3:>9.2f} "
                  f"{gb / b:>6.1f} {a / b:>7.2f}x {same:>9.4f}")
    return 0


def dense_against_onednn(args: argparse.Namespace) -> int:
    """`--dense`: `F.linear` over the dense weights against oneDNN's packed copy."""
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    print(f"{'rows':>5} {'shape':>10} {'oneDNN ms':>10} {'GFLOP/s':>8} {'F.linear ms':>11} "
          f"{'GFLOP/s':>8} {'speed-up':>8} {'same bits':>9}")
    for shape in args.shape:
        out_f, in_f = (int(n) for n in shape.split("x"))
        weights = [torch.randn(out_f, in_f, generator=gen).to(dtype) for _ in range(args.layers)]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights]
        for rows in args.rows:
            x = torch.randn(rows, in_f, generator=gen).to(dtype)
            a = median_seconds(lambda x=x, ws=onednn: [_onednn(x, w) for w in ws], args.repeat)
            b = median_seconds(lambda x=x, ws=weights: [F.linear(x, w) for w in ws], args.repeat)
            same = (F.linear(x, weights[0]) == _onednn(x, onednn[0])).double().mean().item()
            gflop = 2 * rows * out_f * in_f * args.layers / 1e9
            print(f"{rows:>5} {shape:>10} {a * 1e3:>10.2f} {gflop / a:>8.1f} {b * 1e3:>11.2f} "
                  f"{gflop / b:>8.1f} {a / b:>7.2f}x {same:>9.4f}")
    rows = packed_linears.dense_from(dtype, torch.get_num_threads())
    taken = "no row count (oneDNN won at 512)" if rows == packed_linears.NEVER else f"{rows} rows"
    print(f"the engine takes F.linear from {taken}")
    return 0


def blocks(args: argparse.Namespace) -> int:
    """`--blocks`: the blocks kernel against `f32_gemm` over the blocks' float32 values."""
    kernel, f32 = quant_gemm.build(args.blocks), f32_gemm.build()
    if kernel is None or f32 is None:
        print("no C compiler here")
        return 1
    gen = np.random.default_rng(0)
    print(f"{'rows':>4} {'shape':>10} {'f32 ms':>8} {'GB/s':>6} {'blocks ms':>9} {'GB/s':>6} "
          f"{'speed-up':>8} {'same bits':>9}")
    for shape in args.shape:
        out_f, in_f = (int(n) for n in shape.split("x"))
        weights = [quant_gemm.random_blocks(args.blocks, (out_f, in_f), gen)
                   for _ in range(args.layers)]
        ours = [kernel.pack(w) for w in weights]
        theirs = [f32.pack(w.dense()) for w in weights]
        gb_ours = sum(p.nbytes for p in ours) / 1e9
        gb_theirs = sum(p.nbytes for p in theirs) / 1e9
        for rows in args.rows:
            x = torch.randn(rows, in_f)
            a = median_seconds(lambda x=x, ws=theirs, n=out_f: [f32(x, w, None, n) for w in ws],
                               args.repeat)  # fmt: skip
            b = median_seconds(lambda x=x, ws=ours, n=out_f: [kernel(x, w, None, n) for w in ws],
                               args.repeat)  # fmt: skip
            same = kernel(x, ours[0], None, out_f) == f32(x, theirs[0], None, out_f)
            print(f"{rows:>4} {shape:>10} {a * 1e3:>8.2f} {gb_theirs / a:>6.1f} {b * 1e3:>9.2f} "
                  f"{gb_ours / b:>6.1f} {a / b:>7.2f}x {same.double().mean().item():>9.4f}")
    return 0


def engine_steps(args: argparse.Namespace) -> int:
    """`--model`: decode steps with the engine's GGUF blocks on and off in turn."""
    from bench_decode_kernel import engine_steps as alternate

    registry = packed_linears._REGISTRY  # dense weight -> its packed copies, blocks among them
    saved: dict = {}

    def put(on: bool) -> None:
        if not saved:  # the engine's entries, as it packed them
            saved.update(registry)
        for ptr, entry in saved.items():
            registry[ptr] = entry if on else entry._replace(quantized=None)

    args.dtype = "float32"
    alternate(args, {"blocks": lambda: put(True), "float32": lambda: put(False)})
    return 0


def base_f32_gemm(tree: Path, max_rows: int) -> f32_gemm.F32Gemm:
    """Another checkout's `f32_gemm`: its C source (and the headers beside it) built here as a
    library of its own, called as this tree's."""
    source = tree / "worker" / "kernels" / "csrc" / f32_gemm.SOURCE
    library = builder.build("f32_linear_base", source)
    if library is None:
        raise SystemExit(f"the f32_gemm of {tree} does not build here")
    return f32_gemm.F32Gemm(library, max_rows)


def against_base(args: argparse.Namespace) -> int:
    """`--base-tree`: this tree's `f32_gemm` against another checkout's."""
    kernel = f32_gemm.build()
    if kernel is None:
        print("no C compiler here")
        return 1
    base = base_f32_gemm(args.base_tree, kernel.max_rows)
    if base.group != kernel.group:
        raise SystemExit(f"{args.base_tree}'s layout differs (groups of {base.group})")
    if args.model is not None:
        return base_steps(args, kernel._fn, base._fn)
    gen = torch.Generator().manual_seed(0)
    print(f"{'rows':>4} {'shape':>10} | from memory: {'this ms':>8} {'base ms':>8} "
          f"{'GFLOP/s':>11} {'ratio':>6} | in cache: {'GFLOP/s':>11} {'ratio':>6}")
    for shape in args.shape:
        out_f, in_f = (int(n) for n in shape.split("x"))
        packed = [kernel.pack(torch.randn(out_f, in_f, generator=gen)) for _ in range(args.layers)]
        for rows in args.rows:
            x = torch.randn(rows, in_f, generator=gen)
            assert torch.equal(kernel(x, packed[0], None, out_f), base(x, packed[0], None, out_f))
            runs = {"cold": packed, "hot": packed[:1] * len(packed)}
            times = {(name, run): [] for name in ("this", "base") for run in runs}
            for _ in range(args.repeat):  # the two in turn, so that drift hits both
                for name, k in (("this", kernel), ("base", base)):
                    for run, weights in runs.items():  # a pass over the weights, once
                        timer = per_weight(lambda x, w, k=k, n=out_f: k(x, w, None, n), weights, 1)
                        times[(name, run)].append(timer(x) * len(weights))
            t = {key: statistics.median(v) for key, v in times.items()}
            gflop = 2 * rows * out_f * in_f * args.layers / 1e9
            cold = (t[("this", "cold")], t[("base", "cold")])
            hot = (t[("this", "hot")], t[("base", "hot")])
            print(f"{rows:>4} {shape:>10} | {'':13}{cold[0] * 1e3:>8.2f} {cold[1] * 1e3:>8.2f} "
                  f"{gflop / cold[0]:>5.1f}/{gflop / cold[1]:>5.1f} {cold[0] / cold[1]:>5.3f}x | "
                  f"{'':10}{gflop / hot[0]:>5.1f}/{gflop / hot[1]:>5.1f} {hot[0] / hot[1]:>5.3f}x")
    return 0


def base_steps(args: argparse.Namespace, ours: ctypes._CFuncPtr, base: ctypes._CFuncPtr) -> int:
    """`--base-tree` with `--model`: decode steps, this tree's `f32_gemm` and the base's in
    turn (the engine's own kernel, its `max_rows` as calibrated, serving each)."""
    from bench_decode_kernel import engine_steps as alternate

    def put(fn: ctypes._CFuncPtr) -> None:
        kernel = f32_gemm.load()
        if kernel is not None:
            kernel._fn = fn

    args.dtype = "float32"
    alternate(args, {"this tree": lambda: put(ours), "base": lambda: put(base)})
    put(ours)
    kernel = f32_gemm.load()
    print(f"(f32_gemm took linears of up to {kernel.max_rows if kernel else 0} rows in this "
          "engine, as calibrated at its load; more went to oneDNN or F.linear)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
