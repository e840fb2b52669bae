"""KV memory of one long request on Gemma 3 270M: all layers full vs our two pools.

Computed: a cache that keeps every layer's K/V for every token holds `tokens x (all layers)`;
ours holds `tokens` in the full-attention layers' pool and at most `window + chunk + page` in
the window layers' pool. Measured: the most slots of each pool the request held at any step
while it prefilled in `--chunk`-token chunks and decoded `--output` tokens (random token ids:
memory does not depend on them).

    python bench/gemma3_kv_memory.py --tokens 8192 --json bench/results/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from worker.engine import Engine, EngineConfig  # noqa: E402
from worker.loader import resolve_model  # noqa: E402
from worker.protocol import GenerateRequest, SamplingParams  # noqa: E402

MIB = 1 << 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--output", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    page = args.page
    engine = Engine(EngineConfig(
        model=str(resolve_model(args.model)), dtype="float32", page_size=page,
        prefill_budget=args.chunk, kv_tokens=args.tokens + args.output + 2 * page,
        max_running=1, enable_cache=False, pack_weights=False,
    ))  # fmt: skip
    runner, memory = engine.runner, engine.memory
    full_bytes, window_bytes = runner.bytes_per_slot(), runner.bytes_per_window_slot()
    window = engine.model.config.sliding_window
    prompt = torch.randint(10, 20000, (args.tokens,), generator=torch.Generator().manual_seed(0))
    sp = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    engine.add_request(GenerateRequest("long", prompt.tolist(), sp))
    most_full = most_window = 0
    started = time.perf_counter()
    while engine.has_work():
        engine.step(settle=False)
        engine.check_integrity()
        most_full = max(most_full, memory.allocator.size - memory.allocator.available_size())
        most_window = max(most_window, memory.window.attached())
    seconds = time.perf_counter() - started
    tokens = args.tokens + args.output
    figures = {
        "tokens": tokens,
        "all_layers_full_mib": tokens * (full_bytes + window_bytes) / MIB,
        "ours_bound_mib": (tokens * full_bytes + (window + args.chunk + page) * window_bytes)
        / MIB,
        "ours_measured_mib": (most_full * full_bytes + most_window * window_bytes) / MIB,
        "full_slots_held": most_full,
        "window_slots_held": most_window,
        "window_layers_all_full_mib": tokens * window_bytes / MIB,
        "window_layers_measured_mib": most_window * window_bytes / MIB,
        "seconds": seconds,
    }
    for key, value in figures.items():
        print(f"{key:28s} {value:10.1f}" if isinstance(value, float) else f"{key:28s} {value:10d}")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                capture_output=True, text=True).stdout.strip()
        Path(args.json).write_text(json.dumps(
            {"args": vars(args), "commit": commit, "machine": {
                "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                "platform": platform.platform()}, "figures": figures}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
