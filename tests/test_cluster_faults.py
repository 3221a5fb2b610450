"""A three-broker KRaft cluster loses a broker (SIGKILL) in the middle of a training run.

The real trainer (2 ranks, evaluation rounds voted by both), the stream worker and the
sink run against the cluster; topics have replication factor 3 and
min.insync.replicas 2. The broker that leads the run's partition of `steps` is killed
once both ranks are past step 10; the run trains on (and the worker votes on) with two
brokers for 16 more steps, then the broker is started again on its data and catches up.
Afterwards, against what the trainers themselves report (their summaries):

- 0 events lost: every (rank, step) and every eval of every round is in Kafka and in
  ClickHouse;
- 0 counted twice: ClickHouse `FINAL` holds each once (re-sends keep their event_id);
- one consensus per round: in Kafka every round has one consensus event (copies of it
  identical), in ClickHouse one row.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from typing import Any

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

from areal_metrics.areal_train.config import TrainConfig
from areal_metrics.areal_train.launch import start
from areal_metrics.producers.contract.events import CommandEvent, EvalConsensusEvent, EvalEvent, StepEvent, parse_event
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.streams.shell.app import app_id_for
from tests.support import start_service, stop_process
from tests.test_faults import FAULT_WARMSTART_STEPS, STARTUP_S

pytestmark = [pytest.mark.broker, pytest.mark.timeout(720)]

RUN = "cluster-fault"
RANKS = 2
# Small evaluation sets, one stage, a round every 4 steps: rounds before, during and after the fault.
TRAINING = TrainConfig(eval_every_steps=4, eval_at_start=False, eval_at_end=False, two_stage=False,
                       eval_size=16, batch_prompts=4, warmstart_steps=FAULT_WARMSTART_STEPS)


class Log:
    """Everything on some topics from the earliest offset, read through whichever brokers are up."""

    def __init__(self, bootstrap: str, topic_names: list[str]) -> None:
        # metadata refreshed often: a broker that had not heard of a new topic yet is asked again soon
        self.consumer = KafkaConsumer(*topic_names, bootstrap_servers=bootstrap.split(","), group_id=None,
                                      auto_offset_reset="earliest", enable_auto_commit=False,
                                      metadata_max_age_ms=2000)
        self.records: list[tuple[str, int, Any]] = []  # (topic, partition, event)

    def poll(self) -> None:
        for tp, batch in self.consumer.poll(timeout_ms=300).items():
            self.records += [(tp.topic, tp.partition, parse_event(r.value)) for r in batch]

    def until(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.poll()

    def of(self, cls: type) -> list[Any]:
        return [e for _, _, e in self.records if isinstance(e, cls) and e.run_id == RUN]

    def last_step_of_every_rank(self) -> int:
        last = defaultdict(int)
        for e in self.of(StepEvent):
            last[e.rank] = max(last[e.rank], e.step)
        return min(last[r] for r in range(RANKS)) if len(last) == RANKS else 0

    def close(self) -> None:
        self.consumer.close()


def round_of(e: EvalEvent | EvalConsensusEvent) -> tuple[str, str, str]:
    return (e.eval_id, e.dataset, e.stage)


def test_a_broker_killed_during_training_loses_nothing_and_counts_nothing_twice(
        kafka_cluster, cluster_topics, cluster_env, tmp_path):
    topics = cluster_topics
    # the worker keeps the run's evaluation interval where the trainer has it (no plateau-long gaps)
    worker_config = tmp_path / "streams.json"
    worker_config.write_text(json.dumps({"defaults": {"eval_interval": 4, "min_eval_interval": 4,
                                                      "max_eval_interval": 4}}))
    env = {**cluster_env, "AREAL_STREAMS_CONFIG": str(worker_config)}
    worker = start_service("areal_metrics.streams", env, tmp_path / "worker.log")
    sink = start_service("areal_metrics.sinks", env, tmp_path / "sink.log")
    log = Log(kafka_cluster.bootstrap, [topics.steps, topics.evals, topics.consensus])
    try:
        killed_at = train_through_a_broker_kill(kafka_cluster, topics, env, log, tmp_path)
        summaries = [json.loads((tmp_path / "summary" / f"rank{r}.json").read_text()) for r in range(RANKS)]
        last_step, eval_steps = summaries[0]["steps"], set(summaries[0]["eval_steps"])
        assert summaries[1]["steps"] == last_step and set(summaries[1]["eval_steps"]) == eval_steps
        assert last_step > killed_at + 16 and len(eval_steps) >= 5
        # (rank, step, dataset, stage) of every evaluation outcome each rank published
        outcomes = {(r, e["step"], e["dataset"], e["stage"]) for r, summary in enumerate(summaries)
                    for e in summary["evals"]}
        rounds = check_kafka_has_everything_once(log, last_step, eval_steps, outcomes)
        expected = {"steps": RANKS * last_step, "evals": RANKS * len(rounds), "eval_consensus": len(rounds)}
        assert clickhouse_counts(env, topics.prefix, expected, timeout=120) == expected
        # The worker rode out the fault. (Not its exit status after SIGTERM: Faust may crash in its
        # own shutdown when its producer buffer still holds a tick, which says nothing about the fault.)
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
    finally:
        log.close()
        stop_process(worker)
        stop_process(sink)
    assert "failed to process" not in (tmp_path / "worker.log").read_text()  # every input reached its state

    # The topics the worker made (its ticks, its state's changelog) are replicated like the others.
    admin = KafkaAdminClient(bootstrap_servers=kafka_cluster.bootstrap.split(","))
    try:
        ours = [t for t in admin.list_topics() if t.startswith((topics.prefix, app_id_for(topics.prefix)))]
        replicas = {d["name"]: {len(p["replica_nodes"]) for p in d["partitions"]} for d in admin.describe_topics(ours)}
    finally:
        admin.close()
    assert any(name.endswith("-changelog") for name in replicas) and any(name.endswith("-ticks") for name in replicas)
    assert all(counts == {3} for counts in replicas.values()), replicas


def train_through_a_broker_kill(cluster, topics, env: dict[str, str], log: Log, tmp_path) -> int:
    """Train; SIGKILL the leader of the run's partition at step 10; restart it; stop the run. The step of the kill."""
    run = start(RUN, RANKS, 100_000, TRAINING, env=env, log_dir=tmp_path / "logs", summary_dir=tmp_path / "summary")
    victim = None
    try:
        log.until(lambda: log.last_step_of_every_rank() >= 10, STARTUP_S, "step 10 from both ranks")
        run_partition = next(p for t, p, e in log.records if t == topics.steps and e.run_id == RUN)
        victim = cluster.partition_leaders(topics.steps)[run_partition]
        cluster.kill(victim)
        killed_at = log.last_step_of_every_rank()
        rounds_before = {round_of(c) for c in log.of(EvalConsensusEvent)}
        # Two brokers of three: writes with acks=all go on, and so do the votes.
        log.until(lambda: log.last_step_of_every_rank() >= killed_at + 16
                  and {round_of(c) for c in log.of(EvalConsensusEvent)} - rounds_before, 180,
                  "steps and a consensus while a broker is down")
        assert cluster.partition_leaders(topics.steps)[run_partition] not in (victim, -1)  # it failed over
        cluster.start_node(victim)
        cluster.wait_in_sync([topics.steps, topics.evals, topics.consensus], timeout=120)
        victim = None
        restarted_at = log.last_step_of_every_rank()
        log.until(lambda: log.last_step_of_every_rank() >= restarted_at + 4, 120, "steps after the restart")
        producer = KafkaProducer(bootstrap_servers=cluster.bootstrap.split(","), acks="all")
        stop_command = CommandEvent(run_id=RUN, node="test", command="stop", reason="end of the fault test")
        producer.send(topics.control, key=RUN.encode(), value=stop_command.to_json()).get(timeout=60)
        producer.close()
        assert run.wait(timeout=180) == 0
        return killed_at
    finally:
        run.terminate()
        if victim is not None:
            cluster.start_node(victim)  # leave the session's cluster whole for the next test


