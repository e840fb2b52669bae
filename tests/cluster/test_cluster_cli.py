"""The `radixray` command: flags and config without Ray, then `radixray serve` as a real
subprocess (its own local Ray) answering the curl line it prints, and stopping cleanly."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from cluster import cli
from cluster.admin import admin_request
from cluster.cli import build_parser, curl_line
from cluster.config import API_KEY_ENV, ClusterConfig

SERVE_FLAGS = ("--model", "--workers", "--gpus-per-worker", "--device", "--host", "--port",
               "--admin-key", "--metrics-public", "--body-timeout", "--send-timeout",
               "--policy", "--kv-tokens", "--page-size", "--host-kv-tokens", "--host-policy",
               "--api-key", "--address", "--cost-config")


def test_serve_defaults_are_the_laptop_setup(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    config = ClusterConfig.from_args(build_parser().parse_args(["serve"]))
    assert (config.model, config.host, config.port, config.address) == (
        "smollm2-135m-instruct", "127.0.0.1", 8000, None)
    assert config.resolve_device(cluster_gpus=0) == "cpu"
    assert config.resolve_workers("cpu", 0) == 2
    assert config.bundle("cpu") == {"CPU": 1.0}


def test_serve_help_names_every_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in SERVE_FLAGS:
        assert flag in text


def test_flags_map_onto_the_config():
    args = build_parser().parse_args(
        ["serve", "--model", "small", "--workers", "3", "--gpus-per-worker", "2", "--port",
         "9001", "--policy", "round_robin", "--kv-tokens", "4096", "--page-size", "16",
         "--api-key", "k", "--address", "auto", "--device", "cuda"])
    config = ClusterConfig.from_args(args)
    assert (config.model, config.workers, config.port, config.policy, config.kv_tokens,
            config.page_size, config.api_key, config.address) == (
        "small", 3, 9001, "round_robin", 4096, 16, "k", "auto")
    assert config.bundle("cuda") == {"CPU": 1.0, "GPU": 2.0}
    assert config.resolve_workers("cuda", cluster_gpus=8) == 3


def test_cost_config_flag_reaches_the_routers_policy():
    from cluster.router_link import router_config
    from router.router import Router
    from worker.loader.builtin import builtin_model_path

    tiny = str(builtin_model_path("tiny"))
    args = build_parser().parse_args(
        ["serve", "--cost-config",
         '{"compute": {"idle_while_decoding": true, "idle_weight": 8}, "guard": null}'])
    cost = Router(router_config(ClusterConfig.from_args(args), tiny)).core.policy.config.cost
    assert (cost.compute.idle_while_decoding, cost.compute.idle_weight) == (True, 8)
    assert cost.guard is None
    default = Router(router_config(ClusterConfig(), tiny)).core.policy.config.cost
    assert (default.compute.idle_while_decoding, default.compute.idle_weight) == (False, 2.0)


def test_bad_cost_config_fails_before_anything_starts(capsys):
    for bad in ("[1]", "{not json"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--cost-config", bad])
        assert "--cost-config" in capsys.readouterr().err
    with pytest.raises(ValueError, match="idle_wieght"):
        ClusterConfig.from_dict({"cost_config": {"compute": {"idle_wieght": 8}}})
    with pytest.raises(ValueError, match="must be true or false"):
        ClusterConfig(cost_config={"compute": {"idle_while_decoding": "yes"}})
    with pytest.raises(ValueError, match="must be an object"):
        ClusterConfig(cost_config={"tail": 8})


def test_gpu_cluster_gets_one_worker_per_gpu_group():
    config = ClusterConfig(gpus_per_worker=2)
    assert config.resolve_device(cluster_gpus=8) == "cuda"
    assert config.resolve_workers("cuda", cluster_gpus=8) == 4


def test_api_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "secret")
    config = ClusterConfig()
    assert config.api_key == "secret"
    assert "Authorization: Bearer $RADIXRAY_API_KEY" in curl_line(config)


def test_serve_app_args_reject_unknown_keys():
    assert ClusterConfig.from_dict({"model": "tiny", "workers": 1}).workers == 1
    with pytest.raises(ValueError, match="modle"):
        ClusterConfig.from_dict({"modle": "tiny"})
    with pytest.raises(ValueError):
        ClusterConfig(device="tpu")


def test_workers_admin_commands_map_to_endpoints():
    parse = build_parser().parse_args
    assert admin_request(parse(["workers", "list"])) == ("GET", "/v1/workers", None)
    assert admin_request(parse(["workers", "add", "--count", "2"])) == (
        "POST", "/v1/workers", {"count": 2})
    assert admin_request(parse(["workers", "drain", "worker-1"]))[1] == "/v1/workers/worker-1/drain"
    assert admin_request(parse(["workers", "remove", "worker-1"]))[0] == "DELETE"
    with pytest.raises(SystemExit):
        admin_request(parse(["workers", "drain"]))


def _command() -> list[str]:
    exe = shutil.which("radixray")
    return [exe] if exe else [sys.executable, "-m", "cluster.cli"]


def _descendants(root: int) -> set[int]:
    """Every live process started (directly or not) by `root`."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.split("\n"):
        if line.strip():
            pid, ppid = map(int, line.split())
            children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.add(pid)
        except ProcessLookupError:
            pass
    return alive


