"""`alerts --follow` as a service: SIGTERM leaves the consumer group, a restart picks up at once,
and `--timeout` holds while the group is rebalancing. Against the real broker of tests/conftest.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from areal_metrics.producers.contract.events import AlertEvent
from areal_metrics.producers.contract.topics import Topics
from tests.support import CLI, ROOT, wait_for

pytestmark = [pytest.mark.broker, pytest.mark.timeout(300)]


def _publish(bootstrap: str, topics: Topics, journal: Path, *alerts: AlertEvent) -> None:
    from areal_metrics.producers.delivery.publisher import Publisher

    publisher = Publisher(bootstrap, topics, journal)
    for a in alerts:
        publisher.publish(a)
    assert publisher.flush(30)
    publisher.close()


def _follower(env: dict[str, str], out: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([*CLI, "alerts", "--follow", *extra], env=env, cwd=ROOT, stdout=out.open("w"),
                            stderr=subprocess.PIPE, text=True)


def _ids(out: Path) -> list[str]:
    return [json.loads(line)["alert_id"] for line in out.read_text().splitlines() if line.strip()]


def _members(bootstrap: str, group: str) -> list[object]:
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        described = admin.describe_groups([group])[group]
        assert described["error"] is None, described
        return list(described["members"])
    finally:
        admin.close()


def _alert(i: int) -> AlertEvent:
    return AlertEvent(run_id="followed", kind="stalled", message=f"alert {i}", alert_id=f"f{i}")


def test_sigterm_leaves_the_group_and_a_restart_delivers_the_next_alert(
        stack_env: dict[str, str], topics: Topics, kafka_bootstrap: str, tmp_path: Path) -> None:
    group = f"follow-{topics.prefix}"
    _publish(kafka_bootstrap, topics, tmp_path / "journal", _alert(0))
    first = _follower(stack_env, tmp_path / "first.out", "--group", group)
    try:
        wait_for(lambda: _ids(tmp_path / "first.out") == ["f0"], 120, "the first follower to print f0")
        wait_for(lambda: _members(kafka_bootstrap, group), 60, "the first follower in its group")
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=60)
    assert first.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err, err
    # it said goodbye: no member of the group is left waiting for its session to expire
    assert _members(kafka_bootstrap, group) == []

    # restarted at once; the next alert arrives within its own --timeout of 10 s
    second = _follower(stack_env, tmp_path / "second.out", "--group", group, "--timeout", "10")
    _publish(kafka_bootstrap, topics, tmp_path / "journal2", _alert(1))
    _, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    assert _ids(tmp_path / "second.out") == ["f1"], err  # resumed after f0, and got f1 before its timeout


def test_timeout_holds_while_the_group_rebalances(
        stack_env: dict[str, str], topics: Topics, kafka_bootstrap: str, tmp_path: Path) -> None:
    """A member that stops polling keeps the group rebalancing for its max_poll_interval (90 s here);
    a follower with --timeout 5 that joins meanwhile stops on its own, within seconds of it."""
    from kafka import KafkaConsumer

    group = f"rebalancing-{topics.prefix}"
    stuck = KafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=group, enable_auto_commit=False,
                          max_poll_interval_ms=90_000, session_timeout_ms=45_000)
    stuck.subscribe([topics.alerts])
    try:
        wait_for(lambda: stuck.poll(timeout_ms=500) is not None and stuck.assignment(), 60, "the stuck member's partitions")
        follower = _follower(stack_env, tmp_path / "f.out", "--group", group, "--timeout", "5")
        try:
            # a generous bound (a loaded machine); without the fix a follower waits for the rebalance (90 s)
            _, err = follower.communicate(timeout=45)
        except subprocess.TimeoutExpired:
            follower.kill()
            follower.wait()
            pytest.fail("alerts --follow --timeout 5 still ran 45 s later: it waited for the rebalance")
        assert follower.returncode == 0, err
        assert "Traceback" not in err
    finally:
        stuck.close(autocommit=False, timeout_ms=2000)
