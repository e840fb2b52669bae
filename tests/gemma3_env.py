"""Where the tests find Gemma 3 270M's real weights.

`.ci/run` builds the model directory (`python -m worker.loader gemma3-270m`) and exports
`RADIXRAY_GEMMA3_DIR`. Outside CI the tests that need it skip with this reason; in CI
(`CI=true`) a missing model is a failure, not a skip.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REASON = (
    "no Gemma 3 weights: set RADIXRAY_GEMMA3_DIR to the gemma3-270m HF directory "
    "(`python -m worker.loader gemma3-270m` prints it, as .ci/run does)"
)


def require_gemma3_dir() -> Path:
    """The model directory, or skip (outside CI) / fail (in CI) with the reason."""
    env = os.environ.get("RADIXRAY_GEMMA3_DIR")
    path = Path(env) if env else None
    if path is not None and (path / "config.json").is_file():
        return path
    if os.environ.get("CI") == "true":
        pytest.fail(REASON + " — CI must run the real-model tests")
    pytest.skip(REASON)
