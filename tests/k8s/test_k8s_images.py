"""The images: Ray's conventions (base image, `ray` user, `ray start`), a pinned torch, every
package copied and kept by .dockerignore, and build steps that call code that exists."""

from __future__ import annotations

import json
import re
import shutil
from typing import Any

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

DOCKERFILES = ("Dockerfile.cpu", "Dockerfile.cuda")


@pytest.fixture(scope="module", params=DOCKERFILES)
def dockerfile(request: pytest.FixtureRequest, kube: Any) -> list[tuple[str, str]]:
    return kube.dockerfile_instructions(request.param)


def test_image_follows_ray_conventions(dockerfile: list) -> None:
    froms = [a for i, a in dockerfile if i == "FROM"]
    assert froms == ["${BASE_IMAGE}"]  # a build argument: Ray's image unless told otherwise
    args = [a for i, a in dockerfile if i == "ARG"]
    base = next(a.split("=", 1)[1] for a in args if a.startswith("BASE_IMAGE="))
    assert base.startswith("rayproject/ray:${RAY_VERSION}-py311-")
    # RAY_VERSION is declared again after FROM, so the pinned Ray below sees it
    assert args.index("RAY_VERSION") > args.index(f"BASE_IMAGE={base}")
    runs = " ".join(a for i, a in dockerfile if i == "RUN")
    assert '"ray[serve]==${RAY_VERSION}"' in runs
    assert ("USER", "ray") in dockerfile
    (cmd,) = [json.loads(a) for i, a in dockerfile if i == "CMD"]
    assert cmd[:2] == ["ray", "start"]
    assert not [a for i, a in dockerfile if i == "ENTRYPOINT"]  # KubeRay supplies the command


def test_image_entry_program_and_flags_exist(dockerfile: list) -> None:
    from ray.scripts.scripts import start

    (cmd,) = [json.loads(a) for i, a in dockerfile if i == "CMD"]
    assert shutil.which(cmd[0]), f"{cmd[0]} is not installed"
    options = {opt for param in start.params for opt in param.opts}
    for word in cmd[2:]:
        assert word.split("=")[0] in options, f"`ray start` has no {word}"


def test_image_pins_torch(kube: Any) -> None:
    cpu = (kube.K8S / "Dockerfile.cpu").read_text()
    cuda = (kube.K8S / "Dockerfile.cuda").read_text()
    for text in (cpu, cuda):
        assert re.search(r"pip install .*torch==2\.13\.0 --index-url \$\{TORCH_INDEX_URL\}", text)
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", cpu, re.M)
    assert re.search(r"^ARG TORCH_INDEX_URL=https://pypi\.org/simple$", cuda, re.M)


def test_image_copies_every_package_and_pregenerates_tiny(dockerfile: list, kube: Any) -> None:
    pyproject = tomllib.loads((kube.REPO / "pyproject.toml").read_text())
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in include}
    copied = set()
    for instruction, args in dockerfile:
        if instruction == "COPY":
            copied |= {w for w in args.split()[:-1] if not w.startswith("--")}
    assert packages | {"pyproject.toml", "README.md"} <= copied
    for path in copied:
        assert (kube.REPO / path).exists(), path
    runs = " ".join(a for i, a in dockerfile if i == "RUN")
    for module_name, attr in re.findall(r"from ([\w.]+) import (\w+)", runs):
        module = kube.import_or_skip(module_name)
        assert hasattr(module, attr), f"{module_name}.{attr} does not exist"
    baked = dict(a.split("=", 1) for i, a in dockerfile if i == "ARG" and "=" in a)
    assert "tiny" in baked["BUILTIN_MODELS"].strip('"').split()


def test_dockerignore_keeps_what_the_images_copy(dockerfile: list, kube: Any) -> None:
    patterns = [
        line.strip() for line in (kube.REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*"  # an allow-list: nothing reaches the daemon unless named
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for instruction, args in dockerfile:
        if instruction == "COPY":
            for path in (w for w in args.split()[:-1] if not w.startswith("--")):
                assert path in allowed, f".dockerignore drops {path}"








