"""Every overlay renders offline, and what it renders is valid and hangs together: Ray
resources against KubeRay's strict schemas, core kinds against Kubernetes' own, and the
cross-references between them (Service -> head pod, PodMonitor -> ports, GPUs -> knobs)."""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
import pytest
import yaml

K8S_VERSION = "1.30.0"  # the oldest Kubernetes release these manifests promise to work on
RAY_KINDS = {"RayService", "RayCluster"}


def _ray_resource(kube: Any, resources: list) -> dict[str, Any]:
    found = [r for r in resources if r.get("kind") in RAY_KINDS]
    assert len(found) == 1, [r["kind"] for r in found]
    return found[0]


def test_overlays_exist(kube: Any) -> None:
    assert {"cpu", "gpu"} <= set(kube.OVERLAYS)


def test_overlay_renders_the_expected_kinds(overlay: str, rendered: dict, kube: Any) -> None:
    kinds = sorted(r["kind"] for r in rendered[overlay])
    expected = {"PodMonitor", "ConfigMap"}
    expected |= {"RayCluster", "Service"} if "raycluster" in overlay else {"RayService"}
    assert expected <= set(kinds), kinds
    names = [(r["kind"], r["metadata"]["name"]) for r in rendered[overlay]]
    assert len(names) == len(set(names)), names


def test_ray_resources_match_the_kuberay_crds(
    overlay: str, rendered: dict, kube: Any, crd_validator: Any
) -> None:
    ray = [r for r in rendered[overlay] if kube.is_ray_resource(r)]
    assert ray
    for resource in ray:
        assert crd_validator.errors(resource) == [], resource["kind"]


def test_core_kinds_match_the_kubernetes_schemas(overlay: str, rendered: dict) -> None:
    core = [r for r in rendered[overlay] if r["apiVersion"] in ("v1", "apps/v1")]
    assert core
    for resource in core:
        kubernetes_validate.validate(resource, K8S_VERSION, strict=True)


def test_a_misspelled_core_field_fails(rendered: dict) -> None:
    service = next(r for rs in rendered.values() for r in rs if r["kind"] == "Service")
    bad = {**service, "spec": {**service["spec"], "selecter": service["spec"]["selector"]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_every_container_runs_the_overlay_image(overlay: str, rendered: dict, kube: Any) -> None:
    ray = _ray_resource(kube, rendered[overlay])
    tag = "cuda" if overlay.startswith("gpu") else "cpu"
    for template in kube.pod_templates(ray):
        for container in template["spec"]["containers"]:
            assert container["image"].endswith(f"radixray:{tag}"), container["image"]


def test_autoscaling_is_on_and_bounded(overlay: str, rendered: dict, kube: Any) -> None:
    spec = kube.cluster_spec(_ray_resource(kube, rendered[overlay]))
    assert spec["enableInTreeAutoscaling"] is True
    for group in spec["workerGroupSpecs"]:
        assert 0 <= group["minReplicas"] <= group.get("replicas", 0) <= group["maxReplicas"]


def test_head_offers_ray_no_cpu_or_gpu(overlay: str, rendered: dict, kube: Any) -> None:
    # so that every worker actor lands on a worker pod and the head keeps to the router
    params = kube.cluster_spec(_ray_resource(kube, rendered[overlay]))["headGroupSpec"]
    assert params["rayStartParams"].get("num-cpus") == "0"
    assert params["rayStartParams"].get("num-gpus") == "0"


def _gpus(container: dict[str, Any]) -> int:
    return int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))


def test_gpu_overlays_request_gpus_and_cpu_overlays_none(
    overlay: str, rendered: dict, kube: Any
) -> None:
    spec = kube.cluster_spec(_ray_resource(kube, rendered[overlay]))
    head = spec["headGroupSpec"]["template"]["spec"]["containers"]
    workers = [c for g in spec["workerGroupSpecs"] for c in g["template"]["spec"]["containers"]]
    assert all(_gpus(c) == 0 for c in head)
    if overlay.startswith("gpu"):
        assert all(_gpus(c) >= 1 for c in workers)
        for container in workers:
            resources = container["resources"]
            assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]
    else:
        assert all(_gpus(c) == 0 for c in workers)


def test_rayservice_upgrades_with_zero_downtime(rendered: dict, kube: Any) -> None:
    services = [r for rs in rendered.values() for r in kube.of_kind(rs, "RayService")]
    assert services
    for service in services:
        strategy = service["spec"]["upgradeStrategy"]["type"]
        assert strategy in ("NewCluster", "NewClusterWithIncrementalUpgrade")


