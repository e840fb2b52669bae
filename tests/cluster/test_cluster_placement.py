"""Placement that says what is wrong: on a local Ray with fewer CPUs than CPU workers each worker
reserves a share of them, and bundles that cannot be placed fail at once (or, on a Ray that may
grow, are waited for with a message), naming the resource, the request and what is free."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import ray

from cluster.cli import main as cli_main
from cluster.config import API_KEY_ENV, ClusterConfig
from cluster.launcher import Launcher
from cluster.placement import Placement, PlacementError

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_share_fits_every_worker_and_an_explicit_value_wins():
    config = ClusterConfig()
    assert config.worker_cpus(3, local_cpus=2) == 0.6666  # 0.6667 x 3 = 2.0001 would not fit
    assert config.worker_cpus(2, local_cpus=2) == 1.0
    assert config.worker_cpus(3, local_cpus=None) == 1.0  # a joined Ray: no share
    for cores in range(1, 17):
        for count in range(1, 65):
            share = config.worker_cpus(count, cores)
            assert share * count <= cores + 1e-9 and share <= 1.0
            assert share > min(1.0, cores / count) - 1e-4  # no more than Ray's unit is lost
    assert ClusterConfig(cpus_per_worker=4).worker_cpus(3, local_cpus=2) == 4
    assert ClusterConfig().bundle("cpu", 0.6666) == {"CPU": 0.6666}
    with pytest.raises(ValueError):
        ClusterConfig(cpus_per_worker=0)


@pytest.mark.ray
def test_three_workers_on_a_two_cpu_local_ray_all_serve(helpers, capsys):
    assert not ray.is_initialized()  # the launcher's own path: it starts the local Ray
    lines: list[str] = []
    config = ClusterConfig(model="tiny", port=helpers.free_port(), kv_tokens=4096, workers=3,
                           num_cpus=2, policy="round_robin", ready_timeout_s=300)
    launcher = Launcher(config, echo=lines.append)
    try:
        url = launcher.start()
        assert any("each reserves 0.6666 CPU" in line for line in lines), lines
        assert sorted(launcher.workers()) == ["worker-0", "worker-1", "worker-2"]
        for worker in launcher.workers().values():
            assert worker.slot.group.bundle_specs[worker.slot.bundle_index] == {"CPU": 0.6666}

        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        served = set()
        for i in range(3):
            raw = client.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": f"Hello {i}"}],
                max_tokens=4, temperature=0)
            assert raw.parse().choices[0].finish_reason in ("stop", "length")
            served.add(raw.headers["x-radixray-worker"])
        assert served == set(launcher.workers())
        helpers.assert_idle_accounting(url)

        # A fourth worker does not fit (0.0002 CPU free): said within seconds, not in 900 s.
        t0 = time.monotonic()
        assert cli_main(["workers", "add", "--url", url]) == 1
        err = capsys.readouterr().err
        assert time.monotonic() - t0 < 30
        assert "CPU: 1 x 0.6666 = 0.6666 requested, 0.0002 free of 2" in err, err
        assert "NO_RESOURCES" in err and "cannot grow" in err
        assert len(launcher.workers()) == 3 and ray.get(launcher.fleet.groups.remote()) == 1

        # GPUs on this CPU-only Ray: infeasible, named. Fixed: at once; may grow: a notice,
        # then the timeout's error; either way the pending group is removed.
        with pytest.raises(PlacementError, match=r"\(INFEASIBLE\): GPU: 1 per worker requested, "
                           r"but no node has that much \(largest 0; cluster 0 free of 0\)"):
            asyncio.run(Placement({"GPU": 1}, fixed=True).reserve(2, timeout_s=60))
        notices: list[str] = []
        growable = Placement({"GPU": 1}, notify=notices.append)
        with pytest.raises(PlacementError, match=r"GPU: 1 per worker.*gave up after 5s"):
            asyncio.run(growable.reserve(1, timeout_s=5))
        assert len(notices) == 1 and "(2s left): cannot place 1 worker(s)" in notices[0], notices
        assert not growable._groups and growable.waiting == 0
        assert ray.available_resources().get("CPU") == pytest.approx(0.0002)

        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "still serving?"}], max_tokens=4)
        assert raw.headers["x-radixray-worker"] in launcher.workers()
    finally:
        launcher.stop()
    assert not ray.is_initialized()


@pytest.mark.ray
def test_serve_with_workers_too_big_for_the_local_ray_exits_at_once_naming_cpu(helpers):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop(API_KEY_ENV, None)
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "serve", "--workers", "3", "--num-cpus", "2",
         "--cpus-per-worker", "4", "--port", str(helpers.free_port()), "--kv-tokens", "4096"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )
    out = done.stdout + done.stderr
    print(f"radixray serve failed after {time.monotonic() - t0:.1f}s")
    assert done.returncode == 1, out
    assert "cannot place 3 worker(s) of {'CPU': 4.0} (INFEASIBLE)" in out, out
    assert "CPU: 4 per worker requested, but no node has that much (largest 2" in out, out
    assert "ready after" not in out  # no "0/3 ready" heartbeat
