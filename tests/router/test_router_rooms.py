"""The rooms of `router/` and the direction of their imports: `api` -> `router.py` ->
`dispatch.py` -> `backends` -> `routing`, with `config`, `metrics`, `errors`, `tokenizer` and
`job` as leaves that import at most `routing`. The simulator (`cluster.sim`) runs `routing`, so
`routing` brings in no transport (aiohttp, ZMQ, FastAPI, Ray); and no module of `router/` takes
part in an import cycle. Imports under `if TYPE_CHECKING:` do not run and do not count."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRANSPORT = ("aiohttp", "zmq", "fastapi", "ray")

# room -> the modules of `router` it may import at run time (a name and everything below it)
# (bottom up: routing, the leaves, backends, dispatch.py, router.py, api)
LEAVES = ("router.config", "router.metrics", "router.errors", "router.tokenizer", "router.job")
ROOMS = {
    "router.routing": ("router.routing",),
    **{leaf: ("router.routing",) for leaf in LEAVES},
    "router.backends": ("router.backends", "router.routing", *LEAVES),
    "router.dispatch": ("router.backends", "router.routing", *LEAVES),
    "router.router": ("router.dispatch", "router.backends", "router.routing", *LEAVES),
}


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


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that the file imports when it runs (function-local imports
    count; `if TYPE_CHECKING:` blocks do not). `from a import b` names `a.b` when that is a
    module, else `a`."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            subs = {f"{node.module}.{alias.name}" for alias in node.names}
            found.update(subs & modules or {node.module})
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found & modules


def router_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of `router` it imports at run time."""
    files = {
        ".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): f
        for f in sorted((root / "router").rglob("*.py"))
    }
    return {name: runtime_imports(f, set(files)) - {name} for name, f in files.items()}


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` (its modules in order, the first repeated last), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (found := walk(start)):
            return found
    return []


def test_no_import_cycle_among_router_modules():
    graph = router_graph()
    assert "router.routing.core" in graph and "router.api.app" in graph
    assert cycle(graph) == []


def test_rooms_import_only_downwards():
    offenders = {
        name: sorted(m for m in imports if not any(m == a or m.startswith(a + ".")
                                                   for a in allowed))
        for room, allowed in ROOMS.items()
        for name, imports in router_graph().items()
        if name == room or name.startswith(room + ".")
    }
    assert {n: m for n, m in offenders.items() if m} == {}


def test_the_checks_see_a_cycle_and_an_upward_import(tmp_path):
    pkg = tmp_path / "router" / "routing"
    pkg.mkdir(parents=True)
    (tmp_path / "router" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "registry.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from router.backends import Backend\n"
        "if TYPE_CHECKING:\n"
        "    from router.api import app\n"
    )
    (tmp_path / "router" / "backends.py").write_text(
        "def f():\n    from router.routing.registry import WorkerState\n"
    )
    (tmp_path / "router" / "api.py").write_text("")
    graph = router_graph(tmp_path)
    assert graph["router.routing.registry"] == {"router.backends"}  # the typing one is left
    assert cycle(graph) == ["router.backends", "router.routing.registry", "router.backends"]
