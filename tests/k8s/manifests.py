"""The repository's Kubernetes manifests as data: where they are, rendered, and walked."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
# KubeRay's CRDs and samples, kept next to the repository (absent in a user's own checkout).
KUBERAY = REPO / ".." / "shared" / "kuberay"
OVERLAYS = sorted(
    p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file()
)


def load_documents(text: str) -> Iterator[dict[str, Any]]:
    """The non-empty YAML documents of a multi-document string."""
    for doc in yaml.load_all(text, Loader=yaml.CSafeLoader):
        if isinstance(doc, dict):
            yield doc


def render(overlay: str) -> list[dict[str, Any]]:
    """`kubectl kustomize k8s/overlays/<overlay>` as a list of resources.

    Raises FileNotFoundError without kubectl, RuntimeError when kustomize fails.
    """
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise FileNotFoundError("kubectl")
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True, text=True, timeout=120,
    )
    if out.returncode != 0:
        raise RuntimeError(f"kustomize failed for {overlay}:\n{out.stderr}")
    return list(load_documents(out.stdout))


def is_ray_resource(resource: dict[str, Any]) -> bool:
    return str(resource.get("apiVersion", "")).startswith("ray.io/")


def of_kind(resources: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in resources if r.get("kind") == kind]


def cluster_spec(resource: dict[str, Any]) -> dict[str, Any]:
    """The RayCluster spec of a RayCluster, or of a RayService's rayClusterConfig."""
    if resource["kind"] == "RayService":
        return resource["spec"]["rayClusterConfig"]
    return resource["spec"]


def head_container(resource: dict[str, Any]) -> dict[str, Any]:
    containers = cluster_spec(resource)["headGroupSpec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "ray-head")


def pod_templates(resource: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The head's pod template, then each worker group's."""
    spec = cluster_spec(resource)
    yield spec["headGroupSpec"]["template"]
    for group in spec.get("workerGroupSpecs", []):
        yield group["template"]


def serve_config(resource: dict[str, Any]) -> dict[str, Any]:
    """A RayService's serveConfigV2, parsed."""
    return yaml.safe_load(resource["spec"]["serveConfigV2"])


def head_serve_argv(resource: dict[str, Any]) -> list[str]:
    """The `radixray serve ...` arguments (after `serve`) in a RayCluster head's shell command."""
    import shlex

    script = " ".join(head_container(resource).get("args", []))
    words = shlex.split(script)
    for i in range(len(words) - 1):
        if words[i] == "radixray" and words[i + 1] == "serve":
            tail = words[i + 2:]
            end = next((j for j, w in enumerate(tail) if w in ("&&", ";", "||", "&")), len(tail))
            return tail[:end]
    raise ValueError("no `radixray serve` in the head command")


OURS = ("mem_cache", "worker", "router", "cluster", "testing")


def import_or_skip(name: str) -> Any:
    """Imports ``name``, a module a manifest names. Skips only while a third-party dependency
    of it is not installed; a module of ours that is missing (a manifest naming a module that
    was renamed or removed) fails, as does any other import error."""
    import importlib

    import pytest

    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] not in OURS:
            pytest.skip(f"{exc.name} is not installed, needed by {name}")
        raise


def dockerfile_instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of k8s/<name>, continuations joined and comments dropped."""
    import re

    joined = re.sub(r"\\\n", " ", (K8S / name).read_text())
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def skip_or_fail(reason: str) -> None:
    """Skips with `reason`, or fails in CI (CI=true), which sets up what these tests need."""
    import pytest

    if os.environ.get("CI") == "true":
        pytest.fail(reason + " (CI sets it up: .ci/run)")
    pytest.skip(reason)
