"""The product packages never import the test-only `testing` package (it is not shipped)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("mem_cache", "worker", "router", "cluster")


def imported_modules(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` in the file names (type-only ones too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", PRODUCT)
def test_product_does_not_import_testing(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    offenders = {
        str(f.relative_to(ROOT)): sorted(m for m in imported_modules(f)
                                         if m == "testing" or m.startswith("testing."))
        for f in files
    }
    assert {f: m for f, m in offenders.items() if m} == {}


def test_the_check_sees_a_testing_import(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from testing.fake_worker import serve\nimport testing\n")
    assert imported_modules(sample) == {"testing.fake_worker", "testing"}
