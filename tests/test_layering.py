"""The import graph runs one way (the brief's layering), checked on the source text.

producers/ imports no other package of the project; streams/, sinks/, areal_train/
build on producers/ and never import each other or the CLI; grafana/ imports nothing
of the project but producers/. Every import counts: top-level, inside functions,
under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("producers", "streams", "sinks", "areal_train", "grafana", "areal_metrics", "benchmarks")
ALLOWED: dict[str, set[str]] = {
    "producers": set(),
    "streams": {"producers"},
    "sinks": {"producers"},
    "areal_train": {"producers"},
    "grafana": {"producers"},
}


def imported_packages(path: Path) -> set[str]:
    """The project's top-level packages that one file imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update(n.split(".")[0] for n in names if n.split(".")[0] in PROJECT)
    return found


def violations(package: str) -> list[str]:
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for other in imported_packages(path) - ALLOWED[package] - {package}:
            out.append(f"{path.relative_to(ROOT)} imports {other}")
    return out


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_lies_below_it(package: str) -> None:
    assert (ROOT / package / "__init__.py").exists()
    assert violations(package) == []


def test_the_checker_sees_every_kind_of_import(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "import os\nimport sinks.query as q\nfrom streams import app\nfrom . import sibling\n"
        "def f():\n    from areal_metrics.cli import main\n"
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import grafana.macros\n"
    )
    assert imported_packages(src) == {"sinks", "streams", "areal_metrics", "grafana"}
