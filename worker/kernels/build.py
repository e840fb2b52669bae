"""The one builder of the CPU kernels: a C source of `csrc/` built at first use into a shared
library for this CPU, cached on disk, loaded with ctypes (which releases the GIL during a call).

A source is compiled with the system C compiler (`$CC`, default `cc`; `-march=native`) into
`kernels/` of the cache (`cache_dir.cache_root()`), keyed by the contents of the source and of
every `csrc/` header it includes, the defines, the flags and the CPU's instruction set: a cache
directory shared between nodes must not hand one CPU's build to another (an instruction the
other lacks would kill the process). `build` returns None when there is no compiler or the
build fails; each kernel's caller then keeps its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from worker.kernels.cache_dir import cache_root

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")  # the kernels' C sources and headers (package data)

# Reassociation (to vectorize the sums and maxima), but not -ffast-math: with GCC < 13 a shared
# library built with it sets flush-to-zero for the whole process when it is loaded.
FLAGS = (
    "-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
    "-fassociative-math", "-ffp-contract=fast", "-fPIC", "-shared", "-std=c11",
)  # fmt: skip
# On x86, loops the compiler vectorizes take 512-bit vectors where the core has AVX-512 (GCC
# prefers 256 on Intel cores; the wider loops of SwiGLU and RMSNorm ran faster with the same
# bits, see docs/engine.md). Without AVX-512 it changes nothing.
if platform.machine().lower() in ("x86_64", "amd64"):
    FLAGS += ("-mprefer-vector-width=512",)

# the element dtypes `build_for` builds a source for (float32 with `-DELEM_F32`, see
# csrc/element.h), and the suffix of each one's library name
ELEMENT_DTYPES = {torch.bfloat16: "", torch.float32: "_f32"}

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def compiler() -> str | None:
    """The system C compiler's path (`$CC`, default `cc`), or None."""
    return shutil.which(os.environ.get("CC", "cc"))


def build_for(name: str, source: str | Path, dtype: torch.dtype) -> ctypes.CDLL | None:
    """`build` of a source written over csrc/element.h for elements of `dtype` (one of
    `ELEMENT_DTYPES`), as a library of its own."""
    defines = ("ELEM_F32=1",) if dtype == torch.float32 else ()
    return build(name + ELEMENT_DTYPES[dtype], source, defines)


def build(name: str, source: str | Path, defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library of `source` (a file of `CSRC`, or a path) with `defines` (`-D` arguments,
    "NAME=VALUE"), built now unless a build for this CPU is cached, or None (logged) when it
    cannot be built here."""
    cc = compiler()
    if cc is None:
        logger.info("no C compiler: the CPU kernel %s is off (torch path)", name)
        return None
    path = CSRC / source  # an absolute path stays itself
    key = hashlib.sha256()
    for part in (*(f.read_bytes() for f in included_files(path)), *defines, *FLAGS, _cpu()):
        key.update(part if isinstance(part, bytes) else part.encode())
        key.update(b"\0")
    directory = cache_root() / "kernels"
    library = directory / f"{name}_{key.hexdigest()[:16]}.so"
    try:
        if not library.exists():
            _compile(cc, path, defines, directory, library)
        return ctypes.CDLL(str(library))
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("CPU kernel %s unavailable, using the torch path: %s", name, e)
        return None


def included_files(source: Path) -> list[Path]:
    """`source` and every file it includes with `#include "..."` (beside it), transitively,
    each once: what a build's cache key must cover."""
    files, todo = [], [source]
    while todo:
        path = todo.pop(0)
        if path in files:
            continue
        files.append(path)
        todo += [path.parent / name for name in _INCLUDE.findall(path.read_text())]
    return files


def compile_command(
    cc: str, source: Path, library: Path, defines: tuple[str, ...] = (), extra: tuple[str, ...] = ()
) -> list[str]:
    """The compiler's command line that builds `source` into `library` with the kernels'
    flags, `extra` flags and `defines`; headers are looked up beside the source."""
    return [cc, *FLAGS, *extra, f"-I{source.parent}", *(f"-D{d}" for d in defines), str(source),
            "-o", str(library)]  # fmt: skip


def _cpu() -> str:
    """The machine and its instruction-set flags (what `-march=native` builds for)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine() + " " + (flags or platform.processor())


def _compile(
    cc: str, source: Path, defines: tuple[str, ...], directory: Path, library: Path
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        built = Path(tmp) / library.name
        command = compile_command(cc, source, built, defines)
        subprocess.run(command, check=True, capture_output=True, timeout=120)
        os.replace(built, library)  # atomic: concurrent builders never load a partial file
