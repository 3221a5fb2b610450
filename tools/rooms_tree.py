"""Build the link tree through which static tools (pyright, editors) see the rooms.

Installed, the root folders are subpackages of `areal_metrics` by setuptools' package-dir
mapping (pyproject.toml), which the editable install serves through an import hook that
static tools cannot follow. This tree spells the same mapping with symbolic links:

    build/rooms/areal_metrics/<entry of areal_metrics/>  -> areal_metrics/<entry>
    build/rooms/areal_metrics/producers                   -> producers/   (one link per room)

pyrightconfig.json names build/rooms in `extraPaths`. A room links as a folder, so a module
added to a room is seen at once; a module added to areal_metrics/ itself needs this script
again (`make install` runs it). Usage: python tools/rooms_tree.py [ROOT]
"""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

PACKAGE = "areal_metrics"


def rooms(root: Path) -> dict[str, Path]:
    """The package-dir mapping of pyproject.toml: subpackage name -> its folder."""
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name.removeprefix(PACKAGE + "."): root / folder for name, folder in mapping.items()}


def build(root: Path) -> Path:
    tree = root / "build" / "rooms"
    package = tree / PACKAGE
    shutil.rmtree(tree, ignore_errors=True)
    package.mkdir(parents=True)
    for entry in sorted((root / PACKAGE).iterdir()):
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry.resolve())
    for name, folder in rooms(root).items():
        (package / name).symlink_to(folder.resolve(), target_is_directory=True)
    return tree


if __name__ == "__main__":
    print(build(Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()))
