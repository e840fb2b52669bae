"""Write a model's tensors as safetensors: one file, or shards and their index."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

SHARD_BYTES = 2 << 30  # float32 shards of at most ~2 GiB, listed in model.safetensors.index.json


def save_shards(tensors: Iterator[tuple[str, torch.Tensor]], dest: Path) -> None:
    """One `model.safetensors`, or shards of at most SHARD_BYTES and their index; a shard is
    written as soon as it is full, so at most one shard is held in memory."""
    shard: dict[str, torch.Tensor] = {}
    size = 0
    files: list[list[str]] = []  # the tensor names of each written shard

    def flush() -> None:
        files.append(list(shard))
        save_file(shard, str(dest / f"model-{len(files):05d}.safetensors"), {"format": "pt"})
        shard.clear()

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > SHARD_BYTES:
            flush()
            size = 0
        shard[name] = tensor
        size += nbytes
    if not files:
        save_file(shard, str(dest / "model.safetensors"), metadata={"format": "pt"})
        return
    flush()
    weight_map = {
        name: f"model-{i:05d}.safetensors" for i, names in enumerate(files, 1) for name in names
    }
    index = {"metadata": {}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
