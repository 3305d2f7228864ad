"""Packaging: installed versions lie in the declared ranges (the import rules: tests/test_architecture.py)."""

from __future__ import annotations

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
