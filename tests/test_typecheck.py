"""Static tools see the rooms: pyright resolves every `areal_metrics.<room>...` import.

The editable install serves the rooms through an import hook that static tools cannot
follow; `tools/rooms_tree.py` spells the same mapping as links under build/rooms, which
pyrightconfig.json names in `extraPaths`. The first test runs pyright over the whole
project with that configuration (errors are unresolved imports; see the config); the
second shows that the check can fail, and that it is the tree that makes it pass.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import rooms_tree  # noqa: E402  (a tool beside the project, not an installed module)

PYRIGHT = shutil.which("pyright", path=str(Path(sys.executable).parent)) or shutil.which("pyright")


def _pyright(*args: str, cwd: Path = ROOT) -> dict:
    assert PYRIGHT, "pyright is missing: it comes with the `test` extra (make install)"
    out = subprocess.run([PYRIGHT, "--outputjson", *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert out.stdout.strip(), out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def tree() -> Path:
    return rooms_tree.build(ROOT)


def test_the_tree_links_every_room_and_every_module_of_the_package(tree: Path) -> None:
    package = tree / "areal_metrics"
    for room, folder in rooms_tree.rooms(ROOT).items():
        assert (package / room).resolve() == folder.resolve()
    own = {p.name for p in (ROOT / "areal_metrics").iterdir() if p.name != "__pycache__"}
    assert own <= {p.name for p in package.iterdir()}


def test_pyright_resolves_every_import_of_the_project(tree: Path) -> None:
    result = _pyright("-p", str(ROOT / "pyrightconfig.json"))
    errors = [f"{d['file']}:{d['range']['start']['line'] + 1}: {d['message']}"
              for d in result["generalDiagnostics"] if d["severity"] == "error"]
    assert result["summary"]["filesAnalyzed"] > 200
    assert errors == []


def test_an_unresolved_import_fails_and_the_rooms_resolve_only_through_the_tree(tree: Path, tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from areal_metrics.producers.contract.events import StepEvent\n"
                     "from areal_metrics.streams.core import voting\n"
                     "from areal_metrics.producers.no_such_room import x\n")
    config = json.loads((ROOT / "pyrightconfig.json").read_text())

    def unresolved(extra_paths: list[str]) -> list[str]:
        (tmp_path / "pyrightconfig.json").write_text(json.dumps(
            {key: config[key] for key in ("pythonVersion", "typeCheckingMode", "reportMissingImports")}
            | {"include": ["probe.py"], "extraPaths": extra_paths}))
        result = _pyright("-p", str(tmp_path / "pyrightconfig.json"), "--pythonpath", sys.executable, cwd=tmp_path)
        return sorted(d["message"].split('"')[1] for d in result["generalDiagnostics"]
                      if d.get("rule") == "reportMissingImports")

    assert unresolved([str(tree)]) == ["areal_metrics.producers.no_such_room"]
    assert unresolved([]) == ["areal_metrics.producers.contract.events",
                              "areal_metrics.producers.no_such_room",
                              "areal_metrics.streams.core"]
