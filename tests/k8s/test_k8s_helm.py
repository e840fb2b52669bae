"""The Helm chart (k8s/helm/radixray): `helm lint` and `helm template` with a real helm for every
values file in its ci/ folder, every rendered object validated as the Kustomize overlays' are
(Ray resources against KubeRay's strict CRD schemas, core kinds against Kubernetes' own), and
the chart kept from drifting: for each overlay, ci/<overlay>-values.yaml renders the same
objects as `kubectl kustomize k8s/overlays/<overlay>`.

helm comes from `k8s/get-helm.sh` (CI runs it); without it these tests skip, saying so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

K8S_VERSION = "1.30.0"
HELM_LABELS = ("app.kubernetes.io/managed-by", "helm.sh/chart")  # on top-level objects only


def _chart(kube: Any) -> Path:
    return kube.K8S / "helm" / "radixray"


def _values_files(kube: Any) -> list[str]:
    return sorted(p.name for p in (_chart(kube) / "ci").glob("*-values.yaml"))


@pytest.fixture(scope="session")
def helm(kube: Any) -> str:
    found = os.environ.get("RADIXRAY_HELM") or shutil.which("helm")
    if not found:
        kube.skip_or_fail("helm not found: k8s/get-helm.sh puts one in the virtual environment")
    return found


def _run(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)


def _template(helm: str, kube: Any, *args: str) -> list[dict[str, Any]]:
    out = _run(helm, "template", "radixray", str(_chart(kube)), *args)
    assert out.returncode == 0, out.stderr
    return list(kube.load_documents(out.stdout))


@pytest.fixture(scope="session")
def charts(helm: str, kube: Any) -> dict[str, list[dict[str, Any]]]:
    """Every ci/ values file, rendered once per session."""
    return {name: _template(helm, kube, "-f", str(_chart(kube) / "ci" / name))
            for name in _values_files(kube)}


def test_every_overlay_has_a_values_file(kube: Any) -> None:
    names = set(_values_files(kube))
    assert {f"{overlay}-values.yaml" for overlay in kube.OVERLAYS} <= names
    assert any("gcs-ft" in n for n in names)


def test_helm_lint_passes_for_every_values_file(helm: str, kube: Any) -> None:
    for name in _values_files(kube):
        out = _run(helm, "lint", "--strict", str(_chart(kube)),
                   "-f", str(_chart(kube) / "ci" / name))
        assert out.returncode == 0, (name, out.stdout, out.stderr)


def test_rendered_ray_resources_match_the_kuberay_crds(
    charts: dict, kube: Any, crd_validator: Any
) -> None:
    for name, resources in charts.items():
        ray = [r for r in resources if kube.is_ray_resource(r)]
        assert len(ray) == 1, name
        assert crd_validator.errors(ray[0]) == [], name


def test_rendered_core_kinds_match_the_kubernetes_schemas(charts: dict) -> None:
    for name, resources in charts.items():
        core = [r for r in resources if r["apiVersion"] in ("v1", "apps/v1")]
        assert core, name
        for resource in core:
            kubernetes_validate.validate(resource, K8S_VERSION, strict=True)


def _normalized(resource: dict[str, Any]) -> dict[str, Any]:
    """`resource` without what only tells who rendered it: Helm's bookkeeping labels, YAML
    layout inside strings (serveConfigV2 compared as data, a shell command's whitespace), and
    nulls in serveConfigV2 `args` (`kv_tokens: null` and no `kv_tokens` mean the same)."""
    out = yaml.safe_load(yaml.safe_dump(resource))
    labels = out["metadata"].get("labels", {})
    for label in HELM_LABELS:
        labels.pop(label, None)
    if out["kind"] == "RayService":
        config = yaml.safe_load(out["spec"]["serveConfigV2"])
        for app in config["applications"]:
            app["args"] = {k: v for k, v in app["args"].items() if v is not None}
        out["spec"]["serveConfigV2"] = config
    if out["kind"] == "RayCluster":
        for group in [out["spec"]["headGroupSpec"], *out["spec"]["workerGroupSpecs"]]:
            for container in group["template"]["spec"]["containers"]:
                if "args" in container:
                    container["args"] = [" ".join(a.split()) for a in container["args"]]
    if out["kind"] == "ConfigMap":
        out["data"] = {k: v.rstrip("\n") for k, v in out["data"].items()}
    return out


def _by_name(resources: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["kind"], r["metadata"]["name"]): _normalized(r) for r in resources}


def test_chart_renders_what_each_overlay_renders(
    overlay: str, charts: dict, rendered: dict
) -> None:
    chart = _by_name(charts[f"{overlay}-values.yaml"])
    kustomize = _by_name(rendered[overlay])
    assert sorted(chart) == sorted(kustomize)
    for key, resource in kustomize.items():
        assert chart[key] == resource, key


def test_a_drift_between_chart_and_overlay_is_caught(charts: dict, rendered: dict) -> None:
    # what the comparison above would see if a values file and its overlay disagreed
    chart = _by_name(charts["gpu-values.yaml"])
    kustomize = _by_name(rendered["gpu"])
    drifted = yaml.safe_load(yaml.safe_dump(kustomize[("RayService", "radixray")]))
    drifted["spec"]["serveConfigV2"]["applications"][0]["args"]["workers"] = 3
    assert chart[("RayService", "radixray")] != drifted
    assert chart[("RayService", "radixray")] == kustomize[("RayService", "radixray")]


def test_both_keys_come_from_secrets(charts: dict, kube: Any) -> None:
    for name, resources in charts.items():
        (ray,) = [r for r in resources if kube.is_ray_resource(r)]
        env = {e["name"]: e for e in kube.head_container(ray)["env"]}
        api = env["RADIXRAY_API_KEY"]["valueFrom"]["secretKeyRef"]
        admin = env["RADIXRAY_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]
        assert (api["name"], api["key"]) == ("radixray-api-key", "api-key")
        assert (admin["name"], admin["key"]) == ("radixray-admin-key", "admin-key")
        required = name.startswith("gpu")
        assert api["optional"] is admin["optional"] is (not required), name


def test_keys_are_refused_as_plain_values(helm: str, kube: Any) -> None:
    for key in ("api_key", "admin_key"):
        out = _run(helm, "template", "radixray", str(_chart(kube)),
                   "--set", f"extraArgs.{key}=secret")
        assert out.returncode != 0 and "Secrets" in out.stderr, out.stderr


def test_gcs_fault_tolerance_option(helm: str, charts: dict, kube: Any) -> None:
    (service,) = [r for r in charts["gpu-gcs-ft-values.yaml"] if r["kind"] == "RayService"]
    options = kube.cluster_spec(service)["gcsFaultToleranceOptions"]
    assert options["redisAddress"] == "redis-master.redis.svc.cluster.local:6379"
    assert options["redisPassword"]["valueFrom"]["secretKeyRef"] == {
        "name": "redis-password", "key": "password"}
    # a RayService leaves the namespace to KubeRay (each cluster's UID): an upgrade's new
    # cluster must not read the old cluster's tables
    assert "externalStorageNamespace" not in options
    (cluster,) = [r for r in charts["cpu-raycluster-gcs-ft-values.yaml"]
                  if r["kind"] == "RayCluster"]
    assert cluster["spec"]["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis://redis.default.svc.cluster.local:6379",
        "externalStorageNamespace": "radixray-cpu"}
    # off by default, and refused without an address
    for resources in (charts["gpu-values.yaml"], charts["cpu-raycluster-values.yaml"]):
        (ray,) = [r for r in resources if kube.is_ray_resource(r)]
        assert "gcsFaultToleranceOptions" not in kube.cluster_spec(ray)
    out = _run(helm, "template", "radixray", str(_chart(kube)),
               "--set", "gcsFaultTolerance.enabled=true")
    assert out.returncode != 0 and "redisAddress" in out.stderr


def test_values_reach_both_kinds(helm: str, kube: Any) -> None:
    sets = ["--set", "model=/models/qwen", "--set", "workers=6", "--set", "policy=cache_aware",
            "--set", "routerReplicas=2", "--set", "nameOverride=llm"]
    service = _template(helm, kube, *sets)
    cluster = _template(helm, kube, *sets, "--set", "kind=RayCluster")
    (rs,) = kube.of_kind(service, "RayService")
    args = kube.serve_config(rs)["applications"][0]["args"]
    assert (args["model"], args["workers"], args["policy"], args["router_replicas"]) == (
        "/models/qwen", 6, "cache_aware", 2)
    (rc,) = kube.of_kind(cluster, "RayCluster")
    argv = kube.head_serve_argv(rc)
    for flag, value in (("--model", "/models/qwen"), ("--workers", "6"),
                        ("--policy", "cache_aware"), ("--routers", "2")):
        assert argv[argv.index(flag) + 1] == value
    assert rc["metadata"]["name"] == "llm"
    (svc,) = kube.of_kind(cluster, "Service")
    assert svc["metadata"]["name"] == "llm-router"
    assert svc["spec"]["selector"]["ray.io/cluster"] == "llm"
    assert {m["metadata"]["name"] for m in kube.of_kind(cluster, "ConfigMap")} == {
        "llm-grafana-dashboard"}


def test_monitoring_can_be_left_out(helm: str, kube: Any) -> None:
    resources = _template(helm, kube, "--set", "monitoring.podMonitor.enabled=false",
                          "--set", "monitoring.grafanaDashboard.enabled=false")
    assert [r["kind"] for r in resources] == ["RayService"]


def test_values_schema_enums_are_the_code_s(kube: Any) -> None:
    import json

    schema = json.loads((_chart(kube) / "values.schema.json").read_text())["properties"]
    policies = kube.import_or_skip("router.routing.policies")
    assert set(schema["policy"]["enum"]) == set(policies.POLICY_NAMES)
    import argparse

    cli = kube.import_or_skip("cluster.cli")
    (subparsers,) = [a for a in cli.build_parser()._actions
                     if isinstance(a, argparse._SubParsersAction)]
    serve = subparsers.choices["serve"]
    choices = {opt: a.choices for a in serve._actions for opt in a.option_strings}
    assert set(schema["engine"]["enum"]) == set(choices["--engine"])
    assert set(schema["device"]["enum"]) == set(choices["--device"])

def test_values_outside_the_schema_are_refused(helm: str, kube: Any) -> None:
    for bad in ("engine=sglang", "policy=fastest", "kind=Deployment", "workers=0"):
        out = _run(helm, "template", "radixray", str(_chart(kube)), "--set", bad)
        assert out.returncode != 0 and "schema" in out.stderr, (bad, out.stderr)
