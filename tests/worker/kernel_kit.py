"""A C kernel's source built here as for another CPU (an instruction set turned off by a flag),
to run on this machine the path that CPU takes."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

from worker.kernels import build as kernel_build


def build_without(source: str, flag: str, directory: Path, *more: str) -> ctypes.CDLL:
    """The library of `source` (a file of worker/kernels/csrc) built with the kernels' flags,
    `flag` (e.g. `-mno-avx512f`) and `more` (e.g. a `-D` of the source's) into `directory`; the
    test skips where there is no C compiler or it cannot build so."""
    compiler = kernel_build.compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    library = directory / "kernel.so"
    command = kernel_build.compile_command(
        compiler, kernel_build.CSRC / source, library, extra=(flag, *more)
    )
    if subprocess.run(command, capture_output=True).returncode != 0:
        pytest.skip(f"this compiler cannot build for x86 with {flag}")
    return ctypes.CDLL(str(library))
