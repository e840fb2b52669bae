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


def _type_checking(node: ast.AST) -> bool:
    """Whether `node` is an `if TYPE_CHECKING:` block (its imports never run)."""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_graph(
    package: str, runtime_only: bool = False, root: Path = ROOT
) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports (every import statement counts,
    or with `runtime_only` all but those under `if TYPE_CHECKING:`; `from pkg.mod import name`
    names `pkg.mod`, or `pkg.mod.name` where that is a module)."""
    files = {
        ".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): f
        for f in (root / package).rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets: set[str] = set()

        def visit(node: ast.AST, targets: set[str] = targets) -> None:
            if runtime_only and _type_checking(node):
                for child in node.orelse:
                    visit(child)
                return
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets.add(node.module)
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)
            for child in ast.iter_child_nodes(node):
                visit(child)

        visit(ast.parse(path.read_text(), str(path)))
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


# router's rooms, bottom up: routing/ (no transport: the simulator runs it), the leaves,
# backends/, dispatch.py, router.py, and api/ on top. A room -> the modules it may import at
# run time (a name and everything below it); type-only imports do not run and do not count.
ROUTER_LEAVES = ("router.config", "router.metrics", "router.errors", "router.tokenizer",
                 "router.job")
ROUTER_ROOMS = {
    "router.routing": ("router.routing",),
    **{leaf: ("router.routing",) for leaf in ROUTER_LEAVES},
    "router.backends": ("router.backends", "router.routing", *ROUTER_LEAVES),
    "router.dispatch": ("router.backends", "router.routing", *ROUTER_LEAVES),
    "router.router": ("router.dispatch", "router.backends", "router.routing", *ROUTER_LEAVES),
}


def router_upward(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """module -> the modules it imports that its room may not."""
    upward = {
        name: sorted(m for m in imports if not any(m == a or m.startswith(a + ".")
                                                   for a in allowed))
        for room, allowed in ROUTER_ROOMS.items()
        for name, imports in graph.items()
        if name == room or name.startswith(room + ".")
    }
    return {m: t for m, t in upward.items() if t}


def test_router_rooms_import_down():
    graph = module_graph("router", runtime_only=True)
    assert "router.routing.core" in graph and "router.api.app" in graph
    assert router_upward(graph) == {}


def test_the_rooms_check_sees_an_upward_import_but_not_a_typing_one(tmp_path):
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
    graph = module_graph("router", runtime_only=True, root=tmp_path)
    assert graph["router.routing.registry"] == {"router.backends"}  # the typing one is left
    assert router_upward(graph) == {"router.routing.registry": ["router.backends"]}
    assert find_cycle(graph) == ["router.backends", "router.routing.registry", "router.backends"]
    assert module_graph("router", root=tmp_path)["router.routing.registry"] == {
        "router.backends", "router.api"
    }
