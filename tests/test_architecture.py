"""The architecture, checked: imports flow one way between the packages, no two modules import each other (directly
or round a longer loop), every module name is unique, no file is over 500 lines, no function over 80, and the decode
loop ``speculative_generate`` fits in 60.

Imports are read from the source (AST), wherever they stand: at the top, inside a function (the usual way to hide a
cycle), or under ``TYPE_CHECKING`` (a type-only cycle still means two modules that cannot be read apart).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("ddtree", "dflash_core", "experiments", "plots")
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_LOOP_LINES = 500, 80, 60
# What each package must never import (its first dotted part). The record schema is the one module of the harness
# that the figures read, so plots may import it and nothing else of experiments (and never torch: plots run without).
FORBIDDEN = {
    "dflash_core": {"ddtree", "experiments", "plots"},
    "ddtree": {"experiments", "plots"},
    "experiments": {"plots"},
    "plots": {"torch", "experiments"},
}
ALLOWED = {"plots": {"experiments.bench.schema"}}


def project_modules(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under the packages (a package is its ``__init__``)."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imported_names(name: str, path: Path) -> set[str]:
    """Every name ``path`` imports, relative imports made absolute; ``from a import b`` gives ``a.b``, which
    :func:`import_graph` reads as the module ``a.b`` when there is one, else as ``a`` (the package a module is
    imported from is not counted as imported: every import of a submodule runs its package's ``__init__``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            out.update(f"{base}.{alias.name}" if alias.name != "*" else base for alias in node.names)
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (the longest dotted prefix that is a module; itself left out)."""
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_names(name, path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan, iterative): each one is at least one cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start), on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child), on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def test_the_cycle_finder_sees_a_cycle_hidden_in_a_function(tmp_path):
    """The checker itself: two modules of a made-up package that import each other, one of them only inside a
    function and through a relative import, and a third that imports one of them without being imported back."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import thing\n")
    (pkg / "b.py").write_text("def thing():\n    from . import a\n    return a\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = import_graph(project_modules(tmp_path, ("pkg",)))
    assert graph["pkg.b"] == {"pkg.a"} and graph["pkg.c"] == {"pkg.a"}
    assert import_cycles(graph) == [["pkg.a", "pkg.b"]]
    (pkg / "b.py").write_text("def thing():\n    return 1\n")
    assert import_cycles(import_graph(project_modules(tmp_path, ("pkg",)))) == []


def test_no_two_modules_import_each_other():
    cycles = import_cycles(import_graph(project_modules(REPO)))
    assert not cycles, ("modules that import each other (move the shared piece into a module both can import, or "
                        f"pass it in): {cycles}")


def upward_imports(package: str, names: set[str]) -> list[str]:
    """The names a module of ``package`` may not import (:data:`FORBIDDEN`, less :data:`ALLOWED`)."""
    allowed = ALLOWED.get(package, ())
    return sorted(n for n in names if n.split(".")[0] in FORBIDDEN[package]
                  and not any(n == ok or n.startswith(ok + ".") for ok in allowed))


def test_imports_flow_one_way():
    bad = [f"{path.relative_to(REPO)} imports {imported}" for name, path in project_modules(REPO).items()
           for imported in upward_imports(name.split(".")[0], imported_names(name, path))]
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_module_names_are_unique():
    """One file per name, so a name in a traceback, a doc or a command says which file it is."""
    seen: dict[str, list[str]] = {}
    for path in sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py")):
        if path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.stem, []).append(str(path.relative_to(REPO)))
    assert not {k: v for k, v in seen.items() if len(v) > 1}


def _python_files() -> list[Path]:
    files = [p for package in (*PACKAGES, "tests") for p in (REPO / package).rglob("*.py")]
    return sorted(files + list(REPO.glob("*.py")))


def _function_lines(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def test_files_and_functions_are_short():
    long_files, long_functions = [], []
    for path in _python_files():
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(REPO)
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.append(f"{rel}: {len(text.splitlines())} lines")
        long_functions += [f"{rel}:{line} {name}: {n} lines" for name, line, n in _function_lines(ast.parse(text))
                           if n > MAX_FUNCTION_LINES]
    assert not long_files, f"files over {MAX_FILE_LINES} lines: {long_files}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


def test_the_decode_loop_fits_on_a_screen():
    tree = ast.parse((REPO / "dflash_core" / "decoding.py").read_text(encoding="utf-8"))
    found = [n for name, _, n in _function_lines(tree) if name == "speculative_generate"]
    assert found and found[0] <= MAX_LOOP_LINES, f"speculative_generate: {found} lines (at most {MAX_LOOP_LINES})"


@pytest.mark.parametrize("source, bad", [
    ("import torch\n", True),
    ("from experiments.bench.schema import SampleRecord\n", False),
    ("from experiments.bench.session import Session\n", True),
])
def test_the_one_way_rule_reads_what_plots_may_import(tmp_path, source, bad):
    """The checker itself, on one made-up plots module: the schema is allowed, the rest of the harness and torch
    are not."""
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "fig.py").write_text(source)
    assert bool(upward_imports("plots", imported_names("plots.fig", tmp_path / "plots" / "fig.py"))) == bad
