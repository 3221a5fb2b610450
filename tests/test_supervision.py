"""A crash never loops: the rules that find the message a service died on (pure), the
supervisor's restart rule (pure), and the whole stack of `areal-metrics up` with a worker and
a sink that each die on one message, on a real broker (CONTRACT.md, "No input stops the pipeline")."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from areal_metrics.producers.contract.events import ALERT_KINDS, AlertEvent, RejectedEvent, StepEvent, parse_event
from areal_metrics.producers.runtime.backoff import Backoff
from areal_metrics.producers.runtime.poison import (
    ALONE,
    OK,
    POISON,
    CrashGuard,
    Suspect,
    after_crash,
    crash_marker,
    forget,
    poison_events,
    spans,
    verdict,
)
from areal_metrics.stack.supervisor import RestartPolicy, next_step
from tests.support import cli, wait_for

# ------------------------------------------------------------------ the rules


def test_spans_are_each_partitions_first_and_last_offset() -> None:
    positions = [("s", 1, 5), ("s", 0, 3), ("s", 1, 6), ("e", 0, 9), ("s", 1, 7), ("s", 0, 4)]  # each in log order
    assert spans(positions) == [("e", 0, 9, 9), ("s", 0, 3, 4), ("s", 1, 5, 7)]


def test_a_crash_makes_its_batch_suspect_and_a_second_makes_the_message_alone_in_it_poison() -> None:
    first = after_crash((), [("s", 0, 10, 14)])
    assert first == (Suspect("s", 0, 10, 14, 1),)
    assert [verdict(first, "s", 0, o, 2) for o in (9, 10, 12, 14, 15)] == [OK, ALONE, ALONE, ALONE, OK]
    assert verdict(first, "s", 1, 12, 2) == OK  # another partition
    assert verdict(first, "e", 0, 12, 2) == OK  # another topic
    second = after_crash(first, [("s", 0, 12, 12)])  # processed alone, it crashed again
    assert verdict(second, "s", 0, 12, 2) == POISON
    assert [verdict(second, "s", 0, o, 2) for o in (10, 11, 13)] == [ALONE, ALONE, ALONE]
    assert verdict(second, "s", 0, 12, 3) == ALONE  # AREAL_POISON_CRASHES=3: one crash more first
    assert verdict(after_crash(second, [("s", 0, 12, 12)]), "s", 0, 12, 3) == POISON


def test_suspects_are_forgotten_once_every_offset_is_processed() -> None:
    suspects = (Suspect("s", 0, 10, 14, 1), Suspect("s", 1, 3, 3, 1))
    assert forget(suspects, {("s", 0): 12}) == suspects  # 13 and 14 still to come
    assert forget(suspects, {("s", 0): 14}) == (Suspect("s", 1, 3, 3, 1),)
    assert forget(suspects, {("e", 0): 99}) == suspects


def test_the_guard_keeps_its_record_across_a_crash_and_not_across_a_clean_end(tmp_path: Path) -> None:
    guard = CrashGuard(tmp_path, limit=2, service="worker")
    assert guard.start() == []
    guard.begin([("s", 0, 10, 14)])
    guard.end([("s", 0, 10, 14)])  # processed: nothing counts
    assert CrashGuard(tmp_path).start() == [] and not CrashGuard(tmp_path).suspects
    guard.begin([("s", 0, 10, 14)])  # ... and the process dies here
    again = CrashGuard(tmp_path, limit=2)
    assert again.start() == [("s", 0, 10, 14)]
    assert again.verdict("s", 0, 11) == ALONE
    again.begin([("s", 0, 11, 11)])  # dies again, on 11 alone
    third = CrashGuard(tmp_path, limit=2)
    third.start()
    assert (third.verdict("s", 0, 10), third.verdict("s", 0, 11), third.crashes("s", 0, 11)) == (ALONE, POISON, 2)
    third.end([("s", 0, 10, 14)])
    assert CrashGuard(tmp_path).start() == [] and not CrashGuard(tmp_path).suspects
    (tmp_path / "inflight.json").write_text('[["s", 0, 1')  # torn while written: nothing was processed yet
    assert CrashGuard(tmp_path).start() == []


def test_a_stop_past_its_bound_is_not_a_crash_of_the_batch_in_flight(tmp_path: Path) -> None:
    """The stream worker's bounded stop (streams/shell/faust_internals.py) abandons its batch before it exits."""
    import subprocess
    import sys
    import textwrap

    from tests.support import ROOT

    guard = CrashGuard(tmp_path, limit=2, service="worker")
    guard.start()
    guard.begin([("s", 0, 10, 14)])
    guard.abandon()
    assert CrashGuard(tmp_path).start() == []
    # the event loop may begin one more batch between the timer's abandon and its exit: not recorded either
    guard.begin([("s", 0, 15, 19)])
    assert CrashGuard(tmp_path).start() == []
    # in a process: the bound's timer writes why, abandons, and exits 1 while the main thread still waits
    script = textwrap.dedent(f"""
        import time
        from areal_metrics.producers.runtime.poison import CrashGuard
        from areal_metrics.streams.shell.faust_internals import exit_unless_stopped
        guard = CrashGuard({str(tmp_path)!r}, limit=2, service="worker")
        guard.start()
        guard.begin([("s", 0, 20, 24)])
        exit_unless_stopped(0.5, "not stopped in 0.5 s", guard.abandon)
        time.sleep(60)  # a stop that waits for good
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr.strip()) == (1, "not stopped in 0.5 s")
    assert CrashGuard(tmp_path).start() == []
    # without the abandon, the same death counts against the batch
    killed = subprocess.run([sys.executable, "-c", script.replace(", guard.abandon)", ")")], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert killed.returncode == 1 and CrashGuard(tmp_path).start() == [("s", 0, 20, 24)]


def test_a_stop_without_a_signal_is_bounded_too_and_keeps_its_batch_counted() -> None:
    """A crash of the worker's app services leads to Faust's stop by `on_worker_shutdown`, not by a signal:
    bounded the same way, and (a crash is a crash) without abandoning the batch in flight."""
    import subprocess
    import sys
    import textwrap

    from tests.support import ROOT

    script = textwrap.dedent("""
        import time, faust
        from areal_metrics.streams.shell.faust_internals import BoundedStopWorker
        app = faust.App("bounded-test", broker="kafka://127.0.0.1:9", autodiscover=False)
        worker = BoundedStopWorker(app, loglevel="warning", quiet=True, redirect_stdouts=False,
                                   override_logging=False, stop_timeout_s=0.5,
                                   before_exit=lambda: print("abandoned", flush=True))
        worker.on_worker_shutdown()  # where a crash leads, before Faust's stop
        time.sleep(60)  # a stop that waits for good
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "abandoned" not in done.stdout, (done.stdout, done.stderr)
    assert "not stopped 0.5 s after it began to stop without a signal" in done.stderr


def test_the_guards_record_is_overwritten_in_place_and_a_torn_one_reads_as_none(tmp_path: Path) -> None:
    """The record is written over the file's start (no truncation): a shorter record after a
    longer one, and `[]` after a batch, read back as themselves; a record cut short while it is
    written (over the `[]` and spaces an ended batch leaves) names nothing in flight."""
    guard = CrashGuard(tmp_path, limit=2)
    guard.start()
    guard.begin([("steps", 0, 10, 14), ("steps", 1, 3, 9), ("evals", 2, 0, 0)])
    guard.end()
    assert json.loads((tmp_path / "inflight.json").read_bytes()) == []  # nothing in flight between batches
    guard.begin([("steps", 2, 7, 7)])  # shorter than the file: the rest is spaces
    again = CrashGuard(tmp_path, limit=2)  # the process died here
    assert again.start() == [("steps", 2, 7, 7)]
    assert again.crashes("steps", 2, 7) == 1 and again.crashes("steps", 0, 12) == 0
    ended = b"[]" + b" " * 40
    record = json.dumps([["steps", 0, 20, 29]]).encode()
    for cut in range(len(record)):  # a crash while the record was written over an ended batch's
        (tmp_path / "inflight.json").write_bytes(record[:cut] + ended[cut:])
        assert CrashGuard(tmp_path).start() == [], cut


def test_poison_events_name_the_position_and_keep_their_ids() -> None:
    dead, alert = poison_events(b'{"run_id": "r1", "deep": [[[[', b"r1", "areal.steps", 2, 41, 2, service="sink",
                                node="sink@h", ts=5.0, now=9.0)
    again, alert_again = poison_events(b"other", b"r1", "areal.steps", 2, 41, 3, service="sink", node="sink@h", ts=6.0,
                                       now=9.0)
    assert isinstance(dead, RejectedEvent) and dead.run_id == "r1" and dead.source_topic == "areal.steps"
    assert "areal.steps/2/41" in dead.reason and "crashed the sink 2 times" in dead.reason
    assert dead.raw == '{"run_id": "r1", "deep": [[[['
    assert alert.kind == "poison_message" and alert.kind in ALERT_KINDS and alert.severity == "critical"
    assert "topic areal.steps, partition 2, offset 41" in alert.message
    assert (again.event_id, alert_again.alert_id) == (dead.event_id, alert.alert_id)
    assert parse_event(alert.to_json(), expected=AlertEvent) == alert


@pytest.mark.parametrize("ts", [32503680000.0, 1e300, float("inf"), -1.0, float("nan"), None])
def test_a_poison_message_with_any_log_time_still_gets_its_dead_letter_and_alert(ts: float | None) -> None:
    """A producer sets the Kafka timestamp it likes (year 3000, -1, none): the poison path must still
    make its events, or the message that stopped the service twice stops it for good."""
    from areal_metrics.producers.contract.deadletter import TS_MAX

    dead, alert = poison_events(b"x", b"r1", "areal.steps", 0, 7, 2, service="sink", node="sink@h", ts=ts, now=5.0)
    assert dead.ts == alert.ts == (5.0 if ts is None or not ts >= 0 else TS_MAX)
    assert parse_event(dead.to_json(), expected=RejectedEvent) == dead
    assert parse_event(alert.to_json(), expected=AlertEvent) == alert


def test_the_crash_hook_names_a_service() -> None:
    assert crash_marker("worker", "worker:BOOM") == b"BOOM"
    assert crash_marker("sink", "worker:BOOM,sink:BANG") == b"BANG"
    assert crash_marker("sink", "worker:BOOM") is None and crash_marker("worker", None) is None


def test_restarts_back_off_stop_on_a_clean_or_configuration_exit_and_are_bounded() -> None:
    policy = RestartPolicy(max_in_a_row=3, backoff=Backoff(1.0, 2.0, 30.0), healthy_s=60.0)
    assert next_step(policy, 0, 5.0, 0) == (False, 0.0, 0)  # stopped
    assert next_step(policy, 2, 5.0, 0) == (False, 0.0, 0)  # a setting no restart can pass
    assert next_step(policy, 70, 5.0, 0) == (True, 1.0, 1)
    assert next_step(policy, -9, 5.0, 1) == (True, 2.0, 2)
    assert next_step(policy, 1, 5.0, 2) == (True, 4.0, 3)
    assert next_step(policy, 1, 5.0, 3) == (False, 0.0, 3)  # gives up
    assert next_step(policy, 1, 300.0, 3) == (True, 1.0, 1)  # ran a while: the count starts again


# ------------------------------------------------------------------ the stack


def _status(env: dict[str, str]) -> dict:
    return json.loads(cli("status", "--json", env=env).stdout)


def _read(bootstrap: str, *topics: str) -> list:
    from tests.kafka_reading import read_to_end

    return read_to_end(bootstrap, *topics)


@pytest.mark.broker
def test_a_message_that_crashes_a_service_twice_is_dead_lettered_once_and_skipped(tmp_path: Path) -> None:
    """`up` with a worker and a sink that each die on one message (AREAL_TEST_CRASH_ON): each is
    restarted twice, then dead-letters its message once with a `poison_message` alert, and the
    good events after it are processed; `status --json` shows the restarts."""
    from kafka import KafkaProducer

    prefix = "sup."
    env = {**os.environ, "AREAL_HOME": str(tmp_path / "home"), "AREAL_TOPIC_PREFIX": prefix,
           "AREAL_TEST_CRASH_ON": "worker:crash-the-worker,sink:crash-the-sink", "AREAL_RESTART_BACKOFF_S": "0.2",
           "AREAL_STREAMS_SESSION_TIMEOUT": "6", "PYTHONUNBUFFERED": "1"}
    for name in ("AREAL_KAFKA_BOOTSTRAP", "AREAL_CLICKHOUSE_URL"):
        env.pop(name, None)
    try:
        up = cli("up", "--partitions", "1", env=env, timeout=300)
        assert up.returncode == 0, up.stderr
        bootstrap = _status(env)["kafka_bootstrap"]
        steps = f"{prefix}steps"
        producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")

        def step(run: str, i: int, node: str = "n0") -> None:
            e = StepEvent(run_id=run, node=node, step=i, epoch=0, reward=i / 10)
            producer.send(steps, key=run.encode(), value=e.to_json()).get(30)

        for i in range(5):
            step("before", i)
        step("bad-w", 0, node="crash-the-worker")  # offset 5
        step("bad-s", 0, node="crash-the-sink")  # offset 6
        for i in range(5):
            step("after", i)
        producer.close()

        def poisoned() -> bool:
            procs = _status(env).get("processes", {})
            return all(procs.get(s, {}).get("restarts") == 2 and procs[s]["alive"] for s in ("worker", "sink"))

        wait_for(poisoned, 240, "two restarts of each service")
        smoothed = wait_for(lambda: (got := [parse_event(m.value) for m in _read(bootstrap, f"{prefix}rewards.smoothed")
                                             if parse_event(m.value).run_id == "after"]) and len(got) >= 5 and got,
                            120, "the steps after the poison message, smoothed")
        assert sorted({e.step for e in smoothed}) == [0, 1, 2, 3, 4]

        def letters() -> dict:
            found: dict[str, dict[str, object]] = {}
            for m in _read(bootstrap, f"{prefix}deadletter", f"{prefix}alerts"):
                e = parse_event(m.value)
                if isinstance(e, RejectedEvent) or (isinstance(e, AlertEvent) and e.kind == "poison_message"):
                    found.setdefault(e.event_id, {"event": e, "copies": 0})["copies"] += 1  # type: ignore[operator]
            return found

        found = wait_for(lambda: (f := letters()) and len(f) >= 4 and f, 60, "the dead letters and alerts")
        events = [v["event"] for v in found.values()]
        dead = sorted((e for e in events if isinstance(e, RejectedEvent)), key=lambda e: e.reason)
        alerts = sorted((e for e in events if isinstance(e, AlertEvent)), key=lambda e: e.message)
        assert [d.reason.split(":")[0] for d in dead] == [f"{steps}/0/5", f"{steps}/0/6"]  # the worker's, the sink's
        assert "crashed the stream worker 2 times" in dead[0].reason and "crashed the sink 2 times" in dead[1].reason
        assert [d.run_id for d in dead] == ["bad-w", "bad-s"]
        assert [(a.kind, a.severity) for a in alerts] == [("poison_message", "critical")] * 2
        assert [a.message.split(":")[1].strip() for a in alerts] == [
            f"topic {steps}, partition 0, offset 6; dead-lettered and skipped",
            f"topic {steps}, partition 0, offset 5; dead-lettered and skipped"]

        # stored once each; the sink stored every good step (and the worker's poison, which it could store)
        def stored(sql: str) -> str:
            r = cli("sql", "--format", "tsv", sql, env=env)
            assert r.returncode == 0, r.stderr
            return r.stdout.strip().partition("\n")[2]  # without the header line

        crashed = "SELECT source_topic, count() FROM deadletter FINAL WHERE reason LIKE '%crashed the%' GROUP BY 1"
        poisons = "SELECT kind, severity, count() FROM alerts FINAL WHERE kind = 'poison_message' GROUP BY 1, 2"
        wait_for(lambda: stored(crashed).endswith("\t2") and stored(poisons).endswith("\t2"), 60, "the letters stored")
        assert (stored(crashed), stored(poisons)) == (f"{steps}\t2", "poison_message\tcritical\t2")
        assert stored("SELECT run_id, count() FROM steps FINAL GROUP BY run_id ORDER BY run_id") == \
            "after\t5\nbad-w\t1\nbefore\t5"
        plain = cli("status", env=env).stdout
        assert "worker pid" in plain and "(restarts 2)" in plain
    finally:
        down = cli("down", env=env)
    assert down.returncode == 0
    logs = (tmp_path / "home" / "logs" / "worker.log").read_text()
    assert logs.count("crashing on sup.steps/0/5") == 2, logs[-3000:]
