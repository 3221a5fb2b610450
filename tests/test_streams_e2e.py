"""End to end on the real broker: `python -m areal_metrics.streams` as a subprocess, kafka-python around it.

Scenario: 2 runs x 3 nodes. Every node reports every step (same reward, the first copy
counts); the reward climbs, plateaus, then drops below the threshold. Evaluation rounds
of 20 verdicts on math500; in run-a node n2 reports wrong verdicts, and round e4 fails
(two nodes `failed`); run-b has a value-only aime24 round with one node far off and a
throughput drop. Malformed messages are mixed in.

The test asserts the derived events on every output topic exactly: first against facts
written out by hand (consensus values and dissenters, the stale repeat, the alerts, the
commands in order), then event for event against the pure core run in-process over the
same input. The restart test kills the worker (-9) in the middle and checks that the
restarted worker produces the same events: none missing, no round with two different
consensus events, no event_id with two different contents.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from areal_metrics.producers.contract.events import EvalEvent, StepEvent
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.streams.shell.app import StreamCore, app_id_for
from areal_metrics.streams.core.config import StreamsConfig
from tests.support import group_members_when

pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parents[1]
RUNS = ("run-a", "run-b")
NODES = ("n0", "n1", "n2")
STEPS = 60
T0 = 1_790_000_000.0

CONFIG = {
    "defaults": {
        "window": 5, "ema_alpha": 0.5,
        "eval_interval": 20, "min_eval_interval": 5, "max_eval_interval": 80,
        "fast_slope": 0.02, "fast_exit_slope": 0.01, "plateau_slope": 0.002, "plateau_exit_slope": 0.004,
        "interval_dwell_steps": 10, "evaluate_delta": 0.2,
        "reward_threshold": 0.3, "reward_cooldown_steps": 100,
        "throughput_min_samples": 5, "throughput_drop_ratio": 0.5, "throughput_cooldown_steps": 100,
        "stall_seconds": 0, "vote_timeout_s": 600, "invalid_alert_interval_s": 600,
        "adaptive_interval": True,
    },
    "runs": {"run-b": {"lr_factor": 0.25}},
}

TRUTH = tuple((i * 7) % 3 != 0 for i in range(20))  # 13 of 20 right
TRUTH_V = tuple(int(x) for x in TRUTH)
WRONG_V = tuple(1 - v if i % 3 == 0 else v for i, v in enumerate(TRUTH_V))  # 7 samples flipped


def reward_at(run: str, step: int) -> float:
    """Climb (0..19), plateau (20..39), drop below 0.3 (40..)."""
    base = 0.1 if run == "run-a" else 0.2
    if step < 20:
        return round(base + 0.03 * step, 6)
    if step < 40:
        return round(base + 0.6, 6)
    return round(max(0.0, base + 0.6 - 0.06 * (step - 39)), 6)


@dataclass(frozen=True)
class Msg:
    topic: str
    key: bytes | None
    value: bytes


def scenario(topics: Topics) -> list[Msg]:
    """The input, in production order (one producer: per-run order is kept)."""
    msgs: list[Msg] = []

    def step_msgs(run: str, s: int) -> None:
        for rank, node in enumerate(NODES):
            tp = 1000.0 if not (run == "run-b" and s == 45) else 300.0  # a throughput drop in run-b
            ev = StepEvent(run_id=run, node=node, rank=rank, step=s, epoch=0, reward=reward_at(run, s),
                           throughput=tp + rank, ts=T0 + s, event_id=f"{run}-{node}-s{s}")
            msgs.append(Msg(topics.steps, run.encode(), ev.to_json()))

    def eval_msg(run: str, node: str, eval_id: str, step: int, *, verdicts=None, accuracy=None,
                 dataset="math500", failed=False) -> None:
        if verdicts is not None:
            accuracy = sum(verdicts) / len(verdicts)
        ev = EvalEvent(run_id=run, node=node, eval_id=eval_id, step=step, dataset=dataset, stage="quick",
                       status="failed" if failed else "ok", accuracy=None if failed else accuracy,
                       verdicts=None if failed else verdicts, n_samples=None if failed else 20,
                       response_length=None if failed else 300.0 + NODES.index(node),
                       error="CUDA OOM" if failed else None, replicas=3, ts=T0 + step + 0.5,
                       event_id=f"{run}-{eval_id}-{node}")
        msgs.append(Msg(topics.evals, run.encode(), ev.to_json()))

    for s in range(STEPS):
        for run in RUNS:
            step_msgs(run, s)
            if s == 7:  # a redelivery of a step event: counts once, same output
                msgs.append(msgs[-3])
        if s % 10 == 9:
            r = s // 10 + 1
            eid = f"e{r}"
            # run-a: n2 is wrong. When it answers early it is outvoted; when last, not counted.
            order_a = ("n2", "n0", "n1") if r % 2 else ("n0", "n1", "n2")
            for node in order_a:
                if r == 4 and node != "n2":
                    eval_msg("run-a", node, eid, s, failed=True)
                else:
                    eval_msg("run-a", node, eid, s, verdicts=WRONG_V if node == "n2" else TRUTH_V)
            for node in NODES:
                eval_msg("run-b", node, eid, s, verdicts=TRUTH_V)
            if r == 2:
                for node, acc in (("n2", 0.5), ("n0", 0.30), ("n1", 0.31)):
                    eval_msg("run-b", node, "a1", s, accuracy=acc, dataset="aime24")
        if s == 12:
            msgs.append(Msg(topics.steps, b"run-a", b'{"type":"step","run_id":"run-a","step":"x"}'))
            msgs.append(Msg(topics.evals, b"run-b", b"not json at all"))
            msgs.append(Msg(topics.steps, b"run-a", b'{"type":"eval"}'))
    return msgs


# ------------------------------------------------------------------ broker helpers


@dataclass(frozen=True)
class Sent:
    msg: Msg
    partition: int
    offset: int
    timestamp: float


def produce(bootstrap: str, msgs: list[Msg]) -> list[Sent]:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    futures = [(m, producer.send(m.topic, key=m.key, value=m.value)) for m in msgs]
    producer.flush(30)
    out = []
    for m, f in futures:
        md = f.get(timeout=30)
        out.append(Sent(m, md.partition, md.offset, md.timestamp / 1000.0))
    producer.close()
    return out


class OutputReader:
    """Everything on the output topics, read from the start, as (topic, dict) in log order per partition."""

    def __init__(self, bootstrap: str, topics: Topics) -> None:
        from kafka import KafkaConsumer

        self.topics = topics
        self.consumer = KafkaConsumer(
            topics.consensus, topics.smoothed, topics.control, topics.alerts, topics.deadletter,
            bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False,
            group_id=None, consumer_timeout_ms=200,
        )
        self.got: list[tuple[str, int, int, dict[str, Any]]] = []

    def poll(self) -> None:
        for records in self.consumer.poll(timeout_ms=300, max_records=5000).values():
            for r in records:
                self.got.append((r.topic, r.partition, r.offset, json.loads(r.value)))

    def distinct(self) -> dict[str, dict[str, dict[str, Any]]]:
        out: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
        for topic, _, _, v in self.got:
            out[topic].setdefault(v["event_id"], v)
        return out

    def wait_for(self, counts: dict[str, int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            have = {t: len(v) for t, v in self.distinct().items()}
            if all(have.get(t, 0) >= n for t, n in counts.items()):
                return
        raise AssertionError(f"timed out waiting for {counts}; have {dict((t, len(v)) for t, v in self.distinct().items())}")

    def settle(self, seconds: float) -> None:
        """Read on for a while: nothing unexpected may come later."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.poll()

    def close(self) -> None:
        self.consumer.close()


