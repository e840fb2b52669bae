"""The chaos soak, short: mixed traffic against a real `radixray serve --workers 2 --routers 2`
while a router replica, the fleet actor and a worker are SIGKILLed on a seeded schedule
(`bench/chaos.py`, which states the promises it checks and exits 1 when one is broken)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_chaos_soak_keeps_every_promise(tmp_path):
    out = tmp_path / "chaos.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "chaos.py"), "--seconds", "38", "--seed", "7",
         "--first-fault", "4", "--gap-min", "9", "--gap-max", "11", "--json", str(out)],
        capture_output=True, text=True, timeout=540, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {f["kind"] for f in report["faults"]} == {"worker", "router", "fleet"}
    assert report["failures"] == [] and report["final_pass"] == "ok"
    served = {k.split("/")[0] for k, n in report["outcomes"].items() if k.endswith("/ok") and n}
    assert served >= {"chat", "completion", "stream", "session", "slow"}
    assert report["outcomes"].get("bad/rejected", 0) > 0