class Serve:
    """`radixray serve` in a subprocess, its output collected line by line."""

    def __init__(self, port: int, *flags: str) -> None:
        env = dict(os.environ)
        env.pop(API_KEY_ENV, None)
        env.pop("RADIXRAY_ADMIN_KEY", None)
        self.proc = subprocess.Popen(
            [*_command(), "serve", "--model", "tiny", "--port", str(port), "--kv-tokens", "4096",
             "--num-cpus", "2", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True,  # its own process group, as a shell gives a foreground job
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for_line(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            assert time.monotonic() < deadline and self.proc.poll() is None, self.output()
            time.sleep(0.1)

    def output(self) -> str:
        return "".join(self.lines)


def test_host_policies_are_the_caches_and_a_typo_fails_at_the_command_line(capsys):
    from mem_cache.radix_host import WRITE_POLICIES

    assert cli.HOST_POLICIES == WRITE_POLICIES
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--host-policy", "write_thru"])
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_a_stop_signal_ignores_the_next_ones_until_cleanup_is_done():
    """A second SIGTERM/Ctrl-C landing inside the handler's `except` escaped `serve` uncaught
    and left it hanging in Ray's excepthook; the first signal now ignores the next ones."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(KeyboardInterrupt):
            cli._interrupt()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.mark.ray
def test_radixray_serve_answers_its_curl_line_and_stops_cleanly(helpers):
    port = helpers.free_port()
    t0 = time.monotonic()
    serve = Serve(port, "--api-key", "k", "--admin-key", "a")
    url = f"http://127.0.0.1:{port}"
    try:
        serve.wait_for_line("Press Ctrl-C", 240)
        curl = next(line.strip() for line in serve.lines if line.strip().startswith("curl "))
        body = json.loads(shlex.split(curl)[-1])
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k")
        answer = client.chat.completions.create(**body)
        print(f"radixray serve -> first answer: {time.monotonic() - t0:.1f}s")
        assert answer.choices[0].finish_reason in ("stop", "length")
        # the inference key does not remove a worker; the admin key lists them
        denied = httpx.delete(f"{url}/v1/workers/worker-0", headers={"Authorization": "Bearer k"})
        assert denied.status_code == 403 and denied.json()["error"]["code"] == "admin_forbidden"
        assert httpx.post(f"{url}/v1/workers", json={"count": 1}).status_code == 401
        rows = httpx.get(f"{url}/v1/workers", headers={"Authorization": "Bearer a"}).json()
        assert sorted(r["id"] for r in rows["data"]) == ["worker-0", "worker-1"]
        assert "warning" not in serve.output()  # on loopback, with both keys
        helpers.assert_idle_accounting(url)
        ray_processes = _descendants(serve.proc.pid)  # GCS, raylet, workers of its local Ray
        assert len(ray_processes) >= 3
    finally:
        serve.proc.send_signal(signal.SIGTERM)  # what docker stop and Kubernetes send
        code = serve.proc.wait(60)
    assert code == 0, serve.output()
    helpers.wait_for(lambda: not _alive(ray_processes), 30, "its Ray processes to exit")


@pytest.mark.ray
def test_ctrl_c_while_workers_load_stops_everything(helpers):
    serve = Serve(helpers.free_port())
    try:
        serve.wait_for_line("loading the model", 240)
        ray_processes = _descendants(serve.proc.pid)
        assert len(ray_processes) >= 3
    finally:
        # Ctrl-C in a terminal signals the whole foreground group: Ray's processes too
        os.killpg(serve.proc.pid, signal.SIGINT)
        code = serve.proc.wait(60)
    assert code == 0, serve.output()
    assert "Press Ctrl-C" not in serve.output()
    helpers.wait_for(lambda: not _alive(ray_processes), 30, "its Ray processes to exit")


def test_admin_key_and_deadlines_reach_the_router_config(monkeypatch):
    from cluster.config import ADMIN_KEY_ENV
    from cluster.router_link import router_config

    monkeypatch.setenv(ADMIN_KEY_ENV, "from-env")
    config = ClusterConfig.from_dict({"model": "tiny"})  # as the Serve app builds it
    assert config.admin_key == "from-env" and not config.metrics_public
    args = build_parser().parse_args(
        ["serve", "--admin-key", "a", "--api-key", "k", "--metrics-public", "--body-timeout", "5",
         "--send-timeout", "7"])
    routed = router_config(ClusterConfig.from_args(args), "dir")
    assert (routed.api_key, routed.admin_key, routed.metrics_public) == ("k", "a", True)
    assert (routed.body_timeout_s, routed.send_timeout_s) == (5.0, 7.0)
    workers = build_parser().parse_args(["workers", "list", "--admin-key", "a"])
    assert workers.admin_key == "a"


def test_serve_warns_when_it_listens_beyond_loopback_without_keys(monkeypatch):
    from cluster.config import ADMIN_KEY_ENV

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    open_to_all = ClusterConfig(host="0.0.0.0").exposure_warnings()
    assert len(open_to_all) == 2
    assert "no API key" in open_to_all[0] and "--api-key" in open_to_all[0]
    assert "clients on this host only" in open_to_all[1] and "--admin-key" in open_to_all[1]
    assert len(ClusterConfig(host="0.0.0.0", api_key="k").exposure_warnings()) == 1
    assert ClusterConfig(host="0.0.0.0", api_key="k", admin_key="a").exposure_warnings() == []
    assert ClusterConfig(host="127.0.0.1").exposure_warnings() == []
