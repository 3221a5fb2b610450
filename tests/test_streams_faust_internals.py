"""Faust's and aiokafka's private names are used in one module (streams/shell/faust_internals.py).

Any other module of the worker that reads `x._name` off an object other than its own `self`
or `cls` fails this test: a Faust upgrade then has one file to check.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = ROOT / "streams" / "shell" / "faust_internals.py"


def private_reads(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__"):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in {"self", "cls"}:
            continue
        found.append(f"{path.name}:{node.lineno} .{name}")
    return found


def test_no_module_but_faust_internals_reads_a_private_name_of_another_object() -> None:
    offenders = [hit for path in sorted((ROOT / "streams").rglob("*.py")) if path != ALLOWED
                 for hit in private_reads(path)]
    assert offenders == []


def test_the_checker_sees_a_private_read(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def f(app, self):\n    self._ok\n    return app.producer._ensure_producer()\n")
    assert [hit.split(" ")[-1] for hit in private_reads(src)] == ["._ensure_producer"]
    assert private_reads(ALLOWED), "faust_internals.py is where the private names live"


def test_faust_streaming_is_pinned_to_one_version() -> None:
    stack = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["stack"]
    faust = [d for d in stack if d.startswith("faust-streaming")]
    assert len(faust) == 1 and "==" in faust[0], faust
