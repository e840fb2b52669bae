"""The strict KubeRay schema validator: no false positives on upstream samples, and it catches
the mistakes a hand-written manifest makes (misspelled or misplaced fields, wrong types)."""

from __future__ import annotations

import copy
from typing import Any

import pytest


def _samples(kube: Any, kuberay_dir: Any) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted((kuberay_dir / "samples").glob("*.yaml")):
        for doc in kube.load_documents(path.read_text()):
            if kube.is_ray_resource(doc):
                found.append((path.name, doc))
    return found


@pytest.fixture(scope="module")
def samples(kube: Any, kuberay_dir: Any) -> list[tuple[str, dict[str, Any]]]:
    return _samples(kube, kuberay_dir)


def _sample(samples: list, name: str, kind: str) -> dict[str, Any]:
    return copy.deepcopy(next(d for n, d in samples if n == name and d["kind"] == kind))


def test_every_upstream_sample_passes(samples: list, crd_validator: Any) -> None:
    checked = 0
    failures = {}
    for name, doc in samples:
        if doc["kind"] not in crd_validator.kinds():
            continue  # e.g. RayCronJob: no CRD of it in ../shared/kuberay
        checked += 1
        errors = crd_validator.errors(doc)
        if errors:
            failures[f"{name} {doc['kind']}"] = errors[:3]
    assert not failures, failures
    kinds = {doc["kind"] for _, doc in samples}
    assert {"RayCluster", "RayService", "RayJob"} <= kinds
    assert checked >= 80, f"only {checked} sample resources checked"


@pytest.mark.parametrize(
    "path, typo",
    [
        (("spec", "serveConfigV2"), "serveConfigv2"),
        (("spec", "rayClusterConfig", "headGroupSpec", "rayStartParams"), "rayStartParam"),
        (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "minReplicas"), "minReplica"),
        (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "template", "spec", "containers",
          0, "resources"), "resource"),
    ],
)
def test_misspelled_field_fails(samples: list, crd_validator: Any, path: tuple, typo: str) -> None:
    doc = _sample(samples, "ray-service.sample.yaml", "RayService")
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[typo] = parent.pop(path[-1])
    errors = crd_validator.errors(doc)
    assert any(typo in e for e in errors), errors


def test_field_in_the_wrong_place_fails(samples: list, crd_validator: Any) -> None:
    doc = _sample(samples, "ray-cluster.autoscaler.yaml", "RayCluster")
    doc["spec"]["headGroupSpec"]["maxReplicas"] = 3  # a worker-group field on the head group
    assert any("maxReplicas" in e for e in crd_validator.errors(doc))


def test_wrong_type_fails(samples: list, crd_validator: Any) -> None:
    doc = _sample(samples, "ray-cluster.autoscaler.yaml", "RayCluster")
    doc["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    assert crd_validator.errors(doc)


def test_defaults_fill_required_fields_and_nulls_are_dropped(
    samples: list, crd_validator: Any
) -> None:
    doc = _sample(samples, "ray-cluster.autoscaler.yaml", "RayCluster")
    group = doc["spec"]["workerGroupSpecs"][0]
    del group["maxReplicas"]  # required, but the API server fills in its default
    doc["spec"]["suspend"] = None  # the API server drops nulls
    assert crd_validator.errors(doc) == []
    del group["groupName"]  # required, no default
    assert any("groupName" in e for e in crd_validator.errors(doc))


def test_unknown_kind_is_reported(crd_validator: Any) -> None:
    doc = {"apiVersion": "ray.io/v1", "kind": "RayThing", "metadata": {"name": "x"}}
    assert crd_validator.errors(doc) == ["no CRD schema for ray.io/v1 RayThing"]
