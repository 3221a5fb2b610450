"""The import graph runs one way (docs/ARCHITECTURE.md, "Rooms"), checked on the source text.

Every import counts: top-level, inside functions, under TYPE_CHECKING. A module's room is the
longest room name that prefixes its dotted name; ROOMS says which rooms each may import. Most
rooms are folders at the repository root (setuptools' package-dir); those in INSIDE are folders
of areal_metrics/ itself. No room may import the CLI (areal_metrics' other modules: `cli`,
`commands/`, `stack/`, ...), which sits on top and may import every room.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "areal_metrics."
# room -> the other rooms it may import (its own room is always allowed)
ROOMS: dict[str, set[str]] = {
    "producers": set(),  # the folder's __init__ only: each room below is imported by its own name
    "producers.contract": set(),
    "producers.runtime": {"producers.contract"},
    "producers.delivery": {"producers.contract", "producers.runtime"},
    "producers.client": {"producers.contract", "producers.runtime", "producers.delivery"},
    "streams.core": {"producers.contract"},
    "streams.state": {"streams.core", "producers.contract"},
    "streams.shell": {"streams.core", "streams.state", "producers.contract", "producers.runtime"},
    "streams": {"streams.core", "streams.state", "streams.shell", "producers.contract", "producers.runtime"},
    "sinks": {"producers.contract", "producers.runtime"},
    "areal_train": {"producers.contract", "producers.client"},
    "grafana": {"producers.contract"},
    "analysis": {"producers.contract", "sinks"},  # report, figures, comparison: the CLI's verbs call them
}
# rooms whose folder is inside areal_metrics/ (areal_metrics/analysis/), not at the repository root
INSIDE = {"analysis"}
# third-party packages a pure room must not import
PURE = {"streams.core": {"faust", "aiokafka", "kafka", "mode", "clickhouse_connect", "chdb"}}


def room_of(dotted: str) -> str | None:
    """The room of a module given by its dotted name inside areal_metrics ("streams.core.voting")."""
    names = sorted(ROOMS, key=len, reverse=True)
    return next((r for r in names if dotted == r or dotted.startswith(r + ".")), None)


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name one file imports (`from a.b import c` gives a.b and a.b.c)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def project_rooms(modules: set[str]) -> set[str]:
    """The rooms (or "cli" for areal_metrics' own modules) among imported module names."""
    out: set[str] = set()
    for name in modules:
        if name.split(".")[0] in {"producers", "streams", "sinks", "grafana", "areal_train"}:
            out.add("top-level " + name.split(".")[0])  # the old import names are gone for good
        if not name.startswith(PREFIX):
            continue
        inner = name[len(PREFIX):]
        room = room_of(inner)
        if room is None and inner.split(".")[0] not in {r.split(".")[0] for r in ROOMS}:
            out.add("cli")
        elif room is not None:
            out.add(room)
    return out


def module_name(path: Path) -> str:
    """A file's dotted name inside areal_metrics ("streams.core.voting", "analysis.report")."""
    dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    return dotted.removeprefix(PREFIX)


def folder_of(room: str) -> Path:
    parts = room.split(".")
    return ROOT / "areal_metrics" / Path(*parts) if parts[0] in INSIDE else ROOT / Path(*parts)


def violations(room: str) -> list[str]:
    folder = folder_of(room)
    out = []
    for path in sorted(folder.rglob("*.py")):
        if room_of(module_name(path)) != room:
            continue  # a deeper room's file, checked under its own name
        for other in sorted(project_rooms(imported_modules(path)) - ROOMS[room] - {room}):
            out.append(f"{path.relative_to(ROOT)} imports {other}")
        for third in sorted(PURE.get(room, set()) & {m.split(".")[0] for m in imported_modules(path)}):
            out.append(f"{path.relative_to(ROOT)} imports {third}")
    return out


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_each_room_imports_only_the_rooms_below_it(room: str) -> None:
    assert (folder_of(room) / "__init__.py").exists()
    assert violations(room) == []


def test_every_package_folder_is_a_room_or_inside_one() -> None:
    for top in ("producers", "streams", "sinks", "grafana", "areal_train", *(f"areal_metrics/{r}" for r in INSIDE)):
        for init in (ROOT / top).rglob("__init__.py"):
            assert room_of(module_name(init.parent / "x.py").removesuffix(".x")) is not None, init


def test_analysis_is_a_room_inside_the_package_and_the_cli_sits_on_it(tmp_path: Path) -> None:
    """analysis/ lives in areal_metrics/, yet it is a room: importing the CLI from it is caught."""
    src = tmp_path / "m.py"
    src.write_text("from areal_metrics.analysis import figures\nfrom areal_metrics.errors import UserError\n"
                   "from areal_metrics.commands.report import run\n")
    assert project_rooms(imported_modules(src)) == {"analysis", "cli"}
    assert room_of(module_name(ROOT / "areal_metrics" / "analysis" / "report.py")) == "analysis"
    assert room_of(module_name(ROOT / "areal_metrics" / "commands" / "report.py")) is None  # the CLI
    assert folder_of("analysis") == ROOT / "areal_metrics" / "analysis"
    assert [room for room, allowed in ROOMS.items() if "analysis" in allowed] == []  # only the CLI


def test_the_architecture_page_lists_the_same_rooms_and_imports() -> None:
    """docs/ARCHITECTURE.md's table has one row per room: `room` | may import `a`, `b`."""
    page = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    rows = re.findall(r"^\| `([\w.]+)/?` \| ([^|]*) \|", page, re.M)
    documented = {room.replace("/", "."): set(re.findall(r"`([\w.]+)`", allowed)) for room, allowed in rows}
    assert documented == ROOMS


def test_the_checker_sees_every_kind_of_import(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "import os\nimport areal_metrics.sinks.query as q\nfrom areal_metrics.streams.shell import app\n"
        "from . import sibling\n"
        "def f():\n    from areal_metrics.cli import main\n"
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import areal_metrics.grafana.macros\n"
        "import producers.events\n"
    )
    assert project_rooms(imported_modules(src)) == {"sinks", "streams.shell", "cli", "grafana",
                                                    "top-level producers"}
    assert room_of("producers.contract.events") == "producers.contract"
    assert room_of("streams.core") == "streams.core"
    assert room_of("streams.__main__") == "streams"
