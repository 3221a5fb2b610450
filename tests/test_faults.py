"""Faults during a live training run, with the real broker, trainer, worker and sink.

- The broker stops and restarts while two ranks train: the publishers journal
  and re-send; every step event reaches ClickHouse exactly once.
- A rank of one run is killed with SIGKILL: the other run's events keep
  flowing, and the stream worker raises a critical alert for the dead run:
  `run_killed` or `run_failed` when its surviving rank reports the end (SIGTERM
  from the launcher, or gloo's error), `stalled` when it dies without a word.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable

import pytest
from kafka import KafkaConsumer

from areal_metrics.areal_train.config import TrainConfig
from areal_metrics.areal_train.launch import start
from areal_metrics.producers.contract.events import StepEvent, parse_event
from areal_metrics.producers.contract.settings import Settings
from tests.support import start_service, stop_process

pytestmark = [pytest.mark.broker, pytest.mark.timeout(720)]

# A short warm start for the fault tests (one cached build, shared with test_cluster_faults):
# delivery is under test, not learning, and the trainer's 3,000-step default took 10-12 min to
# build on a fresh 2-core machine, inside the first fault test's timeout.
FAULT_WARMSTART_STEPS = 300
QUIET_TRAINING = TrainConfig(eval_every_steps=None, eval_at_start=False, eval_at_end=False, batch_prompts=4,
                             warmstart_steps=FAULT_WARMSTART_STEPS)


def consume_steps(bootstrap: str, topic: str, run_id: str, until: int, timeout: float,
                  where: Callable[[StepEvent], bool] = lambda e: True) -> list:
    """`run_id`'s step events (those `where` keeps) from the start, until `until` distinct ones or `timeout`."""
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             enable_auto_commit=False, group_id=None)
    out = []
    deadline = time.monotonic() + timeout
    try:
        while len({e.event_id for e in out}) < until and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                out.extend(e for e in (parse_event(r.value) for r in records) if e.run_id == run_id and where(e))
    finally:
        consumer.close()
    return out


# Ranks can take minutes to start on a loaded machine (torch import, gloo rendezvous). A
# fault must land on a run that trains: `make fault-soak` once killed a rank of a run that
# had published no step yet (the wait below used to end silently after 90 s), and the
# worker, which had never heard of the run, rightly raised no `stalled` for it.
STARTUP_S = 300


def until_training(bootstrap: str, topic: str, run_id: str, events: int) -> None:
    """Wait until `run_id` published `events` step events; fail if its ranks never got there."""
    seen = {e.event_id for e in consume_steps(bootstrap, topic, run_id, until=events, timeout=STARTUP_S)}
    assert len(seen) >= events, f"{run_id}: {len(seen)} step events after {STARTUP_S} s; its ranks did not start"