def _unknown_serve_keys(config: dict[str, Any]) -> list[str]:
    """Keys Ray Serve's config schema does not define (it ignores them silently)."""
    from ray.serve import schema

    def unknown(values: dict[str, Any], model: Any, where: str) -> list[str]:
        return [f"{where}.{k}" for k in values if k not in model.model_fields]

    found = unknown(config, schema.ServeDeploySchema, "")
    found += unknown(config.get("http_options", {}), schema.HTTPOptionsSchema, "http_options")
    for app in config.get("applications", []):
        found += unknown(app, schema.ServeApplicationSchema, "applications[]")
        for deployment in app.get("deployments", []):
            found += unknown(deployment, schema.DeploymentSchema, "deployments[]")
            options = deployment.get("ray_actor_options", {})
            found += unknown(options, schema.RayActorOptionsSchema, "ray_actor_options")
    return found


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray's own pydantic models
def test_serve_config_is_a_valid_ray_serve_config(rendered: dict, kube: Any) -> None:
    from ray.serve.schema import ServeDeploySchema

    for service in (r for rs in rendered.values() for r in kube.of_kind(rs, "RayService")):
        assert _unknown_serve_keys(kube.serve_config(service)) == []
        config = ServeDeploySchema.model_validate(kube.serve_config(service))
        (app,) = config.applications
        assert app.import_path == "cluster.serve_app:build_app"
        assert app.route_prefix == "/"
        assert config.http_options.port == 8000


def test_api_and_admin_keys_come_from_secrets(overlay: str, rendered: dict, kube: Any) -> None:
    head = kube.head_container(_ray_resource(kube, rendered[overlay]))
    env = {e["name"]: e for e in head.get("env", [])}
    for name, secret, key in (("RADIXRAY_API_KEY", "radixray-api-key", "api-key"),
                              ("RADIXRAY_ADMIN_KEY", "radixray-admin-key", "admin-key")):
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret and ref["key"] == key
        assert ref["optional"] is (not overlay.startswith("gpu"))  # production requires keys


def _port_names(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def test_router_service_reaches_the_head_on_8000(rendered: dict, kube: Any) -> None:
    # (for a RayService, KubeRay creates the `<name>-serve-svc` Service itself)
    clusters = 0
    for resources in rendered.values():
        for cluster in kube.of_kind(resources, "RayCluster"):
            clusters += 1
            (service,) = kube.of_kind(resources, "Service")
            assert service["spec"]["selector"] == {
                "ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"
            }
            (port,) = service["spec"]["ports"]
            assert port["port"] == 8000
            assert _port_names(kube.head_container(cluster))[port["targetPort"]] == 8000
            assert "--port 8000" in " ".join(kube.head_container(cluster)["args"])
    assert clusters


def test_pod_monitor_scrapes_the_router(overlay: str, rendered: dict, kube: Any) -> None:
    ray = _ray_resource(kube, rendered[overlay])
    (monitor,) = kube.of_kind(rendered[overlay], "PodMonitor")
    head_template = next(kube.pod_templates(ray))
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= head_template["metadata"]["labels"].items()
    ports = _port_names(kube.head_container(ray))
    endpoints = {e["port"]: e["path"] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert endpoints["serve"] == "/metrics" and ports["serve"] == 8000
    assert set(endpoints) <= set(ports)


def test_grafana_dashboard_is_provisioned(overlay: str, rendered: dict, kube: Any) -> None:
    maps = [m for m in kube.of_kind(rendered[overlay], "ConfigMap")
            if m["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    assert len(maps) == 1
    (text,) = maps[0]["data"].values()
    dashboard = yaml.safe_load(text)  # JSON is YAML
    assert dashboard["panels"]


def test_ray_version_matches_the_images(rendered: dict, kube: Any) -> None:
    versions = set()
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = (kube.K8S / dockerfile).read_text()
        versions |= set(re.findall(r"^ARG RAY_VERSION=(\S+)$", text, re.M))
    assert len(versions) == 1, versions
    for resources in rendered.values():
        for ray in (r for r in resources if r.get("kind") in RAY_KINDS):
            assert kube.cluster_spec(ray)["rayVersion"] in versions


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_misspelled_serve_config_key_is_caught() -> None:
    config = {"applications": [{"name": "a", "import_path": "m:f", "route_prefx": "/",
                                "deployments": [{"name": "D", "ray_actor_option": {}}]}]}
    assert _unknown_serve_keys(config) == ["applications[].route_prefx",
                                           "deployments[].ray_actor_option"]
