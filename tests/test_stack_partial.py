"""No half-started stack: `up` without the `stack` extra starts nothing, and a service that
dies at import is shown failed by `status`, with its reason, instead of being restarted.

A bare install is played by a `sitecustomize` on PYTHONPATH (it reaches the services too):
`absent` modules are not there at all (what `find_spec` sees of a missing package);
`broken` ones are found but fail at import (a package that breaks while the service starts).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from areal_metrics.stack.services import INSTALL_HINT, failure_reason, missing_modules
from tests.test_cli_stack import cli, status_until

SITECUSTOMIZE = '''
import importlib.abc, importlib.machinery, sys
ABSENT = {absent!r}
BROKEN = {broken!r}
for name in ABSENT:
    sys.modules[name] = None  # import raises ModuleNotFoundError, find_spec gives None
class Broken(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name in BROKEN else None
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        raise ModuleNotFoundError(f"No module named {{module.__name__!r}} (broken for the test)")
sys.meta_path.insert(0, Broken())
'''


def bare_env(tmp_path: Path, absent: tuple[str, ...] = (), broken: tuple[str, ...] = ()) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(absent=absent, broken=broken))
    env = {**os.environ, "AREAL_HOME": str(tmp_path / "home"), "AREAL_TOPIC_PREFIX": "bare.",
           "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    env.pop("AREAL_KAFKA_BOOTSTRAP", None)
    env.pop("AREAL_CLICKHOUSE_URL", None)
    return env


def test_the_missing_modules_are_those_of_the_services_started() -> None:
    assert missing_modules(("worker", "sink"), "chdb:///x") == []  # this environment has the extra
    assert missing_modules((), "chdb:///x") == []


def test_up_without_the_stack_extra_exits_2_with_the_install_hint_and_starts_nothing(tmp_path: Path) -> None:
    env = bare_env(tmp_path, absent=("faust", "chdb", "clickhouse_connect"))
    result = cli("up", env=env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "areal-metrics up: error: the stack's services need the `stack` extra "
        f"(missing: faust, clickhouse_connect, chdb): {INSTALL_HINT}"]
    home = tmp_path / "home"
    assert not (home / "stack.json").exists() and not (home / "kafka").exists()  # no broker was started
    assert cli("status", "--json", env=env).returncode == 1


@pytest.mark.timeout(300)
def test_a_service_that_dies_at_import_is_shown_failed_with_its_reason_and_not_restarted(tmp_path: Path) -> None:
    env = bare_env(tmp_path, broken=("clickhouse_connect",))
    try:
        up = cli("up", "--no-worker", env=env)
        if up.returncode != 0:  # it died within up's first second: up stopped everything it started
            assert up.returncode == 1 and "sink exited at start (sink: areal-sink: cannot start: No module named " \
                "'clickhouse_connect'" in up.stderr, up.stderr
            assert json.loads(cli("status", "--json", env=env).stdout)["processes"] == {}
            return
        status = status_until(env, lambda r: "failed" in r.stdout, timeout=120)
        assert "sink pid" in status.stdout and status.returncode == 1, status.stdout
        assert ("(failed: areal-sink: cannot start: No module named 'clickhouse_connect' (broken for the test) "
                "(install the stack extra: pip install 'areal-metrics[stack]'))") in status.stdout
        sink = json.loads(cli("status", "--json", env=env).stdout)["processes"]["sink"]
        assert sink["state"] == "failed" and not sink["alive"]
        assert sink["reason"] == failure_reason(tmp_path / "home", "sink")
        log = (tmp_path / "home" / "logs" / "sink.log").read_text()
        assert log.count("cannot start") == 1 and "retrying" not in log  # once, not in a loop
    finally:
        cli("down", env=env)


def test_status_shows_a_service_that_stopped_as_failed_with_the_last_line_of_its_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    from areal_metrics.stack.services import StackInfo, write_info

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer runs
    home = tmp_path / "home"
    (home / "logs").mkdir(parents=True)
    (home / "logs" / "sink.log").write_text("INFO starting\nareal-sink: cannot start: No module named 'chdb' (...)\n\n")
    env = bare_env(tmp_path)
    monkeypatch.setenv("AREAL_HOME", str(home))
    write_info(StackInfo(kafka_bootstrap="127.0.0.1:1", kafka_port=1, controller_port=2, kafka_version="x",
                         topic_prefix="bare.", clickhouse_url="chdb:///nowhere", home=str(home), pids={"sink": gone.pid}))
    status = cli("status", env=env)
    assert status.returncode == 1
    assert f"sink pid {gone.pid} DOWN (failed: areal-sink: cannot start: No module named 'chdb' (...))" in status.stdout
    sink = json.loads(cli("status", "--json", env=env).stdout)["processes"]["sink"]
    assert sink == {"pid": gone.pid, "alive": False, "state": "failed", "restarts": 0,
                    "reason": "areal-sink: cannot start: No module named 'chdb' (...)"}