def test_broker_restart_during_training_loses_nothing_and_counts_nothing_twice(kafka_broker, topics, stack_env,
                                                                               tmp_path):
    steps, nproc = 250, 2
    run = start("fault-broker", nproc, steps, QUIET_TRAINING, env=stack_env, log_dir=tmp_path / "logs")
    try:
        # let the ranks publish, then take the broker away while they train on
        until_training(kafka_broker.bootstrap, topics.steps, "fault-broker", events=20)
        kafka_broker.stop()
        time.sleep(3)
        assert run.poll() is None, "training must not stall or fail while the broker is away"
        kafka_broker.start(timeout=120)
        assert run.wait(timeout=180) == 0
    finally:
        run.terminate()
        if kafka_broker.process is None:
            kafka_broker.start(timeout=120)

    events = consume_steps(kafka_broker.bootstrap, topics.steps, "fault-broker", until=steps * nproc, timeout=60)
    by_rank_step: dict[tuple[int, int], set[str]] = {}
    for e in events:
        by_rank_step.setdefault((e.rank, e.step), set()).add(e.event_id)
    assert len(by_rank_step) == steps * nproc  # no step of any rank lost
    assert all(len(ids) == 1 for ids in by_rank_step.values())  # a re-send keeps its event_id

    # The sink projects the log into ClickHouse: each step exactly once with FINAL.
    sink = start_service("areal_metrics.sinks", stack_env, tmp_path / "sink.log")
    try:
        from areal_metrics.sinks.query import Target, connect, read_owner

        store_path = Target.parse(stack_env["AREAL_CLICKHOUSE_URL"]).path
        deadline = time.monotonic() + 60
        while read_owner(store_path) is None:  # the sink holds the store: ask it, do not open it
            assert time.monotonic() < deadline and sink.poll() is None, "the sink did not start"
            time.sleep(0.2)
        settings = Settings(kafka_bootstrap=kafka_broker.bootstrap, clickhouse_url=stack_env["AREAL_CLICKHOUSE_URL"],
                            topic_prefix=topics.prefix)
        deadline = time.monotonic() + 90
        rows = 0
        while time.monotonic() < deadline:
            with connect(settings, wait_s=30) as store:
                rows = int(store.command("SELECT count() FROM steps FINAL WHERE run_id = 'fault-broker'"))
                unique = int(store.command("SELECT uniqExact(rank, step) FROM steps FINAL WHERE run_id = 'fault-broker'"))
            if rows >= steps * nproc:
                break
            time.sleep(1)
        assert (rows, unique) == (steps * nproc, steps * nproc)
    finally:
        stop_process(sink)


def test_a_dead_rank_ends_its_run_with_a_critical_alert_while_other_runs_flow(kafka_bootstrap, topics, stack_env, tmp_path):
    config = tmp_path / "streams.json"
    config.write_text(json.dumps({"defaults": {"stall_seconds": 4}, "tick_interval_s": 0.5}))
    env = {**stack_env, "AREAL_STREAMS_CONFIG": str(config)}
    worker = start_service("areal_metrics.streams", env, tmp_path / "worker.log")
    victim = start("fault-dead", 2, 100_000, QUIET_TRAINING, env=env, log_dir=tmp_path / "logs")
    survivor = start("fault-alive", 1, 100_000, QUIET_TRAINING, env=env, log_dir=tmp_path / "logs")
    alerts = KafkaConsumer(topics.alerts, bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest",
                           enable_auto_commit=False, group_id=None)
    try:
        until_training(kafka_bootstrap, topics.steps, "fault-dead", events=20)
        killed_at = time.time()
        os.kill(victim.rank_pids()[1], signal.SIGKILL)  # rank 1 dies; its run cannot go on without it
        # The launcher tears the run's other rank down, which reports the run `killed`: the
        # worker says so (`run_killed`); a run whose other ranks hung instead would be `stalled`.
        died = []
        deadline = time.monotonic() + 90
        while not died and time.monotonic() < deadline:
            for records in alerts.poll(timeout_ms=500).values():
                died += [a for a in (parse_event(r.value) for r in records)
                         if a.kind in ("run_killed", "run_failed", "stalled") and a.run_id == "fault-dead"]
        assert died, "the worker raised no alert for the run whose rank died"
        assert died[0].severity == "critical"
        assert victim.wait(timeout=60) != 0  # the run's other rank was stopped, not left hanging on its dead peer

        # The other run kept publishing after the death, and is not stalled.
        assert survivor.poll() is None
        later = consume_steps(kafka_bootstrap, topics.steps, "fault-alive", until=1, timeout=60,
                              where=lambda e: e.ts > killed_at + 1)
        assert later, "the surviving run stopped publishing"
        for records in alerts.poll(timeout_ms=500).values():
            for a in (parse_event(r.value) for r in records):
                assert not (a.kind == "stalled" and a.run_id == "fault-alive")
    finally:
        alerts.close()
        victim.terminate()
        survivor.terminate()
        stop_process(worker)