class Worker:
    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env, self.log, self.proc = env, log, None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "areal_metrics.streams"], cwd=ROOT, env=self.env,
                                     stdout=self.log.open("ab"), stderr=subprocess.STDOUT)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                raise
        return self.proc.returncode


@pytest.fixture
def worker_env(stack_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    cfg = tmp_path / "streams.json"
    cfg.write_text(json.dumps(CONFIG))
    env = dict(stack_env)
    env.update(AREAL_STREAMS_CONFIG=str(cfg), AREAL_STREAMS_SESSION_TIMEOUT="6",
               AREAL_STREAMS_COMMIT_INTERVAL="0.5")
    return env


# ------------------------------------------------------------------ the expected events


def reference(topics: Topics, sent: list[Sent]) -> dict[str, dict[str, dict[str, Any]]]:
    """The same input through the same code without Faust or Kafka: per topic, event_id -> event."""
    out: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)

    async def send(topic: str, key: bytes, value: bytes):
        v = json.loads(value)
        out[topic].setdefault(v["event_id"], v)
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    async def go() -> None:
        core = StreamCore(topics=topics, config=StreamsConfig.from_dict(CONFIG), table={}, send=send)
        for s in sent:
            await core.on_input(s.msg.topic, s.partition, s.offset, s.msg.key, s.msg.value, s.timestamp)

    asyncio.run(go())
    return out


