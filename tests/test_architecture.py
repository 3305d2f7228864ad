"""The architecture, checked: imports flow one way between the packages, no two modules import each other (directly
or round a longer loop), every module name is unique, no function is over 80 lines, the body of the decode loop
(``run_rounds``) fits on a screen, and the library keeps no module-level mutable state. A file is as long as its one
concept needs: there is no cap on file length.

Imports are read from the source (AST), wherever they stand: at the top, inside a function (the usual way to hide a
cycle), or under ``TYPE_CHECKING`` (a type-only cycle still means two modules that cannot be read apart).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("ddtree", "dflash_core", "experiments", "plots")
MAX_FUNCTION_LINES, MAX_LOOP_LINES = 80, 50
LIBRARY = ("ddtree", "dflash_core")  # packages that keep no module-level mutable state
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


def test_functions_are_short():
    long_functions = []
    for path in _python_files():
        rel = path.relative_to(REPO)
        long_functions += [f"{rel}:{line} {name}: {n} lines" for name, line, n in
                           _function_lines(ast.parse(path.read_text(encoding="utf-8"))) if n > MAX_FUNCTION_LINES]
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


def test_the_decode_loop_fits_on_a_screen():
    tree = ast.parse((REPO / "dflash_core" / "decoding.py").read_text(encoding="utf-8"))
    found = [n for name, _, n in _function_lines(tree) if name == "run_rounds"]
    assert found and found[0] <= MAX_LOOP_LINES, f"run_rounds: {found} lines (at most {MAX_LOOP_LINES})"


MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "deque", "OrderedDict", "Counter", "count", "WeakKeyDictionary",
                 "WeakValueDictionary", "WeakSet", "lru_cache", "cache"}


def mutable_state(source: str) -> list[str]:
    """What a module keeps that could change while the process runs: module-level names bound to a list, dict or
    set (literal, comprehension or constructor), a counter or a weak registry; memoising decorators on module
    functions (``lru_cache``, ``cache``); and ``global`` statements. Constants are tuples, frozensets, strings,
    numbers or read-only mappings (``__all__`` aside, a list by convention that nothing changes)."""

    def called(node) -> str | None:
        func = node.func if isinstance(node, ast.Call) else node
        return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)

    found = []
    tree = ast.parse(source)
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id.startswith("__") for t in targets):  # __all__: read, never changed
            continue
        if value is not None and (isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp,
                                                     ast.SetComp)) or
                                  (isinstance(value, ast.Call) and called(value) in MUTABLE_CALLS)):
            found.append(f"line {node.lineno}: {ast.unparse(node).splitlines()[0][:60]}")
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found += [f"line {d.lineno}: @{ast.unparse(d)}" for d in node.decorator_list if called(d) in MUTABLE_CALLS]
    found += [f"line {n.lineno}: global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    return found


def test_the_library_keeps_no_module_level_mutable_state():
    """Memory that outlives a call (auto's calibration, cost curves, caches) is an object the caller holds or a file
    in the cache directory, so a call's result never depends on earlier calls in the process."""
    bad = [f"{path.relative_to(REPO)} {item}" for package in LIBRARY for path in sorted((REPO / package).rglob("*.py"))
           for item in mutable_state(path.read_text(encoding="utf-8"))]
    assert not bad, "module-level mutable state (hold it in an object the caller passes):\n" + "\n".join(bad)


@pytest.mark.parametrize("source, bad", [
    ("_SEEN = {}\n", True),
    ("_ON = [True]\n", True),
    ("import itertools\n_NEXT = itertools.count(1)\n", True),
    ("from functools import lru_cache\n@lru_cache(maxsize=None)\ndef f():\n    return 1\n", True),
    ("X = 0\ndef bump():\n    global X\n    X += 1\n", True),
    ("NAMES = ('a', 'b')\nLIMIT = 3\nKINDS = frozenset({'x'})\n", False),
    ("def f():\n    seen = {}\n    return seen\n", False),
])
def test_the_mutable_state_rule_reads_what_it_should(source, bad):
    """The checker itself, on made-up modules: registries, switches, counters, memos and globals are caught;
    constants and a function's own locals are not."""
    assert bool(mutable_state(source)) == bad


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