def check_kafka_has_everything_once(log: Log, last_step: int, eval_steps: set[int],
                                    outcomes: set[tuple[int, int, str, str]]) -> set[tuple[str, str, str]]:
    """Every step of every rank once (re-sends keep their event_id), every eval, one consensus per round."""
    # Everything was delivered before the ranks exited; the wait is for this reader, whose fetches
    # from a partition led by the restarted broker can lag the others' (the last round's evals
    # come after the last step).
    log.until(lambda: len({(e.rank, e.step) for e in log.of(StepEvent)}) >= RANKS * last_step, 120,
              "every step in Kafka")
    log.until(lambda: {(e.rank, e.step, e.dataset, e.stage) for e in log.of(EvalEvent)} >= outcomes, 120,
              "every evaluation outcome the ranks report in Kafka")
    ids_per_step: dict[tuple[int, int], set[str]] = defaultdict(set)
    for e in log.of(StepEvent):
        ids_per_step[(e.rank, e.step)].add(e.event_id)
    assert set(ids_per_step) == {(r, s) for r in range(RANKS) for s in range(1, last_step + 1)}
    assert all(len(ids) == 1 for ids in ids_per_step.values())
    evals = log.of(EvalEvent)
    rounds = {round_of(e) for e in evals}
    assert {e.step for e in evals} == eval_steps
    assert len({e.event_id for e in evals}) == RANKS * len(rounds)
    assert all(sorted(e.rank for e in evals if round_of(e) == r) == [0, 1] for r in rounds)
    log.until(lambda: {round_of(c) for c in log.of(EvalConsensusEvent)} >= rounds, 120, "a consensus for every round")
    consensus: dict[tuple[str, str, str], set[str]] = defaultdict(set)
    for c in log.of(EvalConsensusEvent):
        consensus[round_of(c)].add(json.dumps(c.to_dict(), sort_keys=True))
    assert set(consensus) == rounds
    assert all(len(contents) == 1 for contents in consensus.values()), "a round with two consensus events"
    assert all(json.loads(next(iter(c)))["votes"] == RANKS for c in consensus.values())
    return rounds


def clickhouse_counts(env: dict[str, str], prefix: str, expected: dict[str, int], timeout: float) -> dict[str, int]:
    """{table: rows FINAL} of the run, once they reach `expected` (or at the timeout)."""
    from areal_metrics.sinks.query import connect

    settings = Settings(kafka_bootstrap=env["AREAL_KAFKA_BOOTSTRAP"], clickhouse_url=env["AREAL_CLICKHOUSE_URL"],
                        topic_prefix=prefix)
    unique_key = {"steps": "rank, step", "evals": "event_id", "eval_consensus": "eval_id, dataset, stage"}
    deadline = time.monotonic() + timeout
    while True:
        counts, unique = {}, {}
        with connect(settings, wait_s=30) as store:
            for t in expected:  # both figures from one read, while the sink may still be inserting
                value = store.command(f"SELECT count(), uniqExact({unique_key[t]}) FROM {t} FINAL WHERE run_id = '{RUN}'")
                n, distinct = value if isinstance(value, (list, tuple)) else str(value).split("\t")
                counts[t], unique[t] = int(n), int(distinct)
        assert counts == unique, f"rows counted twice: {counts} rows, {unique} distinct"
        if all(counts[t] >= n for t, n in expected.items()) or time.monotonic() > deadline:
            return counts
        time.sleep(1)
