"""The image behind compose.yaml installs what each service needs (docker/Dockerfile, build arg EXTRAS).

There is no Docker here, so the test does what the image's `pip install` does, in two real checks:

1. Resolution: the Dockerfile's own RUN line writes the requirements for EXTRAS; in a fresh venv (no
   system site packages), `pip install --dry-run --report` of them against the package index: the
   set resolves, and the report names every distribution the image would get.
2. Imports: each service's entry modules are imported by `python -S` (no site-packages) whose path
   holds only the files of the distributions in the report (linked from this environment) and the
   project as installed. A module the image would lack fails here by name.

(A full install of the trainer's set means downloading torch into a fresh venv on every run; the
dry run resolves the same set without it.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest

from tests.test_packaging import NETWORK_TROUBLE, _run

ROOT = Path(__file__).resolve().parents[1]
# compose service -> the modules its command runs (what `python -m ...` and its main() import)
ENTRY_MODULES = {
    "streams": ("areal_metrics.streams.__main__", "areal_metrics.streams.shell.app",
                "areal_metrics.streams.shell.kafka_admin", "faust"),
    "sink": ("areal_metrics.sinks.__main__", "areal_metrics.sinks.sink", "areal_metrics.sinks.query",
             "areal_metrics.sinks.http.server", "chdb", "clickhouse_connect"),
    "trainer-mt4": ("areal_metrics.cli", "areal_metrics.commands.train", "areal_metrics.areal_train.launch",
                    "areal_metrics.areal_train.trainer", "torch"),
}


def compose() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def image_requirements(extras: str, where: Path) -> list[str]:
    """The requirements docker/Dockerfile installs for EXTRAS: its own RUN line, run here as Docker runs it."""
    text = (ROOT / "docker" / "Dockerfile").read_text().replace("\\\n", "")  # Docker's line continuation
    [command] = [line.removeprefix("RUN ") for line in text.splitlines() if "> /tmp/requirements.txt" in line]
    command = command.split(" && pip install")[0].replace("/tmp/requirements.txt", str(where / "requirements.txt"))
    (where / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    out = subprocess.run(["sh", "-c", command], cwd=where, capture_output=True, text=True, timeout=60,
                         env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "EXTRAS": extras})
    assert out.returncode == 0, out.stderr
    return [line for line in (where / "requirements.txt").read_text().splitlines() if line.strip()]


def test_each_service_builds_the_image_of_its_package_set() -> None:
    services = compose()["services"]
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "ARG EXTRAS=" in dockerfile and 'optional-dependencies"][e]' in dockerfile
    for name in ENTRY_MODULES:
        assert services[name]["build"]["dockerfile"] == "docker/Dockerfile", name
    assert services["streams"]["build"]["args"]["EXTRAS"] == services["sink"]["build"]["args"]["EXTRAS"] == "stack"
    assert "train" in services["trainer-mt4"]["build"]["args"]["EXTRAS"].split(",")
    assert services["trainer-mt4"]["image"] != services["sink"]["image"]
    advertised = services["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    assert "${KAFKA_ADVERTISED_HOST:-localhost}" in advertised  # a setting, for a broker used from other hosts


def resolved(extras: str, tmp_path: Path) -> set[str]:
    """The distributions (normalised names) a fresh venv would install for the image's package set."""
    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)]).returncode == 0
    wanted = image_requirements(extras, tmp_path)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert set(project["dependencies"]) <= set(wanted) and all(
        set(project["optional-dependencies"][e]) <= set(wanted) for e in extras.split(","))
    requirements = tmp_path / "requirements.txt"
    report = tmp_path / "report.json"
    out = _run([str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "install", "--dry-run",
                "--quiet", "--ignore-installed", "--report", str(report), "-r", str(requirements)])
    if out.returncode != 0 and any(t in out.stdout + out.stderr for t in NETWORK_TROUBLE):
        pytest.skip(f"the package index is not reachable from here: {out.stderr.strip().splitlines()[-1][:200]}")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return {_norm(item["metadata"]["name"]) for item in json.loads(report.read_text())["install"]}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


ROOMS = ("producers", "streams", "sinks", "areal_train", "grafana")


def image_site(names: set[str], where: Path) -> Path:
    """A site folder holding only the files of the installed distributions in `names` (symlinks), and the
    project laid out as installed (areal_metrics with its rooms)."""
    site = where / "site"
    site.mkdir()
    for name in names:
        try:
            files = distribution(name).files or []
        except PackageNotFoundError:  # in the image's set but not needed here (e.g. another platform's wheels)
            continue
        base = Path(distribution(name).locate_file(""))
        for top in {f.parts[0] for f in files if f.parts and f.parts[0] != ".."}:
            if (base / top).exists() and not (site / top).exists():
                (site / top).symlink_to(base / top)
    package = site / "areal_metrics"
    package.mkdir()
    for entry in (ROOT / "areal_metrics").iterdir():
        (package / entry.name).symlink_to(entry)
    for room in ROOMS:
        (package / room).symlink_to(ROOT / room)
    return site


@pytest.mark.timeout(900)
@pytest.mark.parametrize("service", list(ENTRY_MODULES))
def test_the_image_package_set_resolves_and_holds_the_service_entry_modules(service: str, tmp_path: Path) -> None:
    extras = compose()["services"][service]["build"]["args"]["EXTRAS"]
    site = image_site(resolved(extras, tmp_path), tmp_path)
    script = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)\nprint('imported', len(sys.argv) - 1)"
    # -S: no site-packages, no .pth (the editable install's finder); only the image's set is importable
    out = subprocess.run([sys.executable, "-S", "-c", script, *ENTRY_MODULES[service]], capture_output=True,
                         text=True, timeout=600, cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "PYTHONNOUSERSITE": "1"})
    assert out.returncode == 0 and f"imported {len(ENTRY_MODULES[service])}" in out.stdout, (
        f"{service} (EXTRAS={extras}): " + out.stderr[-3000:])
