"""A C kernel's source built here as for another CPU (an instruction set turned off by a flag),
to run on this machine the path that CPU takes."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

from worker.models import c_library


def build_without(source: str, flag: str, directory: Path, *more: str) -> ctypes.CDLL:
    """The library of `source` built with the kernels' flags, `flag` (e.g. `-mno-avx512f`) and
    `more` (e.g. a `-D` of the source's) into `directory`; the test skips where there is no C
    compiler or it cannot build so."""
    compiler = c_library.compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    path, library = directory / "kernel.c", directory / "kernel.so"
    path.write_text(source)
    build = [compiler, *c_library.FLAGS, flag, *more, str(path), "-o", str(library)]
    if subprocess.run(build, capture_output=True).returncode != 0:
        pytest.skip(f"this compiler cannot build for x86 with {flag}")
    return ctypes.CDLL(str(library))
