"""What the product packages import (DESIGN.md, Layout): imports point down only, `mem_cache`
<- `worker` <- `cluster`, `router` takes `mem_cache` and `worker.protocol` alone, nothing imports
`cluster`, and nothing imports the test-only `testing` package (it is not shipped). Every import
statement counts, type-only and function-local ones too."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("mem_cache", "worker", "router", "cluster", "testing")
# package -> the modules of ours it may import (a name and everything below it)
ALLOWED = {
    "mem_cache": ("mem_cache",),
    "worker": ("mem_cache", "worker"),
    "router": ("mem_cache", "worker.protocol", "router"),
    "cluster": ("mem_cache", "worker", "router", "cluster"),
}


def imported_modules(path: Path) -> set[str]:
    """Every absolute module an `import` or `from ... import` in the file names."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def forbidden(package: str, module: str) -> bool:
    """True when `module` is one of ours that `package` may not import."""
    if module.split(".")[0] not in OURS:
        return False  # the standard library or a dependency
    return not any(module == a or module.startswith(a + ".") for a in ALLOWED[package])


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_down(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    offenders = {
        str(f.relative_to(ROOT)): sorted(m for m in imported_modules(f) if forbidden(package, m))
        for f in files
    }
    assert {f: m for f, m in offenders.items() if m} == {}


def test_the_check_sees_what_it_must_refuse(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "import testing\n"
        "if TYPE_CHECKING:\n"
        "    from worker.engine import Engine\n"
        "def f():\n"
        "    from testing.fake_worker import serve\n"
    )
    found = imported_modules(sample)
    assert found == {"typing", "testing", "worker.engine", "testing.fake_worker"}
    assert [m for m in sorted(found) if forbidden("router", m)] == [
        "testing", "testing.fake_worker", "worker.engine"
    ]
    assert not forbidden("router", "worker.protocol") and not forbidden("router", "typing")
    assert forbidden("worker", "cluster.config") and forbidden("mem_cache", "worker")


def module_graph(package: str) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports (every import statement counts;
    `from pkg.mod import name` names `pkg.mod`, or `pkg.mod.name` where that is a module)."""
    files = {
        ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): f
        for f in (ROOT / package).rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets.add(node.module)
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[module] = {t for t in targets if t in files and t != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [node])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [])):
            return found
    return None


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_import_cycle_inside_a_package(package):
    assert find_cycle(module_graph(package)) is None


def test_the_cycle_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# worker's rooms, top to bottom: the engine loop (worker/*.py), then loader/ -> models/ ->
# attention/ -> kernels/. A module imports from its own room and the rooms below it only.
WORKER_ROOMS = ("worker", "worker.loader", "worker.models", "worker.attention", "worker.kernels")


def worker_room(module: str) -> int:
    """The depth of `module`'s room in `WORKER_ROOMS` (0: the engine loop at the top)."""
    inside = [i for i, r in enumerate(WORKER_ROOMS) if module == r or module.startswith(r + ".")]
    return max(inside)


def test_worker_rooms_import_down():
    graph = module_graph("worker")
    upward = {
        module: sorted(t for t in targets if worker_room(t) < worker_room(module))
        for module, targets in graph.items()
    }
    assert {m: t for m, t in upward.items() if t} == {}
    assert worker_room("worker.engine") == 0 and worker_room("worker.kernels.build") == 4
