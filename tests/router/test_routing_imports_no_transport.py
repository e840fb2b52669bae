"""The simulator (`cluster.sim`) runs `router.routing`, so `routing` brings in no transport
(aiohttp, ZMQ, FastAPI, Ray) when it is imported. The direction of the router's rooms and the
absence of import cycles are checked with the other packages' in tests/test_product_imports.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRANSPORT = ("aiohttp", "zmq", "fastapi", "ray")


def loaded_by(*modules: str) -> set[str]:
    """The top-level packages in `sys.modules` after a fresh interpreter imports `modules`."""
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "print(' '.join(sorted({n.split('.')[0] for n in sys.modules})))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120, check=True,
    )
    return set(out.stdout.split())


def test_routing_and_the_simulator_import_no_transport():
    loaded = loaded_by("router.routing.core", "cluster.sim", "cluster.sim.simulator",
                       "cluster.sim.routing")
    assert "router" in loaded and "cluster" in loaded
    assert sorted(loaded & set(TRANSPORT)) == []
