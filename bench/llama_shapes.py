"""Random-weight Llama models of real shapes, for GPU benchmarks: `python bench/llama_shapes.py
SHAPE DIR` writes an HF directory (bf16 weights) that `--model DIR` loads.

The shapes follow published configs (Llama-3.2-1B and Llama-3.1-8B: hidden size, MLP width,
layers, heads, KV heads, vocabulary); the weights are seeded random draws, so speed figures
hold for the shape and text is meaningless. Writing the 8B shape takes ~16 GB of disk.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from worker.loader.builtin import BuiltinSpec, write_random_llama  # noqa: E402

SHAPES = {
    "1b": BuiltinSpec(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                      num_heads=32, num_kv_heads=8, max_context=32768, rope_theta=500000.0),
    "8b": BuiltinSpec(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, max_context=32768,
                      rope_theta=500000.0),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("dest", type=Path)
    args = parser.parse_args()
    if (args.dest / "config.json").exists():
        print(f"{args.dest} exists", file=sys.stderr)
        return
    args.dest.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    write_random_llama(args.dest, f"llama-{args.shape}", SHAPES[args.shape], torch.bfloat16)
    size = sum(f.stat().st_size for f in args.dest.iterdir()) / 1e9
    print(f"{args.shape}: {size:.1f} GB in {time.monotonic() - t0:.0f} s -> {args.dest}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