def check_hand_written_facts(topics: Topics, got: dict[str, dict[str, dict[str, Any]]]) -> None:
    consensus = sorted(got[topics.consensus].values(), key=lambda c: (c["run_id"], c["dataset"], c["step"]))
    rows = [(c["run_id"], c["eval_id"], c["dataset"], c["accuracy"], c["votes"], c["dissenters"], c["stale"],
             c["partial"]) for c in consensus]
    good = 13 / 20
    assert rows == [
        ("run-a", "e1", "math500", good, 3, ["n2"], False, False),  # n2 first: outvoted
        ("run-a", "e2", "math500", good, 2, [], False, False),  # n0, n1 agree: n2 not counted
        ("run-a", "e3", "math500", good, 3, ["n2"], False, False),
        ("run-a", "e4", "math500", good, 3, ["n2"], True, False),  # failed: e3 repeated, stale
        ("run-a", "e5", "math500", good, 3, ["n2"], False, False),
        ("run-a", "e6", "math500", good, 2, [], False, False),
        ("run-b", "a1", "aime24", pytest.approx(0.305), 3, ["n2"], False, False),
        *[("run-b", f"e{r}", "math500", good, 2, [], False, False) for r in range(1, 7)],
    ]
    assert all(c["agreement"] == pytest.approx(1 - 7 / 60) for c in consensus
               if c["dissenters"] == ["n2"] and c["dataset"] == "math500")

    alerts = defaultdict(list)
    for a in got[topics.alerts].values():
        alerts[a["run_id"]].append((a["kind"], a.get("step")))
    assert sorted(alerts["run-a"]) == sorted([
        ("invalid_event", None),  # two bad step messages, one alert (rate limit)
        ("node_divergence", 9), ("node_divergence", 29), ("node_divergence", 49),
        ("eval_failed", 39),
        ("reward_below_threshold", 48),
    ])
    assert sorted(alerts["run-b"]) == sorted([
        ("invalid_event", None),
        ("node_divergence", 19),  # the aime24 value vote
        ("throughput_drop", 45),
        ("reward_below_threshold", 50),
    ])
    stale_alert = next(a for a in got[topics.alerts].values() if a["kind"] == "eval_failed")
    assert "n0: CUDA OOM" in stale_alert["message"] and "repeating the last good result (eval e3" in stale_alert["message"]

    for run in RUNS:
        cmds = [c for c in got[topics.control].values() if c["run_id"] == run]  # log order
        steps = [(round(c["ts"] - T0), c["command"], c["args"]) for c in cmds]
        assert steps == expected_commands(run), steps
        changes = [step for step, command, _ in steps if command == "set_eval_interval"]
        assert all(b - a >= CONFIG["defaults"]["interval_dwell_steps"] for a, b in zip(changes, changes[1:]))
        assert all(c["reason"] and "target_node" not in c for c in cmds)

    dead = got[topics.deadletter].values()
    assert sorted((d["run_id"], d["source_topic"], d["reason"]) for d in dead) == [
        ("run-a", topics.steps, "event.type: 'eval' does not belong here (expected 'step')"),
        ("run-a", topics.steps, "steps.event_id: missing"),  # the envelope first
        ("run-b", topics.evals, "event: not valid JSON (Expecting value: line 1 column 1 (char 0))"),
    ]
    assert len(got[topics.smoothed]) == 2 * STEPS


