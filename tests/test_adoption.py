"""A team's first day (CONTRACT.md, 'Adoption'), from a fresh venv with only the package and kafka-python.

The stack is recorded as `areal-metrics up` records it (`stack.json` in `AREAL_HOME`, written by
the stack's own `write_info`), pointing at the session's broker, and its sink runs as `up` runs
it. A script with no setting but `AREAL_HOME`, started from another directory:

- finds the recorded broker and its steps are stored;
- with the recorded broker unreachable, prints one warning naming the bootstrap and the
  journal, exits 0, and `areal-metrics sync` (the bare venv's own command) delivers the steps
  once the broker answers; a second sync sends nothing again.
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from areal_metrics.stack.kafka_broker import free_port
from areal_metrics.stack.services import StackInfo, service_env, write_info
from areal_metrics.producers.contract.topics import Topics
from tests.test_client_broker import service, stop, wait_for
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


def record_stack(home: Path, bootstrap: str, topics: Topics, store: Path) -> StackInfo:
    info = StackInfo(kafka_bootstrap=bootstrap, kafka_port=int(bootstrap.rsplit(":", 1)[1]), controller_port=0,
                     kafka_version="test", topic_prefix=topics.prefix, clickhouse_url=f"chdb://{store}", home=str(home))
    write_info(info)
    return info


def test_the_first_run_finds_the_stack_or_says_why_and_sync_delivers(tmp_path: Path, kafka_bootstrap: str,
                                                                      topics: Topics, monkeypatch) -> None:
    from areal_metrics.producers.contract.settings import Settings
    from areal_metrics.sinks.query import Target, connect, read_owner

    venv = bare_venv(tmp_path)
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setenv("AREAL_HOME", str(home))
    info = record_stack(home, kafka_bootstrap, topics, tmp_path / "store")
    sink = service("areal_metrics.sinks", service_env(info), tmp_path / "sink.log")
    settings = Settings(kafka_bootstrap=kafka_bootstrap, topic_prefix=topics.prefix, clickhouse_url=info.clickhouse_url)

    def steps(run_id: str) -> list[tuple]:
        with connect(settings, wait_s=30) as store:
            return store.query(f"SELECT step, reward FROM v_steps WHERE run_id = '{run_id}' ORDER BY step").rows

    env = {"PATH": "/usr/bin:/bin", "AREAL_HOME": str(home), "AREAL_EXIT_TIMEOUT_S": "20"}
    python = str(venv / "bin" / "python")
    try:
        wait_for(lambda: read_owner(Target.parse(info.clickhouse_url).path) is not None or sink.poll() is not None,
                 90, "the sink to start")
        out = _run([python, "-c", SCRIPT, "first-day"], cwd=elsewhere, env=env)
        assert out.returncode == 0 and out.stdout.startswith("done "), out.stderr[-3000:]
        assert "cannot deliver" not in out.stderr
        wait_for(lambda: len(steps("first-day")) == 4, 120, "the first run's 4 steps")
        assert not (elsewhere / ".areal").exists()

        dead = f"127.0.0.1:{free_port()}"
        record_stack(home, dead, topics, tmp_path / "store")  # the broker is away
        out = _run([python, "-c", SCRIPT, "offline-day"], cwd=elsewhere, env={**env, "AREAL_EXIT_TIMEOUT_S": "3"})
        assert out.returncode == 0, out.stderr[-3000:]
        journal = home / "journal" / "offline-day" / "rank-0"
        warnings = [line for line in out.stderr.splitlines() if "cannot deliver" in line]
        assert len(warnings) == 1 and dead in warnings[0] and str(journal) in warnings[0], out.stderr[-3000:]
        assert (journal / "journal.log").stat().st_size > 0

        out = _run([str(venv / "bin" / "areal-metrics"), "sync", "--timeout", "3"], cwd=elsewhere, env=env)
        assert out.returncode == 1 and "not delivered" in out.stderr and "Traceback" not in out.stderr, out.stderr

        record_stack(home, kafka_bootstrap, topics, tmp_path / "store")  # the broker answers again
        out = _run([str(venv / "bin" / "areal-metrics"), "sync"], cwd=elsewhere, env=env)
        assert out.returncode == 0 and "synced 6 event(s)" in out.stdout, out.stdout + out.stderr[-3000:]
        wait_for(lambda: len(steps("offline-day")) == 4, 120, "the synced run's 4 steps")
        assert steps("offline-day") == [(s, 0.25 * s) for s in range(4)]
        again = _run([str(venv / "bin" / "areal-metrics"), "sync"], cwd=elsewhere, env=env)
        assert again.returncode == 0 and "synced 0 event(s)" in again.stdout
    finally:
        stop(sink)
