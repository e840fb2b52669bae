"""Linears at decode sizes: the few-rows C kernels against oneDNN's packed linear.

`worker.models.pair_gemm` in bfloat16 (the default), `worker.models.f32_gemm` with `--dtype
float32`. For each row count, every layer's weights of one shape (distinct tensors, so the
weights come from memory as in a decode step, not from cache) go through oneDNN's packed
linear, then through the kernel; printed: ms per pass, the weight stream in GB/s, the ratio,
and the share of outputs with the same bits. One torch thread (the kernels' own condition).

    python bench/bench_linears.py                      # SmolLM2-135M's shapes, 30 layers
    python bench/bench_linears.py --dtype float32 --rows 1 8 32 --shape 49152x576 --layers 2
    python bench/bench_linears.py --rows 1 8 --layers 8 --shape 4096x4096
    python bench/bench_linears.py --variant dpbf16     # bf16: one build, not the calibrated
"""

from __future__ import annotations

import argparse

import torch

from worker.models.few_rows import median_seconds
from worker.models.packed import FEW_ROWS

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
    args = parser.parse_args()
    torch.set_num_threads(1)
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


if __name__ == "__main__":
    raise SystemExit(main())