def expected_commands(run: str) -> list[tuple[int, str, dict[str, Any]]]:
    """(step, command, args) in log order: climb -> shorter intervals and evaluate_now,
    plateau -> longer, drop -> shorter again; no scale_lr (the reward below 0.3 is an alert:
    scale_lr comes from full-stage evaluation, and these rounds are quick-stage); the interval
    never changes twice within the dwell (10 steps), however the noisy slope crosses the bands."""
    last = 20 if run == "run-a" else 5
    cmds = [
        (4, "set_eval_interval", {"steps": 10}),
        (11, "evaluate_now", {}),
        (14, "set_eval_interval", {"steps": 5}),
        (18, "evaluate_now", {}),
        (24, "set_eval_interval", {"steps": 10}),
        (34, "set_eval_interval", {"steps": 20}),
        (44, "set_eval_interval", {"steps": 10}),
        (47, "evaluate_now", {}),
        (51, "evaluate_now", {}),
        (54, "set_eval_interval", {"steps": last}),
    ]
    return sorted(cmds, key=lambda c: c[0])


def expected_counts(ref: dict[str, dict[str, dict[str, Any]]]) -> dict[str, int]:
    return {t: len(v) for t, v in ref.items()}


# ------------------------------------------------------------------ tests


def test_scenario_derives_exactly_the_expected_events(kafka_bootstrap: str, topics: Topics, worker_env, tmp_path):
    sent = produce(kafka_bootstrap, scenario(topics))
    ref = reference(topics, sent)
    check_hand_written_facts(topics, ref)
    worker = Worker(worker_env, tmp_path / "worker.log")
    reader = OutputReader(kafka_bootstrap, topics)
    worker.start()
    try:
        reader.wait_for(expected_counts(ref), timeout=40)
        reader.settle(1.5)
    finally:
        rc = worker.stop()
        reader.close()
    assert rc == 0, (tmp_path / "worker.log").read_text()[-3000:]
    got = reader.distinct()
    for topic in ref:
        assert got[topic] == ref[topic], topic
    assert set(got) == set(ref)
    check_hand_written_facts(topics, got)
    # every copy of an event is the same event (a redelivered step re-sends its point)
    seen: dict[str, dict[str, Any]] = {}
    for _, _, _, v in reader.got:
        assert seen.setdefault(v["event_id"], v) == v


def assert_the_one_worker_events(topics: Topics, reader: OutputReader, ref: dict[str, dict[str, Any]]
                                 ) -> dict[str, dict[str, Any]]:
    """What the reader got is exactly `ref` (nothing missing, nothing extra), the hand-written
    facts hold, and every copy sent again is the very same event. Returns the distinct events."""
    got = reader.distinct()
    for topic in ref:
        assert got[topic] == ref[topic], topic
    check_hand_written_facts(topics, got)
    seen: dict[str, dict[str, Any]] = {}
    for _, _, _, v in reader.got:
        assert seen.setdefault(v["event_id"], v) == v, v
    return got


def test_worker_killed_and_restarted_mid_scenario_gives_the_same_events(
    kafka_bootstrap: str, topics: Topics, worker_env, tmp_path
):
    msgs = scenario(topics)
    half = next(i for i, m in enumerate(msgs) if m.topic == topics.evals and b'"e3"' in m.value)
    log = tmp_path / "worker.log"
    reader = OutputReader(kafka_bootstrap, topics)
    # A long commit interval: the kill lands before the offsets of the first half are
    # committed, so the restarted worker gets that input again on top of the saved state.
    first = Worker({**worker_env, "AREAL_STREAMS_COMMIT_INTERVAL": "30"}, log)
    first.start()
    sent = produce(kafka_bootstrap, msgs[:half])
    try:
        reader.wait_for({topics.consensus: 3, topics.smoothed: 40}, timeout=40)
    finally:
        first.kill9()
    before_kill = reader.distinct()

    second = Worker(worker_env, log)
    second.start()
    sent += produce(kafka_bootstrap, msgs[half:])
    ref = reference(topics, sent)
    try:
        reader.wait_for(expected_counts(ref), timeout=45)
        reader.settle(2.0)
    finally:
        rc = second.stop()
        reader.close()
    assert rc == 0, log.read_text()[-3000:]

    got = assert_the_one_worker_events(topics, reader, ref)
    # no round ever got two different consensus events
    per_round: dict[tuple, set[str]] = defaultdict(set)
    for topic, _, _, v in reader.got:
        if topic == topics.consensus:
            per_round[(v["run_id"], v["eval_id"], v["dataset"], v["stage"])].add(json.dumps(v, sort_keys=True))
    assert all(len(contents) == 1 for contents in per_round.values())
    assert len(per_round) == 13
    # the first worker really did part of the work before it was killed
    assert 0 < len(before_kill[topics.consensus]) < 13
    # ... and the restarted worker did get its input again: beyond the 2 re-sent steps of the
    # scenario itself, outputs were sent twice (same ids), none was derived twice differently.
    assert len(reader.got) > sum(len(v) for v in got.values()) + 2


