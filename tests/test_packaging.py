"""Packaging: `pip install areal-metrics` is the client only; the extras hold the rest.

The bare-install test builds the project's wheel, installs it with no
dependencies into a fresh virtual environment (no system site packages), adds
kafka-python and msgspec (what the client needs; from PyPI), and runs a trainer
that logs with the broker away: it journals and exits 0, with no torch,
faust or chdb present; then, against the real broker, it delivers through
kafka-python, since the `fast` extra (confluent-kafka) is not installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NETWORK_TROUBLE = ("Failed to establish a new connection", "Temporary failure in name resolution",
                   "No matching distribution found", "Could not fetch URL", "Network is unreachable")


def test_the_bare_dependencies_are_the_client_and_torch_is_a_range() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [d.split(">")[0].split("=")[0].split("<")[0].strip() for d in project["dependencies"]]
    assert names == ["kafka-python", "crc32c", "msgspec"]
    extras = project["optional-dependencies"]
    assert {"stack", "train", "integrations", "test", "bench", "fast"} <= set(extras)
    assert [d.split(">")[0] for d in extras["fast"]] == ["confluent-kafka"]
    torch = [d for d in extras["train"] if d.startswith("torch")]
    assert torch and ">=" in torch[0] and "<" in torch[0] and "==" not in torch[0]
    assert any(d.startswith("faust-streaming") for d in extras["stack"])
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert not any("benchmarks" in p or "tests" in p for p in packages)
    assert ".[stack,train,test,bench,fast,integrations]" in (ROOT / "Makefile").read_text()


ROOMS = ("producers", "streams", "sinks", "areal_train", "grafana")


def test_every_package_folder_is_installed_under_the_one_import_name() -> None:
    """pyproject's package list is every folder with an __init__.py, each room under areal_metrics."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(init.parent.relative_to(ROOT).parts) for top in ("areal_metrics", *ROOMS)
               for init in (ROOT / top).rglob("__init__.py")}
    expected = {name if name.startswith("areal_metrics") else f"areal_metrics.{name}" for name in on_disk}
    assert set(setuptools["packages"]) == expected
    assert setuptools["package-dir"] == {f"areal_metrics.{room}": room for room in ROOMS}
    assert all(p.split(".")[0] == "areal_metrics" for p in setuptools["packages"])


def _run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, **kw)  # type: ignore[call-overload]


def _pip(venv: Path, *args: str) -> None:
    out = _run([str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", *args])
    if out.returncode != 0 and any(t in out.stdout + out.stderr for t in NETWORK_TROUBLE):
        pytest.skip(f"PyPI not reachable from here: {out.stderr.strip().splitlines()[-1][:200]}")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def bare_venv(tmp_path: Path) -> Path:
    """A fresh venv (no system site packages) with the project's wheel, kafka-python and msgspec alone; its folder."""
    src = tmp_path / "src"
    # the working tree as git sees it: tracked files and new ones not ignored
    files = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT).stdout.split("\0")
    for name in filter(None, files):
        target = src / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_file():
            target.write_bytes((ROOT / name).read_bytes())
    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)]).returncode == 0
    _pip(venv, "wheel", "--no-deps", "--quiet", "-w", str(tmp_path / "dist"), str(src))  # setuptools from PyPI
    wheel = next((tmp_path / "dist").glob("areal_metrics-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        tops = {n.split("/")[0].removesuffix(".py") for n in archive.namelist()}
        metadata = next(archive.read(n).decode() for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
    assert {t for t in tops if not t.endswith((".dist-info", ".data"))} == {"areal_metrics"}
    assert "License-Expression: Apache-2.0" in metadata  # the licence in the package metadata
    _pip(venv, "install", "--no-deps", "--quiet", str(wheel), f"kafka-python=={version('kafka-python')}",
         f"msgspec=={version('msgspec')}")
    return venv


@pytest.mark.timeout(900)
def test_a_fresh_environment_with_the_bare_package_runs_the_client(tmp_path: Path, kafka_bootstrap: str) -> None:
    venv = bare_venv(tmp_path)

    # the user's own project has packages named like our folders: both must import
    project = tmp_path / "project"
    for room in ROOMS:
        (project / room).mkdir(parents=True)
        (project / room / "__init__.py").write_text(f"OWNER = 'user:{room}'\n")
    home = tmp_path / "home"
    script = textwrap.dedent("""
        import importlib.util, sys
        import producers, streams, sinks, grafana, areal_train
        import areal_metrics as am
        assert [m.OWNER for m in (producers, streams, sinks, grafana, areal_train)] == [
            "user:producers", "user:streams", "user:sinks", "user:grafana", "user:areal_train"]
        absent = [m for m in ("torch", "faust", "chdb", "clickhouse_connect", "matplotlib", "numpy", "confluent_kafka",
                                     "orjson")
                  if importlib.util.find_spec(m) is not None]
        assert not absent, f"installed in the bare environment: {absent}"
        assert importlib.util.find_spec("benchmarks") is None
        run = am.init(run_id="bare", config={"lr": 3e-4}, tags=["bare"])
        for step in range(5):
            run.log({"reward": 0.1 * step, "loss": float("nan"), "epoch": step / 4}, step=step)
        print("logged", run.stats().steps)
    """)
    env = {"PATH": "/usr/bin:/bin", "AREAL_HOME": str(home), "AREAL_KAFKA_BOOTSTRAP": "127.0.0.1:9",
           "AREAL_EXIT_TIMEOUT_S": "5"}
    out = _run([str(venv / "bin" / "python"), "-c", script], cwd=project, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "logged 5" in out.stdout
    lines = (home / "journal" / "bare" / "rank-0" / "journal.log").read_bytes().splitlines()
    events = [json.loads(line.split(b"\t", 2)[2]) for line in lines]
    assert [e["type"] for e in events] == ["run"] + ["step"] * 5 + ["run"]
    assert events[-1]["status"] == "finished" and events[1]["non_finite"] == ["loss"]

    live = textwrap.dedent("""
        import areal_metrics as am
        run = am.init(run_id="bare-live", git=False)
        for step in range(3):
            run.log({"reward": 0.1 * step}, step=step)
        run.finish()
        s = run.stats()
        print("client", run._publisher.kafka_client, "acknowledged", s.sent + s.resent, "of", s.queued)
    """)
    out = _run([str(venv / "bin" / "python"), "-c", live], cwd=tmp_path,
               env={**env, "AREAL_KAFKA_BOOTSTRAP": kafka_bootstrap, "AREAL_TOPIC_PREFIX": "bare."})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "client kafka-python acknowledged 5 of 5" in out.stdout, out.stdout + out.stderr[-2000:]


def test_the_readme_is_a_users_page() -> None:
    """<= 160 lines; the two set-up commands kept; the client and the `stack` extra; no measurement lists."""
    import re

    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 160
    commands = re.findall(r"^make \w+", readme, re.MULTILINE)
    assert commands == ["make demo", "make test"]
    assert "pip install areal-metrics " in readme and "'areal-metrics[stack]'" in readme
    for verb in ("areal-metrics up", "areal-metrics watch", "areal-metrics sql", "areal-metrics report"):
        assert verb in readme, verb
    assert len(re.findall(r"[+-]?\d+(\.\d+)? ?%", readme)) <= 2  # measurements live in docs/PERFORMANCE.md
    assert (ROOT / "docs" / "img" / "accuracy_response_length.png").exists()
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
