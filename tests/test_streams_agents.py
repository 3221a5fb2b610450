"""The stream worker's inputs and its ticks agent, without a broker.

The Kafka producer is replaced by a recorder (`send`), the clock by a settable one; the
`runs` table is Faust's real in-memory table. Input messages go in as the consumer hands
them over (tests/feed_support.py), ticks through the ticks agent's `test_context`; both
reach the batcher, which processes them a little later: `worker.settled()` waits for that (after each tick,
where the clock matters; at the end of a context otherwise, so several messages may share
a batch).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from areal_metrics.producers.contract.events import EvalEvent, RunEvent, StepEvent, parse_event
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.streams.shell.app import StreamWorker, app_id_for, build_worker
from areal_metrics.streams.core.config import RunConfig, StreamsConfig
from areal_metrics.streams.core.processor import derived_id
from areal_metrics.streams.state.state_store import stored_state
from tests.feed_support import RecordingTransport, inputs

TOPICS = Topics("agent.")


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, dict[str, Any]]] = []

    async def send(self, topic: str, key: bytes, value: bytes) -> Awaitable[Any]:
        self.sent.append((topic, key, json.loads(value)))
        # every output must be a valid contract record
        parse_event(value, expected=TOPICS.event_type(topic))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    def on(self, topic: str) -> list[dict[str, Any]]:
        return [v for t, _, v in self.sent if t == topic]


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(tmp_path: Path, cfg: RunConfig | None = None) -> tuple[StreamWorker, Recorder, Clock]:
    rec, clock = Recorder(), Clock()
    worker = build_worker(bootstrap="127.0.0.1:9", topics=TOPICS, datadir=tmp_path,
                          config=StreamsConfig(defaults=cfg or RunConfig()), transport=RecordingTransport(rec.send),
                          clock=clock)
    worker.app.finalize()
    worker.app.flow_control.resume()
    return worker, rec, clock


def run(coro: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(coro())


def step(run_id: str, n: int, reward: float | None, **kw: Any) -> bytes:
    return StepEvent(run_id=run_id, node="n0", step=n, epoch=0, reward=reward, ts=1.0 + n,
                     event_id=f"{run_id}-s{n}", **kw).to_json()


def result(node: str, eval_id: str, verdicts: tuple[int, ...] | None = None, status: str = "ok",
           replicas: int = 3, accuracy: float | None = None) -> bytes:
    if accuracy is None and verdicts is not None:
        accuracy = sum(verdicts) / len(verdicts)
    return EvalEvent(run_id="r1", node=node, eval_id=eval_id, step=10, dataset="math500", stage="quick",
                     status=status, accuracy=accuracy if status == "ok" else None, verdicts=verdicts,
                     error=None if status == "ok" else "OOM", replicas=replicas,
                     ts=5.0, event_id=f"{eval_id}-{node}").to_json()


def test_app_id_follows_the_prefix() -> None:
    assert app_id_for("areal.") == "areal-streams-areal"
    assert app_id_for("t1234abcd.") != app_id_for("t9999abcd.")


def test_steps_agent_smooths_and_dead_letters_bad_input(tmp_path: Path) -> None:
    worker, rec, _ = make(tmp_path, RunConfig(window=2, ema_alpha=0.5))

    async def go() -> None:
        async with inputs(worker, TOPICS.steps) as agent:
            await agent.put(step("r1", 0, 1.0), key=b"r1")
            await agent.put(b'{"type":"step","run_id":"r1","event_id":"x","ts":1,"step":1,"epoch":0,"reward":"NaN"}',
                            key=b"r1")
            await agent.put(b"\xff\xfe not json", key=b"r1")
            await agent.put(None, key=b"r1")
            await agent.put(step("r1", 1, 3.0), key=b"r1")
            await agent.put(step("r1", 1, 3.0), key=b"r1")  # redelivery: same event, same output
            await agent.put(step("r1", 2, 5.0), key=b"r1")
            await worker.settled()

    run(go)
    smoothed = rec.on(TOPICS.smoothed)
    assert [(s["step"], s["sliding_avg"], s["ema"], s["slope"]) for s in smoothed] == [
        (0, 1.0, 1.0, 0.0), (1, 2.0, 2.0, 2.0), (1, 2.0, 2.0, 2.0), (2, 4.0, 3.5, 2.0)]
    assert smoothed[1] == smoothed[2]
    dead = rec.on(TOPICS.deadletter)
    reasons = [d["reason"] for d in dead]
    assert reasons[0] == "steps.reward: not a number (str)"
    assert reasons[1].startswith("event: not UTF-8")
    assert reasons[2] == "steps: empty message (null value)"
    assert len(reasons) == 3
    assert dead[1]["raw"].startswith("base64:") and all(d["source_topic"] == TOPICS.steps for d in dead)
    alerts = rec.on(TOPICS.alerts)
    assert [a["kind"] for a in alerts] == ["invalid_event"]  # rate-limited: one for three
    state = stored_state(worker.core.table, "r1")
    assert state.smoothing.max_step == 2


def test_evals_agent_votes_and_degrades(tmp_path: Path) -> None:
    worker, rec, _ = make(tmp_path)
    truth, bad = (1, 1, 0, 1), (0, 0, 1, 1)

    async def go() -> None:
        async with inputs(worker, TOPICS.evals) as agent:
            await agent.put(result("a", "e1", truth), key=b"r1")
            await agent.put(result("bad", "e1", bad), key=b"r1")
            await agent.put(result("c", "e1", truth), key=b"r1")
            await agent.put(result("c", "e1", truth), key=b"r1")  # redelivered: nothing new
            await agent.put(result("a", "e2", status="failed"), key=b"r1")
            await agent.put(result("bad", "e2", status="failed"), key=b"r1")
            await agent.put(result("c", "e2", truth), key=b"r1")  # too late for the failed round
            await worker.settled()

    run(go)
    consensus = rec.on(TOPICS.consensus)
    assert [(c["eval_id"], c["accuracy"], c["dissenters"], c["votes"], c["stale"]) for c in consensus] == [
        ("e1", 0.75, ["bad"], 3, False), ("e2", 0.75, ["bad"], 3, True)]
    assert consensus[0]["event_id"] == derived_id("eval_consensus", "r1", "e1", "math500", "quick")
    assert [a["kind"] for a in rec.on(TOPICS.alerts)] == ["node_divergence", "eval_failed"]


def test_ticks_agent_times_out_rounds_and_finds_stalled_runs(tmp_path: Path) -> None:
    worker, rec, clock = make(tmp_path, RunConfig(vote_timeout_s=30, stall_seconds=60))

    async def go() -> None:
        async with inputs(worker, TOPICS.steps) as steps:
            await steps.put(step("r1", 0, 0.5), key=b"r1", partition=0)
            await worker.settled()
        async with inputs(worker, TOPICS.evals) as evals:
            await evals.put(result("a", "e1", (1, 0)), key=b"r1", partition=0)
            await evals.put(result("b", "e1", (1, 1)), key=b"r1", partition=0)
            await worker.settled()
        async with worker.ticks_agent.test_context() as ticks:

            async def tick(partition: int) -> None:
                await ticks.put(b"{}", partition=partition)
                await worker.settled()

            clock.now += 29
            await tick(0)
            assert rec.on(TOPICS.consensus) == []
            clock.now += 1
            await tick(1)  # not the run's partition: nothing
            assert rec.on(TOPICS.consensus) == []
            await tick(0)
            clock.now += 30
            await tick(0)
            await tick(0)  # stalled is said once

    run(go)
    consensus = rec.on(TOPICS.consensus)
    # sample 0: two votes for 1, decided; sample 1: a 1-1 tie, undecided, nobody outvoted
    assert len(consensus) == 1 and consensus[0]["partial"] and consensus[0]["accuracy"] == 1.0
    assert (consensus[0]["n_samples"], consensus[0]["n_undecided"], consensus[0]["dissenters"]) == (1, 1, [])
    # the tie leaves half the round's samples undecided: vote_undecided (above 5 %), then the stall
    assert [a["kind"] for a in rec.on(TOPICS.alerts)] == ["vote_undecided", "stalled"]


def test_runs_agent_ends_the_stall_watch_and_dead_letters_bad_run_events(tmp_path: Path) -> None:
    worker, rec, clock = make(tmp_path, RunConfig(stall_seconds=60, eval_interval=50))

    async def go() -> None:
        async with inputs(worker, TOPICS.steps) as steps:
            await steps.put(step("r1", 0, 0.5), key=b"r1", partition=0)
            await steps.put(step("r2", 0, 0.5), key=b"r2", partition=0)
            await worker.settled()
        async with inputs(worker, TOPICS.runs) as runs:
            await runs.put(RunEvent(run_id="r1", node="n0", status="running", config={"eval_interval_steps": 25},
                                    ts=1.0, event_id="run-r1-a").to_json(), key=b"r1", partition=0)
            await runs.put(RunEvent(run_id="r1", node="n0", status="finished", ts=2.0, event_id="run-r1-b").to_json(),
                           key=b"r1", partition=0)
            await runs.put(b'{"type":"run","run_id":"r2","event_id":"x","ts":1,"status":"paused"}', key=b"r2",
                           partition=0)
            await runs.put(b"\xff", key=None, partition=0)
            await worker.settled()
        async with worker.ticks_agent.test_context() as ticks:
            clock.now += 61
            await ticks.put(b"{}", partition=0)
            await worker.settled()

    run(go)
    assert [(a["run_id"], a["kind"]) for a in rec.on(TOPICS.alerts) if a["kind"] == "stalled"] == [("r2", "stalled")]
    reasons = [d["reason"] for d in rec.on(TOPICS.deadletter)]
    assert reasons[0].startswith("runs.status: 'paused' is not one of") and reasons[1].startswith("event: not UTF-8")
    assert all(d["source_topic"] == TOPICS.runs for d in rec.on(TOPICS.deadletter))
    state = stored_state(worker.core.table, "r1")
    assert state.lifecycle.ended and state.trigger.base_interval == 25


def test_state_in_the_table_survives_a_new_worker(tmp_path: Path) -> None:
    """A second worker reading the same table (as after a restart) continues, without repeats."""
    worker, rec, _ = make(tmp_path, RunConfig(window=3))

    async def first() -> None:
        async with inputs(worker, TOPICS.steps) as agent:
            for n in range(3):
                await agent.put(step("r1", n, float(n)), key=b"r1")
            await worker.settled()

    run(first)
    saved = dict(worker.core.table.items())
    worker2, rec2, _ = make(tmp_path / "2", RunConfig(window=3))

    async def second() -> None:
        async with inputs(worker2, TOPICS.steps) as agent:
            for key, value in saved.items():
                worker2.core.table.data[key] = value  # what changelog recovery does
            await agent.put(step("r1", 3, 3.0), key=b"r1")
            await agent.put(step("r1", 1, 1.0, ), key=b"r1")  # redelivered after the crash
            await worker2.settled()

    run(second)
    got = rec2.on(TOPICS.smoothed)
    assert [(s["step"], s["window"], s["sliding_avg"]) for s in got] == [(3, 3, 2.0), (1, 2, 0.5)]
    assert got[1] == rec.on(TOPICS.smoothed)[1]  # the very same event as the first time


@pytest.mark.parametrize("payload", [b"[]", b"{}", b'{"type":"eval"}', b"1e999", b"{" * 5000])
def test_no_message_stops_the_evals_agent(tmp_path: Path, payload: bytes) -> None:
    worker, rec, _ = make(tmp_path)

    async def go() -> None:
        async with inputs(worker, TOPICS.evals) as agent:
            await agent.put(payload, key=None)
            await agent.put(result("a", "e1", (1,), replicas=1), key=b"r1")
            await worker.settled()

    run(go)
    assert len(rec.on(TOPICS.deadletter)) == 1
    assert len(rec.on(TOPICS.consensus)) == 1


def test_broker_credentials_follow_the_settings() -> None:
    import faust

    from areal_metrics.producers.contract.settings import Settings
    from areal_metrics.streams.shell.app import broker_credentials

    assert broker_credentials(Settings()) is None
    sasl = broker_credentials(Settings(kafka_security_protocol="SASL_PLAINTEXT", kafka_sasl_mechanism="SCRAM-SHA-256",
                                       kafka_sasl_username="u", kafka_sasl_password="p"))
    assert isinstance(sasl, faust.SASLCredentials) and sasl.username == "u" and sasl.ssl_context is None
    tls = broker_credentials(Settings(kafka_security_protocol="SSL"))
    assert isinstance(tls, faust.SSLCredentials)


def test_topics_faust_creates_take_replication_and_min_insync_from_settings(tmp_path: Path) -> None:
    worker = build_worker(bootstrap="127.0.0.1:9", topics=TOPICS, datadir=tmp_path,
                          transport=RecordingTransport(Recorder().send),
                          replication_factor=3, min_insync_replicas=2)
    worker.app.finalize()
    changelog = worker.core.table.changelog_topic
    assert worker.app.conf.topic_replication_factor == 3
    assert changelog.replicas in (None, 3)  # None: Faust takes the app's topic_replication_factor
    assert changelog.config["min.insync.replicas"] == "2"
    ticks_topic = worker.ticks_agent.channel
    assert ticks_topic.get_topic_name().endswith("-ticks")
    assert ticks_topic.replicas == 3 and ticks_topic.config["min.insync.replicas"] == "2"


def test_a_finished_recovery_reads_the_table_again(tmp_path: Path) -> None:
    """After a rebalance, Faust's recovery restores the records of the partitions this worker got and drops
    those of the partitions it lost; the state store's index of records by run, built before, would miss the
    first (their states started over) and hold the second (their records gone: a load that crashed). The
    table's recovery callback makes the worker read the table again (review of 95b74dc)."""
    worker, _, _ = make(tmp_path)

    async def go() -> None:
        async with inputs(worker, TOPICS.steps) as agent:
            await agent.put(step("r1", 0, 1.0), key=b"r1")
            await worker.settled()

    run(go)
    core = worker.core
    assert core.store.run_ids() == ["r1"]
    restored = {k: v for k, v in core.table.data.items()}
    for key in list(core.table.data.keys()):  # what Faust's store does for a partition gone elsewhere
        core.table.data.pop(key)
    core.table.data[b'["r2","run"]'] = restored[b'["r1","run"]']  # (a record restored: r2's, say)
    asyncio.run(core.table.call_recover_callbacks())
    assert core.store.run_ids() == ['r2'] and "r1" not in core.cache