def test_a_second_worker_joining_mid_scenario_shares_the_runs_without_a_difference(
    kafka_bootstrap: str, topics: Topics, worker_env, tmp_path
):
    """Scale-out: a second worker of the same prefix joins while the first is busy, the
    group rebalances (the first hands over partitions with the messages it already took
    from a fetch), and together they derive exactly the events one worker derives."""
    msgs = scenario(topics)
    half = next(i for i, m in enumerate(msgs) if m.topic == topics.evals and b'"e3"' in m.value)
    reader = OutputReader(kafka_bootstrap, topics)
    first = Worker(worker_env, tmp_path / "worker-1.log")
    first.start()
    second_home = tmp_path / "home-2"  # its own state directory, as on another machine
    second = Worker({**worker_env, "AREAL_HOME": str(second_home)}, tmp_path / "worker-2.log")
    try:
        sent = produce(kafka_bootstrap, msgs[:half])
        reader.wait_for({topics.smoothed: 20}, timeout=40)
        second.start()
        members = group_members_when(kafka_bootstrap, app_id_for(topics.prefix), 2, timeout=40)
        sent += produce(kafka_bootstrap, msgs[half:])
        ref = reference(topics, sent)
        reader.wait_for(expected_counts(ref), timeout=60)
        reader.settle(2.0)
    finally:
        rc_second = second.stop() if second.proc is not None else 0
        rc_first = first.stop()
        reader.close()
    assert rc_first == 0, (tmp_path / "worker-1.log").read_text()[-3000:]
    assert rc_second == 0, (tmp_path / "worker-2.log").read_text()[-3000:]
    assert_the_one_worker_events(topics, reader, ref)
    assert members == 2  # both workers were in the group: it rebalanced while the first was busy


def test_start_offsets_are_committed_for_a_new_group(kafka_bootstrap: str, topics: Topics):
    """Faust can only re-read messages it dropped during a rebalance by seeking to a
    committed offset: the worker makes sure every input partition has one."""
    from kafka import KafkaConsumer, TopicPartition

    from areal_metrics.streams.shell.app import app_id_for, ticks_topic_for
    from areal_metrics.streams.shell.kafka_admin import ensure_committed_offsets, prepare_topics

    ticks = ticks_topic_for(topics.prefix)
    assert prepare_topics(kafka_bootstrap, [topics.steps, topics.evals], ticks) == 3
    produce(kafka_bootstrap, [Msg(ticks, None, b"{}")] * 4)
    group = app_id_for(topics.prefix)
    assert ensure_committed_offsets(kafka_bootstrap, group, from_start=[topics.steps, topics.evals],
                                    from_end=[ticks]) == 9
    assert ensure_committed_offsets(kafka_bootstrap, group, from_start=[topics.steps, topics.evals],
                                    from_end=[ticks]) == 0
    c = KafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=group, enable_auto_commit=False)
    try:
        tick_tps = [TopicPartition(ticks, p) for p in range(3)]
        assert sum(c.committed(tp) for tp in tick_tps) == 4  # past the old ticks
        assert c.committed(TopicPartition(topics.steps, 0)) == 0
    finally:
        c.close()
