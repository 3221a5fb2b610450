"""Inputs that are not on their run's partition: a run's state lives where its run_id key maps.

The contract keys every input by its run_id, so a run's steps, evals and run events share a partition
number and one worker holds the run's state. A producer that does not (no key, another key, or a client
whose default partitioner is not murmur2: librdkafka's is CRC32) puts a run's messages on other
partitions; with several workers, each would keep a state of the run of its own (a vote round whose
results are spread over workers is never complete anywhere). The worker sends such a message on to its
run's partition of the input's repartition topic and processes it there (streams/shell/batch.py `reroute`).

- the core alone: a message off its run's partition becomes a copy for the repartition topic at the run's
  partition, keyed by its run_id and where it was published, and nothing else; the copy read back is
  processed; a dead letter is sent on too, and is one letter however often it is sent on; an input too
  large for a repartition topic is dead-lettered where it landed; without `reroute` every message is
  processed where it lands;
- two real workers in one group: every round's three results are on three different partitions, so no
  worker holds all of a round's results where they land; every round is still decided by its three votes,
  and each run's state records are on its own partition of the changelog.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from areal_metrics.producers.contract.events import EvalEvent, StepEvent
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.producers.runtime.topic_metadata import key_partition
from areal_metrics.streams.core.config import RunConfig, StreamsConfig
from areal_metrics.streams.shell.app import app_id_for, repartition_topic_for
from areal_metrics.streams.shell.batch import Input, StreamCore
from areal_metrics.streams.state.state_store import HEAD, StateRecordTooLarge, record_key
from tests.support import group_members_when
from tests.test_streams_e2e import OutputReader, Worker

PARTITIONS = 3
T0 = 1_790_000_000.0


def _step(run: str, n: int) -> bytes:
    return StepEvent(run_id=run, node="n0", step=n, epoch=0, reward=0.1 * n, ts=T0 + n, event_id=f"{run}-s{n}").to_json()


def _result(run: str, round_no: int, node: int) -> bytes:
    """Node k is right on sample k alone: any two nodes disagree on two samples, so a round is decided by
    all three votes whatever their order (two that agree would decide it alone)."""
    return EvalEvent(run_id=run, node=f"n{node}", rank=node, eval_id=f"e{round_no}", step=round_no, dataset="math500",
                     status="ok", verdicts=[int(i == node) for i in range(3)], accuracy=1 / 3, replicas=3,
                     ts=T0 + round_no, event_id=f"{run}-e{round_no}-n{node}").to_json()


# ------------------------------------------------------------------ the core alone


class Sent:
    def __init__(self) -> None:
        self.messages: list[tuple[str, int | None, bytes, bytes | None]] = []

    async def send_many(self, messages: list[Any]) -> list[Any]:
        self.messages.extend(messages)
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in messages]
        for f in futures:
            f.set_result(None)
        return futures

    def on(self, topic: str) -> list[tuple[int | None, bytes, dict[str, Any]]]:
        return [(p, k, json.loads(v or b"null")) for t, p, k, v in self.messages if t == topic]


def routing_core(topics: Topics, sent: Sent, inputs: tuple[str, ...] | None = None,
                 reroute_max_bytes: int | None = None) -> StreamCore:
    """The core alone with `reroute` on for `inputs` (the steps topic when None), its outputs to `sent`."""
    reroute = {name: repartition_topic_for(topics.prefix, name) for name in (inputs or (topics.steps,))}
    return StreamCore(topics=topics, config=StreamsConfig(defaults=RunConfig()), table={}, send_many=sent.send_many,
                      clock=lambda: 1000.0, reroute=reroute, partitions=PARTITIONS,
                      reroute_max_bytes=reroute_max_bytes)


def test_a_message_off_its_runs_partition_is_sent_on_to_it_and_processed_there() -> None:
    topics = Topics("route.")
    reroute = {name: repartition_topic_for(topics.prefix, name) for name in (topics.steps, topics.evals)}
    sent = Sent()
    core = routing_core(topics, sent, (topics.steps, topics.evals))
    home = key_partition(b"r", PARTITIONS)
    away = (home + 1) % PARTITIONS

    async def go() -> None:
        await core.on_batch([Input(topics.steps, away, 0, None, _step("r", 0), 1.0),  # no key, another partition
                             Input(topics.steps, away, 1, b"r", b"not json", 1.0),  # a dead letter of run r: too
                             Input(topics.steps, home, 0, b"r", _step("r", 1), 1.0)])  # where it belongs
        copies = [(t, p, k, v) for t, p, k, v in sent.messages if t == reroute[topics.steps]]
        # keyed by where each was published, its run first (its dead letter's id comes from that position)
        assert [(p, json.loads(k), v) for _, p, k, v in copies] == [
            (home, ["r", topics.steps, away, 0], _step("r", 0)), (home, ["r", topics.steps, away, 1], b"not json")]
        assert not sent.on(topics.deadletter)
        assert list(core.cache) == ["r"] and core.cache["r"].partition == home  # no state of r where they landed
        await core.on_batch([Input(reroute[topics.steps], home, i, k, v, 1.0)  # the copies, read back
                             for i, (_, _, k, v) in enumerate(copies)])

    asyncio.run(go())
    assert [p["step"] for _, _, p in sent.on(topics.smoothed)] == [1, 0]  # the copy processed where it arrived
    assert [d["source_topic"] for _, _, d in sent.on(topics.deadletter)] == [topics.steps]  # where it was published
    assert core.stats["rerouted"] == 2 and core.cache["r"].partition == home

    # without `reroute` (one worker, tests of the core): processed where it lands
    plain = Sent()
    alone = StreamCore(topics=topics, config=StreamsConfig(defaults=RunConfig()), table={},
                       send_many=plain.send_many, clock=lambda: 1000.0)
    asyncio.run(alone.on_batch([Input(topics.steps, away, 0, None, _step("r", 0), 1.0)]))
    assert [p["step"] for _, _, p in plain.on(topics.smoothed)] == [0] and "rerouted" not in alone.stats


def test_a_copy_sent_on_twice_is_the_same_letter_and_a_poisoned_copy_names_where_it_was_published() -> None:
    """The original is read again after a crash before its acknowledgement, and sent on again: its copies sit at
    two offsets of the repartition topic, and each is dead-lettered; the letter's id comes from where the message
    was published (the copy's key says), so the two are one letter, counted once. A copy that crashes the worker
    twice is named by the input's position, not the copy's."""
    topics = Topics("route.")
    reroute = {topics.steps: repartition_topic_for(topics.prefix, topics.steps)}
    sent = Sent()
    core = routing_core(topics, sent)
    home = key_partition(b"r", PARTITIONS)
    away = (home + 1) % PARTITIONS
    original = Input(topics.steps, away, 7, b"r", b"not json", 1.0)

    async def go() -> None:
        await core.on_batch([original])
        await core.on_batch([original])  # read again: sent on again
        copies = [(p, k, v) for t, p, k, v in sent.messages if t == reroute[topics.steps]]
        assert len(copies) == 2 and copies[0] == copies[1] and copies[0][0] == home
        await core.on_batch([Input(reroute[topics.steps], home, offset, k, v, 1.0)
                             for offset, (_, k, v) in enumerate(copies)])
        await core.on_poison(Input(reroute[topics.steps], home, 5, copies[0][1], copies[0][2], 1.0), 2)

    asyncio.run(go())
    letters = sent.on(topics.deadletter)
    assert len({d["event_id"] for _, _, d in letters[:2]}) == 1  # one letter, however often sent on
    assert all(d["source_topic"] == topics.steps and d["run_id"] == "r" for _, _, d in letters)
    [poison] = [a for _, _, a in sent.on(topics.alerts) if a["kind"] == "poison_message"]
    assert f"topic {topics.steps}, partition {away}, offset 7" in poison["message"]


def test_an_input_too_large_for_a_repartition_topic_is_dead_lettered_where_it_landed() -> None:
    topics = Topics("route.")
    sent = Sent()
    core = routing_core(topics, sent, reroute_max_bytes=4_096)
    away = (key_partition(b"r", PARTITIONS) + 1) % PARTITIONS
    asyncio.run(core.on_batch([Input(topics.steps, away, 0, b"r", b"x" * 8_000, 1.0)]))
    assert [d["source_topic"] for _, _, d in sent.on(topics.deadletter)] == [topics.steps]
    assert core.stats["too_large_to_reroute"] == 1 and "rerouted" not in core.stats


def test_a_repartition_topic_is_the_workers_own_and_carries_its_inputs_events() -> None:
    topics = Topics("areal.")
    name = repartition_topic_for(topics.prefix, topics.evals)
    assert name == "areal-streams-areal-evals-repartition" and name.startswith(app_id_for(topics.prefix) + "-")
    core = StreamCore(topics=topics, config=StreamsConfig(), table={}, send_many=Sent().send_many,
                      reroute={topics.steps: repartition_topic_for(topics.prefix, topics.steps)}, partitions=3)
    assert core.input_type(repartition_topic_for(topics.prefix, topics.steps)) is StepEvent
    with pytest.raises(ValueError):
        StreamCore(topics=topics, config=StreamsConfig(), table={}, send_many=Sent().send_many, reroute={})


# ------------------------------------------------------------------ two workers


@pytest.mark.broker
def test_two_workers_decide_every_round_whose_results_are_spread_over_three_partitions(
        kafka_bootstrap: str, topics: Topics, stack_env: dict[str, str], tmp_path: Path) -> None:
    from kafka import KafkaConsumer, KafkaProducer

    cfg = tmp_path / "streams.json"
    cfg.write_text(json.dumps({"defaults": {"vote_timeout_s": 4.0, "stall_seconds": 0}, "tick_interval_s": 0.5}))
    env = {**stack_env, "AREAL_STREAMS_CONFIG": str(cfg), "AREAL_STREAMS_SESSION_TIMEOUT": "6",
           "AREAL_STREAMS_COMMIT_INTERVAL": "0.5"}
    workers = [Worker({**env, "AREAL_HOME": str(tmp_path / f"home-{i}")}, tmp_path / f"worker-{i}.log")
               for i in range(2)]
    reader = OutputReader(kafka_bootstrap, topics)
    runs, rounds = [f"run-{i}" for i in range(4)], 3
    try:
        for w in workers:
            w.start()
        assert group_members_when(kafka_bootstrap, app_id_for(topics.prefix), 2, timeout=90) == 2
        producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
        for run in runs:
            for n in range(3):  # steps keyed as the contract says
                producer.send(topics.steps, key=run.encode(), value=_step(run, n))
            for r in range(rounds):  # each result on its own partition, as a producer without the run's key puts them
                for node in range(3):
                    producer.send(topics.evals, value=_result(run, r, node), partition=node)
        producer.flush(30)
        producer.close()
        reader.wait_for({topics.consensus: len(runs) * rounds, topics.smoothed: len(runs) * 3}, timeout=120)
        reader.settle(6.0)  # past the vote timeout: a split round would show as a second, partial consensus
    finally:
        codes = [w.stop() for w in workers]
        reader.close()
    assert codes == [0, 0], [(tmp_path / f"worker-{i}.log").read_text()[-3000:] for i in range(2)]
    got = reader.distinct()
    consensus = sorted((c["run_id"], c["eval_id"], c["votes"], c["partial"]) for c in got[topics.consensus].values())
    assert consensus == [(run, f"e{r}", 3, False) for run in runs for r in range(rounds)]
    assert not [a for a in got.get(topics.alerts, {}).values() if a["kind"] == "eval_failed"]

    # each run's state is on its own partition of the changelog, and nowhere else
    changelog = f"{app_id_for(topics.prefix)}-runs-changelog"
    consumer = KafkaConsumer(changelog, bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest",
                             consumer_timeout_ms=3000, group_id=None)
    try:
        where = {(json.loads(m.key)[0], m.partition) for m in consumer}
    finally:
        consumer.close()
    assert where == {(run, key_partition(run.encode(), PARTITIONS)) for run in runs}


def test_no_state_of_a_run_starts_off_its_partition_on_a_path_that_is_not_sent_on() -> None:
    """Three ways a run's message is still processed where it landed, off the run's partition: an input too
    large to send on, a dead letter whose key names another run (a worker error on a step of run r keyed
    't'), and a state that does not decode, rebuilt at a tick of another partition. None may start the
    run's state there: with several workers that partition's owner is not the run's, and two workers would
    write states of one run. A run this worker holds nothing of gets its letter out and no state; a bad
    state is rebuilt on the run's own partition."""
    topics = Topics("route.")
    sent = Sent()
    core = routing_core(topics, sent, reroute_max_bytes=4_096)
    away_r = (key_partition(b"r", PARTITIONS) + 1) % PARTITIONS
    asyncio.run(core.on_batch([Input(topics.steps, away_r, 0, b"r", b"x" * 8_000, 1.0)]))  # too large to send on
    assert [d["run_id"] for _, _, d in sent.on(topics.deadletter)] == ["r"]
    assert "r" not in core.cache and not core.store.holds("r") and core.stats["not_kept_elsewhere"] == 1

    home_r = key_partition(b"r", PARTITIONS)
    assert key_partition(b"t", PARTITIONS) != home_r  # (the test's premise)
    original = core._step

    def failing_on_r(state: Any, item: Any, now: float, cfg: Any) -> Any:
        if isinstance(item.event, StepEvent) and item.event.run_id == "r":
            raise RuntimeError("a bug")
        return original(state, item, now, cfg)

    core._step = failing_on_r  # type: ignore[method-assign]
    asyncio.run(core.on_batch([Input(topics.steps, home_r, 1, b"t", _step("r", 5), 1.0)]))
    letters = sent.on(topics.deadletter)
    assert [d["run_id"] for _, _, d in letters] == ["r", "t"]  # the worker error's letter, guessed from the key
    assert not core.store.holds("t") and core.stats["not_kept_elsewhere"] == 2
    core._step = original  # type: ignore[method-assign]

    # a stored state of run t that does not decode, met at the tick of a partition that is not t's
    core.store.table[record_key("t", HEAD)] = b"not a state"  # type: ignore[index]
    core.store.forget()
    away_t = (key_partition(b"t", PARTITIONS) + 1) % PARTITIONS
    asyncio.run(core.on_tick(away_t))
    assert core.stats["bad_states"] == 1 and core.cache["t"].partition == key_partition(b"t", PARTITIONS)


def test_a_run_with_one_message_on_its_partition_keeps_its_state_and_a_save_failures_letter_keeps_none() -> None:
    """(Review of 444b1cc.) A batch of a new run r with an input too large to send on (off r's partition) and
    r's step on its own partition: the partition is this worker's, and r's state is kept (the whole turn was
    taken for one off its partition, and the step's report lost). A step of r keyed 't' whose save fails
    alone: its dead letter's run is t, off t's partition, and no state of t is written here."""
    topics = Topics("route.")
    sent = Sent()
    core = routing_core(topics, sent, reroute_max_bytes=4_096)
    home_r = key_partition(b"r", PARTITIONS)
    away_r = (home_r + 1) % PARTITIONS
    asyncio.run(core.on_batch([Input(topics.steps, away_r, 0, b"r", b"x" * 8_000, 1.0),
                               Input(topics.steps, home_r, 0, b"r", _step("r", 5), 1.0)]))
    assert [p["step"] for _, _, p in sent.on(topics.smoothed)] == [5]
    assert core.store.holds("r") and "not_kept_elsewhere" not in core.stats

    saving = core.store.save

    def refusing_r(state: Any) -> None:
        if state.run_id == "r":
            raise StateRecordTooLarge("r cannot be stored")
        saving(state)

    core.store.save = refusing_r  # type: ignore[method-assign]
    assert key_partition(b"t", PARTITIONS) != home_r
    asyncio.run(core.on_batch([Input(topics.steps, home_r, 1, b"t", _step("r", 6), 1.0)]))
    letters = [d for _, _, d in sent.on(topics.deadletter)]
    assert len(letters) == 2 and not core.store.holds("t")  # (the first: the input too large to send on)


def test_a_key_this_worker_wrote_leaves_its_table_when_its_partition_goes_to_another_worker() -> None:
    """Faust's memory store drops, when a rebalance's recovery completes, the keys of partitions no longer
    this worker's, but only keys whose partition it knows (those restored from the changelog). The state
    store tells it the partition of each key it writes: a run this worker started does not stay in its
    table (held, written, evicted there) after its partition went to another worker (review of 444b1cc)."""
    import faust
    from faust.stores.memory import Store
    from faust.types import TP

    from areal_metrics.streams.state.state_store import TableWrites

    class Table:  # what TableWrites reads of Faust's table
        name = "runs"

        def __init__(self) -> None:
            self.data = Store("memory://", faust.App("t", broker="kafka://127.0.0.1:1"), table=self)
            self.changelog: list[tuple[int, bytes, bytes | None]] = []

        def send_changelog(self, partition: int, key: bytes, value: bytes | None, **_: Any) -> None:
            self.changelog.append((partition, key, value))

    table = Table()
    writes = TableWrites(table)
    writes.put(0, b"kept", b"1")
    writes.put(1, b"moved", b"2")
    writes.put(1, b"deleted", b"3")
    writes.delete(1, b"deleted")
    asyncio.run(table.data.on_recovery_completed({TP("changelog", 0)}, set()))
    assert dict(table.data.data) == {b"kept": b"1"}
