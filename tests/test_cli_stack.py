"""The CLI and the local stack, run as a user runs them (subprocesses)."""

import json
import os
import signal
import time

import pytest

from areal_metrics.producers.contract.events import parse_event
from tests.kafka_reading import read_to_end
from tests.support import cli



@pytest.mark.parametrize(
    "args",
    [["bogus"], ["up", "--partitions", "0"], ["up", "--partitions", "x"], ["status", "--nope"], []],
)
def test_bad_arguments_give_one_line_and_exit_2(args, tmp_path):
    result = cli(*args, env={**os.environ, "AREAL_HOME": str(tmp_path)})
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr
    assert "error" in result.stderr


def test_status_without_a_stack_exits_1(tmp_path):
    result = cli("status", "--json", env={**os.environ, "AREAL_HOME": str(tmp_path)})
    assert result.returncode == 1
    assert json.loads(result.stdout) == {"running": False}


@pytest.mark.broker
def test_publish_validates_dead_letters_and_exits_2(stack_env, topics, kafka_bootstrap):
    good = {"type": "command", "run_id": "r1", "command": "evaluate_now", "reason": "by hand"}
    bad = {"type": "step", "run_id": "r1", "step": -3, "epoch": 0}
    lines = json.dumps(good) + "\n" + json.dumps(bad) + "\n"
    result = cli("publish", "--fill", "-", env=stack_env, input=lines)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "areal-metrics publish: error: line 2: steps.step: must be >= 0 (sent to the dead-letter topic)")
    got = {m.topic: parse_event(m.value) for m in read_to_end(kafka_bootstrap, topics.control, topics.deadletter)}
    assert got[topics.control].command == "evaluate_now"
    assert got[topics.deadletter].reason == "steps.step: must be >= 0"
    assert json.loads(got[topics.deadletter].raw) == bad


def status_until(env, done, timeout=30.0):
    """`status` until `done(result)`: a SIGKILLed JVM takes a moment (longer on a loaded machine) to be gone."""
    deadline = time.monotonic() + timeout
    while not done(result := cli("status", env=env)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return result


def test_up_status_down_and_a_stale_pid_file(tmp_path):
    """The real stack (broker only, to stay fast): up, second up is a no-op, kill -9, up again, down."""
    env = {**os.environ, "AREAL_HOME": str(tmp_path), "AREAL_TOPIC_PREFIX": "stk."}
    env.pop("AREAL_KAFKA_BOOTSTRAP", None)
    try:
        first = cli("up", "--no-worker", "--no-sink", env=env)
        assert first.returncode == 0, first.stderr
        status = json.loads(cli("status", "--json", env=env).stdout)
        assert status["running"] and status["kafka_bootstrap"].startswith("127.0.0.1:")
        again = cli("up", "--no-worker", "--no-sink", env=env)
        assert "already running" in again.stdout
        assert json.loads(cli("status", "--json", env=env).stdout)["processes"] == status["processes"]

        os.kill(status["processes"]["kafka"]["pid"], signal.SIGKILL)  # leaves a stale pid in stack.json
        assert status_until(env, lambda r: r.returncode == 1).returncode == 1
        restarted = cli("up", "--no-worker", "--no-sink", env=env)
        assert restarted.returncode == 0 and "started" in restarted.stdout, restarted.stderr
        new_status = json.loads(cli("status", "--json", env=env).stdout)
        assert new_status["running"]
        assert new_status["kafka_bootstrap"] == status["kafka_bootstrap"]  # same port: clients keep working
    finally:
        down = cli("down", env=env)
    assert down.returncode == 0 and "kafka" in down.stdout
    assert cli("status", env=env).returncode == 1


@pytest.mark.broker
def test_alerts_prints_json_lines_filtered_by_run(stack_env, topics, kafka_bootstrap, tmp_path):
    from areal_metrics.producers.contract.events import AlertEvent
    from areal_metrics.producers.delivery.publisher import Publisher

    publisher = Publisher(kafka_bootstrap, topics, tmp_path / "journal")
    mine = AlertEvent(run_id="r1", kind="stalled", severity="critical", message="no step for 300 s")
    publisher.publish(mine)
    publisher.publish(AlertEvent(run_id="r2", kind="stalled", message="other run"))
    assert publisher.flush(30)
    publisher.close()
    result = cli("alerts", "--run", "r1", env=stack_env)
    assert result.returncode == 0, result.stderr
    assert [json.loads(line) for line in result.stdout.splitlines()] == [mine.to_dict()]
