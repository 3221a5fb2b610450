"""Issue 13 on the real broker: a vote round whose dataset and eval_id contain `|`.

One result before a worker restart, one after: the restarted worker reloads the open
round from its changelog (through areal_metrics.streams.state.codec) and emits ONE consensus with both
votes, naming the round exactly as the trainers did.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_metrics.producers.contract.events import EvalEvent, StepEvent
from areal_metrics.producers.contract.topics import Topics
from tests.test_streams_e2e import Msg, OutputReader, Worker, produce

pytestmark = pytest.mark.broker

RUN = "run-sep"
EVAL_ID = "e|1|x"
DATASET = "math|500"


def result(node: str, accuracy: float) -> EvalEvent:
    return EvalEvent(run_id=RUN, node=node, eval_id=EVAL_ID, step=10, dataset=DATASET, stage="full",
                     accuracy=accuracy, replicas=2, ts=1_790_000_000.0, event_id=f"sep-{node}")


def test_round_with_separators_votes_across_a_restart(kafka_bootstrap: str, topics: Topics, stack_env, tmp_path: Path):
    cfg = tmp_path / "streams.json"
    cfg.write_text(json.dumps({"defaults": {"vote_timeout_s": 600, "stall_seconds": 0, "window": 2}}))
    env = {**stack_env, "AREAL_STREAMS_CONFIG": str(cfg), "AREAL_STREAMS_SESSION_TIMEOUT": "6"}
    log = tmp_path / "worker.log"
    reader = OutputReader(kafka_bootstrap, topics)

    def step(n: int) -> Msg:
        ev = StepEvent(run_id=RUN, node="n0", step=n, epoch=0, reward=0.5, ts=1_790_000_000.0, event_id=f"sep-s{n}")
        return Msg(topics.steps, RUN.encode(), ev.to_json())

    first = Worker(env, log)
    first.start()
    try:
        # The step after the result is on the same partition: once its point is out, the
        # open round has been written to the table.
        produce(kafka_bootstrap, [Msg(topics.evals, RUN.encode(), result("n0", 0.5).to_json())])
        produce(kafka_bootstrap, [step(0)])
        reader.wait_for({topics.smoothed: 1}, timeout=60)
    finally:
        assert first.stop() == 0, log.read_text()[-3000:]
    assert topics.consensus not in reader.distinct()

    second = Worker(env, log)
    second.start()
    try:
        produce(kafka_bootstrap, [Msg(topics.evals, RUN.encode(), result("n1", 0.52).to_json()), step(1)])
        reader.wait_for({topics.consensus: 1, topics.smoothed: 2}, timeout=60)
        reader.settle(3.0)  # a few ticks of the restarted worker over the reloaded state
    finally:
        rc = second.stop()
        reader.close()
    assert rc == 0, log.read_text()[-3000:]
    consensus = [v for t, _, _, v in reader.got if t == topics.consensus]
    assert len({c["event_id"] for c in consensus}) == 1
    c = consensus[0]
    assert (c["run_id"], c["eval_id"], c["dataset"], c["stage"]) == (RUN, EVAL_ID, DATASET, "full")
    assert c["votes"] == 2 and c["replicas"] == 2 and not c["partial"] and not c["stale"]
    assert c["accuracy"] == pytest.approx(0.51)
    assert topics.deadletter not in reader.distinct()
    text = log.read_text()
    assert "Traceback" not in text and "does not decode" not in text, text[-3000:]
