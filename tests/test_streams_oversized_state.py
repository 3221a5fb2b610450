"""A message whose state would be too large to keep, end to end: the real worker process, the real broker.

A vote round holds every replica's verdicts and sample ids in the run's state until the round is
decided, and that state is one record of the table's changelog. A record over the changelog topic's
`max.message.bytes` is refused by the broker, and a state the broker refused is a state lost.

- The worker bounds its state records by the smaller of AREAL_WORKER_STATE_RECORD_MAX_BYTES and the
  changelog's limit as it finds it at start (a changelog made before keeps its limit): the message
  that would make a larger record is dead-lettered, with a reason that gives the sizes, and the good
  events around it are processed. No crash.
- A limit lowered under a running worker: the broker refuses the record, the batch crashes the worker
  (record_batches.RecordRefused) instead of committing its inputs past a state never kept, and the
  restarted worker, which reads the new limit, takes the batch apart and dead-letters the one
  message (the restart made by the test, as `up`'s supervisor makes it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_metrics.producers.contract.events import EvalEvent, StepEvent
from areal_metrics.producers.contract.topics import TopicSpec, Topics
from areal_metrics.stack.kafka_broker import create_topics
from areal_metrics.streams.shell.app import app_id_for
from areal_metrics.streams.shell.kafka_admin import max_message_bytes
from tests.test_streams_e2e import Msg, OutputReader, Worker, produce

pytestmark = pytest.mark.broker

T0 = 1_790_000_000.0
LIMIT = 20_000  # a small limit, so that a few tens of thousands of verdicts are over it
BIG_VERDICTS = 40_000  # ~2 bytes of state each (a 6,000-verdict result wrote a 12 KB record): ~80 KB


def _steps(topics: Topics, run: str) -> list[Msg]:
    return [Msg(topics.steps, run.encode(), StepEvent(run_id=run, node="n0", step=i, epoch=0, reward=0.1 * i,
                                                      ts=T0 + i, event_id=f"{run}-s{i}").to_json())
            for i in range(5)]


def _big_result(topics: Topics) -> Msg:
    big = EvalEvent(run_id="big", node="n0", eval_id="e1", step=1, dataset="math500", status="ok",
                    verdicts=[i % 2 for i in range(BIG_VERDICTS)], accuracy=0.5, replicas=2, ts=T0,
                    event_id="big-e1-n0")
    assert len(big.to_json()) < 1_000_000  # the input itself is fine: only the state it makes is too large
    return Msg(topics.evals, b"big", big.to_json())


def _env(stack_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    cfg = tmp_path / "streams.json"
    cfg.write_text(json.dumps({"defaults": {"stall_seconds": 0}, "tick_interval_s": 0.5}))
    return {**stack_env, "AREAL_STREAMS_CONFIG": str(cfg), "AREAL_STREAMS_SESSION_TIMEOUT": "6",
            "AREAL_STREAMS_COMMIT_INTERVAL": "0.5", "PYTHONUNBUFFERED": "1"}


def _changelog(topics: Topics) -> str:
    return f"{app_id_for(topics.prefix)}-runs-changelog"


def _set_limit(bootstrap: str, topic: str, limit: int) -> None:
    from kafka import KafkaAdminClient
    from kafka.admin import ConfigResource, ConfigResourceType

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, configs={"max.message.bytes": str(limit)})])
    finally:
        admin.close()


def _wait_for_the_letter(reader: OutputReader, topics: Topics) -> None:
    """The ten steps smoothed and the one dead letter, and nothing more a moment later."""
    reader.wait_for({topics.smoothed: 10, topics.deadletter: 1}, timeout=120)
    reader.settle(2.0)


def _check_outputs(reader: OutputReader, topics: Topics) -> dict:
    got = reader.distinct()
    smoothed = sorted((e["run_id"], e["step"]) for e in got[topics.smoothed].values())
    assert smoothed == [(run, s) for run in ("after", "before") for s in range(5)]
    [dead] = got[topics.deadletter].values()
    assert dead["run_id"] == "big" and dead["source_topic"] == topics.evals
    assert dead["reason"].startswith("evals: not processed: the run's state record 'round' would be "), dead["reason"]
    assert f"over the {LIMIT:,} a state record may take" in dead["reason"]
    return got


def test_a_message_whose_state_record_would_be_over_the_changelogs_limit_is_dead_lettered_without_a_crash(
        kafka_bootstrap: str, topics: Topics, stack_env: dict[str, str], tmp_path: Path) -> None:
    """The changelog made before with a limit of its own (20,000 bytes): the worker finds it at start."""
    create_topics(kafka_bootstrap, [TopicSpec(_changelog(topics), 1, {"cleanup.policy": "compact",
                                                                      "max.message.bytes": str(LIMIT)})],
                  partitions=3)
    produce(kafka_bootstrap, [*_steps(topics, "before"), _big_result(topics), *_steps(topics, "after")])
    log = tmp_path / "worker.log"
    worker = Worker(_env(stack_env, tmp_path), log)
    reader = OutputReader(kafka_bootstrap, topics)
    worker.start()
    try:
        _wait_for_the_letter(reader, topics)
    finally:
        rc = worker.stop()
        reader.close()
    text = log.read_text()
    assert rc == 0 and "RecordRefused" not in text, text[-3000:]  # the bound kept the broker from refusing
    assert f"takes records of {LIMIT} bytes" in text  # the start says which limit applies
    got = _check_outputs(reader, topics)
    # a dead letter of the input's doing: its rate-limited invalid_event alert, no poison_message
    assert [a["kind"] for a in got[topics.alerts].values()] == ["invalid_event"]


def test_a_limit_lowered_under_a_running_worker_crashes_the_batch_once_then_dead_letters_the_message(
        kafka_bootstrap: str, topics: Topics, stack_env: dict[str, str], tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    worker = Worker(_env(stack_env, tmp_path), log)
    reader = OutputReader(kafka_bootstrap, topics)
    produce(kafka_bootstrap, _steps(topics, "before"))
    worker.start()
    try:
        reader.wait_for({topics.smoothed: 5}, timeout=120)
        # the worker made its changelog to take its largest state record (AREAL_WORKER_STATE_RECORD_MAX_BYTES)
        assert max_message_bytes(kafka_bootstrap, _changelog(topics)) == 8 << 20
        _set_limit(kafka_bootstrap, _changelog(topics), LIMIT)
        produce(kafka_bootstrap, [_big_result(topics), *_steps(topics, "after")])
        assert worker.proc is not None
        assert worker.proc.wait(120) != 0  # the broker refused the round's record: the batch crashed
        worker.start()  # as up's supervisor restarts it
        _wait_for_the_letter(reader, topics)
    finally:
        rc = worker.stop()
        reader.close()
    text = log.read_text()
    assert rc == 0 and text.count("RecordRefused: MessageSizeTooLargeError") == 1, text[-3000:]
    _check_outputs(reader, topics)
