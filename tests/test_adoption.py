"""A team's first day (CONTRACT.md, 'Adoption'), from a fresh venv with only the package, kafka-python and msgspec.

`areal-metrics up --no-worker` (the project's environment: the `stack` extra) starts a broker and the
sink in a fresh `AREAL_HOME`. A script run by the bare venv, with no setting but `AREAL_HOME`, from
another directory:

- finds the broker `up` recorded, and its steps are stored;
- after `areal-metrics down` (the broker unreachable) prints one warning naming the bootstrap and
  the journal and exits 0; `areal-metrics sync` (the bare venv's own command) exits 1 while the
  broker is away, and after `up` again (same ports) delivers the steps; a second sync sends nothing.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support import wait_for
from tests.test_packaging import _run, bare_venv

pytestmark = [pytest.mark.broker, pytest.mark.timeout(900)]

SCRIPT = textwrap.dedent("""
    import sys
    import areal_metrics as am
    run = am.init(run_id=sys.argv[1], git=False)
    for step in range(4):
        run.log({"reward": 0.25 * step}, step=step)
    run.finish()
    print("done", am.__version__)
""")


def test_the_first_run_finds_the_stack_or_says_why_and_sync_delivers(tmp_path: Path) -> None:
    from areal_metrics.producers.contract.settings import Settings
    from areal_metrics.sinks.query import connect

    venv = bare_venv(tmp_path)
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    elsewhere.mkdir()
    stack_env = {k: v for k, v in os.environ.items() if not k.startswith("AREAL_")} | {"AREAL_HOME": str(home)}
    bare_env = {"PATH": "/usr/bin:/bin", "AREAL_HOME": str(home), "AREAL_EXIT_TIMEOUT_S": "20"}
    python, cli = str(venv / "bin" / "python"), str(venv / "bin" / "areal-metrics")

    def stack(*verb: str) -> str:
        out = _run([sys.executable, "-m", "areal_metrics", *verb], env=stack_env, cwd=tmp_path)
        assert out.returncode == 0, out.stdout + out.stderr[-3000:]
        return out.stdout

    def steps(run_id: str) -> list[tuple]:
        recorded = json.loads((home / "stack.json").read_text())
        settings = Settings(clickhouse_url=recorded["clickhouse_url"])
        with connect(settings, wait_s=30) as store:
            return store.query(f"SELECT step, reward FROM v_steps WHERE run_id = '{run_id}' ORDER BY step").rows

    stack("up", "--no-worker")
    try:
        bootstrap = json.loads((home / "stack.json").read_text())["kafka_bootstrap"]
        out = _run([python, "-c", SCRIPT, "first-day"], cwd=elsewhere, env=bare_env)
        assert out.returncode == 0 and out.stdout.startswith("done "), out.stderr[-3000:]
        assert "cannot deliver" not in out.stderr
        wait_for(lambda: len(steps("first-day")) == 4, 180, "the first run's 4 steps")
        assert not (elsewhere / ".areal").exists()

        stack("down")  # the broker is away
        out = _run([python, "-c", SCRIPT, "offline-day"], cwd=elsewhere, env={**bare_env, "AREAL_EXIT_TIMEOUT_S": "3"})
        assert out.returncode == 0, out.stderr[-3000:]
        journal = home / "journal" / "offline-day" / "rank-0"
        warnings = [line for line in out.stderr.splitlines() if "cannot deliver" in line]
        assert len(warnings) == 1, out.stderr[-3000:]
        assert bootstrap in warnings[0] and str(home / "stack.json") in warnings[0] and str(journal) in warnings[0]
        assert (journal / "journal.log").stat().st_size > 0
        out = _run([cli, "sync", "--timeout", "3"], cwd=elsewhere, env=bare_env)
        assert out.returncode == 1 and "not delivered" in out.stderr and "Traceback" not in out.stderr, out.stderr

        stack("up", "--no-worker")  # the broker answers again, on its ports
        assert json.loads((home / "stack.json").read_text())["kafka_bootstrap"] == bootstrap
        out = _run([cli, "sync"], cwd=elsewhere, env=bare_env)
        assert out.returncode == 0 and "synced 6 event(s)" in out.stdout, out.stdout + out.stderr[-3000:]
        wait_for(lambda: len(steps("offline-day")) == 4, 180, "the synced run's 4 steps")
        assert steps("offline-day") == [(s, 0.25 * s) for s in range(4)]
        again = _run([cli, "sync"], cwd=elsewhere, env=bare_env)
        assert again.returncode == 0 and "synced 0 event(s)" in again.stdout
    finally:
        _run([sys.executable, "-m", "areal_metrics", "down"], env=stack_env, cwd=tmp_path)
