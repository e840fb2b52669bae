"""Running Triton kernels on a machine with no GPU: Triton's CPU interpreter, in a child process
(`TRITON_INTERPRET=1` must be set before a kernel is defined).

Imported as `from triton_kit import ...` (this folder's conftest.py puts it on `sys.path`).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)

# Triton 3.6's interpreter turns a loop bound loaded from memory into a Python int with
# `int(array)` on a one-element 1-d array, which numpy 2 refuses; read the element instead.
_INTERPRETER_FIX = """
import triton.runtime.interpreter as _interp
_patch_tensor = _interp._patch_lang_tensor
def _patched(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
_interp._patch_lang_tensor = _patched
"""


def run_interpreted(code: str, *args: str, timeout: float = 300) -> str:
    """Run `code` (a Python script) in Triton's interpreter; its stdout. Fails the test with
    the end of its stderr when it exits non-zero."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-c", _INTERPRETER_FIX + code, *args]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
