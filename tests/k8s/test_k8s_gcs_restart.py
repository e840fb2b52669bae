"""Head-node GCS loss with GCS fault tolerance (the chart's `gcsFaultTolerance`): Ray's GCS keeps
its tables in an external Redis; killing the GCS process under load and starting it again loses
no request, keeps every actor (the same worker, fleet and router processes, with their caches),
and the fleet still takes orders through the new GCS (a worker added afterwards serves).

Runs bench/gcs_restart.py once, short, on a private redis-server and a private Ray (tiny model,
CPU workers). Needs `redis-server` (k8s/host-setup.sh installs it): skips without it, fails in CI.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.ray


def test_gcs_restart_with_redis_loses_nothing(kube: Any, tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        kube.skip_or_fail("redis-server is not installed (apt install redis-server; "
                          "k8s/host-setup.sh does it)")
    out = tmp_path / "gcs.json"
    env = dict(os.environ, PYTHONPATH=str(kube.REPO))
    env.setdefault("RAY_AUTH_MODE", "disabled")
    run = subprocess.run(
        [sys.executable, str(kube.REPO / "bench" / "gcs_restart.py"), "--workers", "1",
         "--clients", "2", "--warm", "5", "--down", "3", "--after", "6", "--window", "2",
         "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=480,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (result,) = json.loads(out.read_text())["runs"]
    assert result["requests_after_kill"] > 0
    assert result["requests_lost"] == 0, result["errors"]
    assert result["failed_before_kill"] == 0
    # the same processes: no actor was restarted, so no cache was lost
    assert result["actor_pids_after"] == result["actor_pids_before"]
    assert len(result["actor_pids_before"]["WorkerActor"]) == 1
    assert result["workers_kept"] == result["workers_before"] == ["worker-0"]
    assert result["hit_rate_after"] > 0.5  # shared prefixes still hit after the restart
    # a new actor, placed through the new GCS, joins the fleet and the router
    assert result["worker_added_after_restart"] == ["worker-1"]
