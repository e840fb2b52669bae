"""What the manifests name exists in the code: the Serve import path, its deployments and its
`args`, the `radixray serve` flags of the RayCluster head (and that its shell command runs),
the routing policies, the console script, and the built-in models."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

# The knobs every deployment sets (DESIGN.md / BRIEF.md); the API key comes from a Secret.
KNOBS = ("model", "workers", "gpus_per_worker", "device", "policy", "kv_tokens", "page_size")


def _services(rendered: dict, kube: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(o, r) for o, rs in rendered.items() for r in kube.of_kind(rs, "RayService")]


def _clusters(rendered: dict, kube: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(o, r) for o, rs in rendered.items() for r in kube.of_kind(rs, "RayCluster")]


def _app(kube: Any, service: dict[str, Any]) -> dict[str, Any]:
    (app,) = kube.serve_config(service)["applications"]
    return app


def test_serve_import_path_builds_an_application(rendered: dict, kube: Any) -> None:
    from ray import serve

    for _, service in _services(rendered, kube):
        app = _app(kube, service)
        module_name, attr = app["import_path"].split(":")
        module = kube.import_or_skip(module_name)
        application = getattr(module, attr)(app["args"])  # binds lazily: no Ray needed
        assert isinstance(application, serve.Application)


def test_a_renamed_module_of_ours_fails_where_a_missing_dependency_skips(kube: Any) -> None:
    # a manifest naming `cluster.serve_app` after a rename must fail its tests, not skip them
    with pytest.raises(ModuleNotFoundError):
        kube.import_or_skip("cluster.serve_app_renamed")
    with pytest.raises(pytest.skip.Exception):
        kube.import_or_skip("radixray_no_such_dependency")


def test_serve_deployment_overrides_name_real_deployments(rendered: dict, kube: Any) -> None:
    from ray import serve

    for _, service in _services(rendered, kube):
        app = _app(kube, service)
        module = kube.import_or_skip(app["import_path"].split(":")[0])
        names = {d.name for d in vars(module).values() if isinstance(d, serve.Deployment)}
        for deployment in app.get("deployments", []):
            assert deployment["name"] in names, (deployment["name"], names)


def test_serve_args_are_the_serve_flags_in_snake_case(rendered: dict, kube: Any) -> None:
    config = kube.import_or_skip("cluster.config")
    for overlay, service in _services(rendered, kube):
        args = _app(kube, service)["args"]
        assert set(KNOBS) <= set(args), (overlay, sorted(args))
        assert "api_key" not in args, "the API key belongs in a Secret, not in the manifest"
        config.ClusterConfig.from_dict(args)  # unknown keys or bad values raise


def _parse_head_command(kube: Any, cluster: dict[str, Any]) -> Any:
    cli = kube.import_or_skip("cluster.cli")
    argv = kube.head_serve_argv(cluster)
    parser = cli.build_parser()
    try:
        return parser.parse_args(["serve", *argv])
    except SystemExit:
        pytest.fail(f"`radixray serve {' '.join(argv)}` does not parse (see stderr)")


def test_raycluster_head_runs_radixray_serve_with_real_flags(rendered: dict, kube: Any) -> None:
    cli = kube.import_or_skip("cluster.cli")
    config = kube.import_or_skip("cluster.config")
    subparsers = next(a for a in cli.build_parser()._actions if a.dest == "command")
    serve_parser = subparsers.choices["serve"]
    serve_help = serve_parser.format_help()
    # exact option strings: argparse would also accept an abbreviation such as --kv-token
    options = {s for action in serve_parser._actions for s in action.option_strings}
    clusters = _clusters(rendered, kube)
    assert clusters
    for _, cluster in clusters:
        argv = kube.head_serve_argv(cluster)
        for flag in (w.split("=")[0] for w in argv if w.startswith("--")):
            assert flag in options and flag in serve_help, f"{flag}: no such `radixray serve` flag"
        ns = _parse_head_command(kube, cluster)
        assert ns.address == "auto" and ns.host == "0.0.0.0"
        config.ClusterConfig.from_args(ns)


def _knobs_of_service(kube: Any, service: dict[str, Any]) -> dict[str, Any]:
    return {k: _app(kube, service)["args"].get(k) for k in KNOBS}


def test_rayservice_and_raycluster_overlays_agree(rendered: dict, kube: Any) -> None:
    services = {o: _knobs_of_service(kube, s) for o, s in _services(rendered, kube)}
    for overlay, cluster in _clusters(rendered, kube):
        twin = overlay.removesuffix("-raycluster")
        if twin not in services:
            continue
        ns = vars(_parse_head_command(kube, cluster))
        for knob, value in services[twin].items():
            assert ns[knob] == value, (overlay, knob, ns[knob], value)


def test_knobs_fit_the_worker_pods(rendered: dict, kube: Any) -> None:
    for overlay, service in _services(rendered, kube):
        knobs = _knobs_of_service(kube, service)
        groups = kube.cluster_spec(service)["workerGroupSpecs"]
        if knobs["device"] == "cuda":
            per_pod = max(
                int(c["resources"]["limits"].get("nvidia.com/gpu", 0))
                for g in groups for c in g["template"]["spec"]["containers"]
            )
            assert per_pod % knobs["gpus_per_worker"] == 0, overlay
            capacity = sum(g["maxReplicas"] for g in groups) * per_pod // knobs["gpus_per_worker"]
            assert knobs["workers"] <= capacity, overlay
        else:
            assert overlay.startswith("cpu")


def test_policies_exist(rendered: dict, kube: Any) -> None:
    policies = kube.import_or_skip("router.routing.policies")
    names = set(policies.POLICY_NAMES)
    for _, service in _services(rendered, kube):
        assert _app(kube, service)["args"]["policy"] in names
    for _, cluster in _clusters(rendered, kube):
        assert _parse_head_command(kube, cluster).policy in names


def test_console_script_the_head_runs_exists(kube: Any) -> None:
    scripts = tomllib.loads((kube.REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module_name, attr = scripts["radixray"].split(":")
    assert callable(getattr(kube.import_or_skip(module_name), attr))


def test_head_command_starts_ray_then_execs_the_router(
    rendered: dict, kube: Any, tmp_path: Any
) -> None:
    """Runs each RayCluster head's shell command with stand-ins for `ray` and `radixray`."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    for name in ("ray", "radixray"):
        stub = tmp_path / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >> "$CALLS"\n')
        stub.chmod(0o755)
    for overlay, cluster in _clusters(rendered, kube):
        calls = tmp_path / f"{overlay}.calls"
        head = kube.head_container(cluster)
        assert head["command"][:2] == ["/bin/bash", "-lc"]
        env = {
            "PATH": f"{tmp_path}:{os.environ['PATH']}", "CALLS": str(calls),
            "KUBERAY_GEN_RAY_START_CMD": "ray start --head --block --num-cpus=0 "
                                         "--resources='{\"a\": 1}'",
        }
        subprocess.run([bash, "-c", *head["command"][2:], *head["args"]], env=env,
                       check=True, capture_output=True, timeout=30)
        ray_call, serve_call = calls.read_text().splitlines()
        assert ray_call == 'ray start --head --num-cpus=0 --resources={"a": 1}'
        assert serve_call == "radixray serve " + " ".join(kube.head_serve_argv(cluster))


def _baked_models(kube: Any, dockerfile: str) -> set[str]:
    args = dict(
        a.split("=", 1) for i, a in kube.dockerfile_instructions(dockerfile)
        if i == "ARG" and "=" in a
    )
    return set(args["BUILTIN_MODELS"].strip('"').split())


def test_models_are_built_in_and_baked_into_the_image(rendered: dict, kube: Any) -> None:
    builtin = kube.import_or_skip("worker.loader.builtin")
    models = {o: _knobs_of_service(kube, s)["model"] for o, s in _services(rendered, kube)}
    models |= {o: _parse_head_command(kube, c).model for o, c in _clusters(rendered, kube)}
    for overlay, model in models.items():
        if model.startswith("/"):
            continue  # an HF model directory mounted into the pods
        assert model in builtin.BUILTIN_MODELS, (overlay, model)
        dockerfile = "Dockerfile.cuda" if overlay.startswith("gpu") else "Dockerfile.cpu"
        assert model in _baked_models(kube, dockerfile), (overlay, model, dockerfile)
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.cuda"):
        assert _baked_models(kube, dockerfile) <= set(builtin.BUILTIN_MODELS)
