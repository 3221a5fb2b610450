"""A message whose state the broker refuses, end to end: the real worker process, the real broker.

A vote round holds every replica's verdicts in the run's state until the round completes, and that
state is one record of the table's changelog. A result large enough makes a record over the
changelog topic's `max.message.bytes`: the broker refuses it. The worker must not commit its inputs
past a state that was never kept, and must not stop for good either: its batch crashes the worker
(record_batches.RecordRefused), the restarted worker takes the batch apart, and the one message that
keeps failing is dead-lettered with a `poison_message` alert (producers/runtime/poison.py), while the
good events of the same batch are processed. Here the restarts are made by the test, as `up`'s
supervisor makes them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_metrics.producers.contract.events import EvalEvent, StepEvent
from areal_metrics.producers.contract.topics import TopicSpec, Topics
from areal_metrics.stack.kafka_broker import create_topics
from areal_metrics.streams.shell.app import app_id_for
from tests.test_streams_e2e import Msg, OutputReader, Worker, produce

pytestmark = pytest.mark.broker

T0 = 1_790_000_000.0
CHANGELOG_MAX_BYTES = 20_000  # a small limit, so that a few thousand verdicts are over it
BIG_VERDICTS = 40_000  # ~2 bytes of state each (a 6,000-verdict round wrote a 12 KB record): ~80 KB


def _step(run: str, step: int) -> Msg:
    ev = StepEvent(run_id=run, node="n0", step=step, epoch=0, reward=0.1 * step, ts=T0 + step,
                   event_id=f"{run}-s{step}")
    return Msg("", run.encode(), ev.to_json())


def test_a_state_record_the_broker_refuses_dead_letters_its_message_and_the_rest_goes_on(
        kafka_bootstrap: str, topics: Topics, stack_env: dict[str, str], tmp_path: Path) -> None:
    changelog = f"{app_id_for(topics.prefix)}-runs-changelog"
    create_topics(kafka_bootstrap, [TopicSpec(changelog, 1, {"cleanup.policy": "compact",
                                                             "max.message.bytes": str(CHANGELOG_MAX_BYTES)})],
                  partitions=3)
    big = EvalEvent(run_id="big", node="n0", eval_id="e1", step=1, dataset="math500", status="ok",
                    verdicts=[i % 2 for i in range(BIG_VERDICTS)], accuracy=0.5, replicas=2, ts=T0,
                    event_id="big-e1-n0")
    assert len(big.to_json()) < 1_000_000  # the input itself is fine: only the state it makes is too large
    msgs = [Msg(topics.steps, m.key, m.value) for m in (_step("before", i) for i in range(5))]
    msgs.append(Msg(topics.evals, b"big", big.to_json()))
    msgs += [Msg(topics.steps, m.key, m.value) for m in (_step("after", i) for i in range(5))]
    produce(kafka_bootstrap, msgs)

    cfg = tmp_path / "streams.json"
    cfg.write_text(json.dumps({"defaults": {"stall_seconds": 0}, "tick_interval_s": 0.5}))
    env = {**stack_env, "AREAL_STREAMS_CONFIG": str(cfg), "AREAL_STREAMS_SESSION_TIMEOUT": "6",
           "AREAL_STREAMS_COMMIT_INTERVAL": "0.5", "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "worker.log"
    worker = Worker(env, log)
    reader = OutputReader(kafka_bootstrap, topics)
    exits = []
    try:
        for _ in range(2):  # the batch crashes the worker; then the message alone does
            worker.start()
            assert worker.proc is not None
            exits.append(worker.proc.wait(120))
        worker.start()  # the third start skips it
        reader.wait_for({topics.smoothed: 10, topics.deadletter: 1}, timeout=120)
        reader.settle(3.0)
    finally:
        rc = worker.stop()
        reader.close()
    text = log.read_text()
    assert all(code != 0 for code in exits) and rc == 0, (exits, rc, text[-3000:])
    assert text.count("RecordRefused: MessageSizeTooLargeError") >= 2, text[-3000:]  # each crash says why

    got = reader.distinct()
    smoothed = sorted((e["run_id"], e["step"]) for e in got[topics.smoothed].values())
    assert smoothed == [(run, s) for run in ("after", "before") for s in range(5)]
    [dead] = got[topics.deadletter].values()
    assert dead["reason"].startswith(f"{topics.evals}/") and "crashed the stream worker 2 times" in dead["reason"]
    assert dead["run_id"] == "big"
    poison = [a for a in got[topics.alerts].values() if a["kind"] == "poison_message"]
    assert [(a["run_id"], a["severity"]) for a in poison] == [("big", "critical")]
