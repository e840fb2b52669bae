"""The one on-disk cache of the worker: converted models (`worker.loader`) and built CPU kernels
(`worker.kernels.build`) live under it. It sits at the bottom of the imports so that both ask it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where model directories are cached: $RADIXRAY_CACHE, else ~/.cache/radixray/models."""
    env = os.environ.get("RADIXRAY_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "radixray" / "models"
