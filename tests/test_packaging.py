"""Packaging: installed versions lie in the declared ranges, and imports flow one way between the packages."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_installed_versions_lie_in_the_declared_ranges():
    import importlib.metadata

    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib")
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = {Requirement(d).name: Requirement(d) for d in deps}
    assert reqs["torch"].specifier.contains("2.5.0") and not reqs["torch"].specifier.contains("2.4.1")  # enable_gqa
    assert reqs["transformers"].specifier.contains("5.17.0")  # what GPU images ship
    for name in ("torch", "transformers"):
        installed = importlib.metadata.version(name).split("+")[0]
        assert reqs[name].specifier.contains(installed, prereleases=True), (name, installed)
    assert (REPO / "scripts" / "test_oldest.sh").is_file()


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_imports_flow_one_way():
    for path in sorted((REPO / "dflash_core").rglob("*.py")):
        bad = {m for m in _imported_modules(path) if m.split(".")[0] in ("experiments", "ddtree", "plots")}
        assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"
    for path in sorted((REPO / "ddtree").rglob("*.py")):
        bad = {m for m in _imported_modules(path) if m.split(".")[0] in ("experiments", "plots")}
        assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"
    assert "load_models" not in _defined_functions(REPO / "experiments" / "benchmark.py")


def _defined_functions(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}
