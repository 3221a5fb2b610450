"""The first screen of `make demo` (issue 44, item 8; issue 43's "make install prints screens of
setuptools warnings").

- `make demo` installs the stack and the trainer only (the `integrations`, `test` and `bench`
  extras stay for `make test`), and says so in one line before the long pip step
  (`make -n`: the commands, none run).
- Building the package prints no setuptools warning (the kafka/ data folder was taken for a
  package left out: "Package would be ignored", ~40 lines), and its pom.xml is still shipped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support import ROOT


def make_dry_run(target: str, tmp_path: Path) -> list[str]:
    if shutil.which("make") is None:
        pytest.fail("make is needed (the README's two set-up commands are make targets)")
    # Under `make test` this runs as a sub-make: MAKELEVEL/MAKEFLAGS would make it print
    # "make[1]: Entering directory" lines around the commands, so they are left out.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")}
    out = subprocess.run(["make", "--no-print-directory", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_make_demo_installs_what_the_demo_needs_and_says_so_first(tmp_path: Path) -> None:
    lines = make_dry_run("demo", tmp_path)
    installs = [i for i, line in enumerate(lines) if " -m pip install" in line and "--upgrade pip" not in line]
    assert [lines[i].split("-e ")[-1] for i in installs] == ["'.[stack,train]'"], lines
    notice = next(i for i, line in enumerate(lines) if line.startswith("echo ") and "Installing" in line)
    assert notice < min(i for i, line in enumerate(lines) if " -m pip " in line)
    assert not any("integrations" in line or "NO_DEPS" in line or "verl==" in line for line in lines)
    assert lines[-1].endswith("areal-metrics demo")
    # every pip run hides setuptools' editable-install notice (a UserWarning nobody can act on)
    assert all("PYTHONWARNINGS=ignore::UserWarning" in line for line in lines if " -m pip " in line)


def test_make_test_adds_the_rest_on_top(tmp_path: Path) -> None:
    lines = make_dry_run("test", tmp_path)
    installs = [line.split("-e ")[-1] for line in lines if " -m pip install" in line and " -e " in line]
    assert installs == ["'.[stack,train]'", "'.[stack,train,test,bench,fast,integrations]'"], lines
    assert any("--no-deps" in line and "verl==" in line for line in lines)


def test_the_install_steps_python_lines_run_against_the_code(tmp_path: Path) -> None:
    """Each `python -c '...'` of `make demo`'s install runs here with the installed package: a
    signature changed under the Makefile (ensure_jars() took a `stack` argument) broke the
    install of a fresh clone while every test passed. The jars are the fixtures' (no download)."""
    from areal_metrics.stack.kafka_broker import ensure_jars
    from areal_metrics.stack.settings import StackSettings

    jars = ensure_jars(StackSettings.from_env())  # what the fixtures use; fetched already
    lines = [line for line in make_dry_run("demo", tmp_path) if " -c '" in line]
    assert lines, "no python -c line in the install"
    for line in lines:
        code = line.split(" -c '", 1)[1].rsplit("'", 1)[0]
        env = {**os.environ, "AREAL_KAFKA_JARS": str(jars)}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, (code, out.stderr[-2000:])


@pytest.mark.timeout(300)
def test_building_the_package_prints_no_setuptools_warning(tmp_path: Path) -> None:
    src = tmp_path / "src"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--disable-pip-version-check",
                          "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    said = out.stdout + out.stderr
    assert "Warning" not in said and "would be ignored" not in said, said[:3000]
    wheel = next((tmp_path / "dist").glob("areal_metrics-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        assert "areal_metrics/stack/kafka/pom.xml" in archive.namelist()
