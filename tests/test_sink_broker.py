"""The sink on the real broker with the embedded engine: exactly-once counts, SIGKILL recovery, replay."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from areal_metrics.producers.contract.events import (
    AlertEvent,
    CommandEvent,
    EvalConsensusEvent,
    EvalEvent,
    Event,
    RewardSmoothedEvent,
    StepEvent,
)
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.sinks.batching import BatchPolicy
from areal_metrics.sinks.query import Target, open_client
from areal_metrics.sinks.replay import fingerprints, replay_into
from areal_metrics.sinks.schema import TABLES
from areal_metrics.sinks.sink import Sink
from areal_metrics.sinks.writer import load_plans
from tests.support import wait_for
from tests.test_rank_aggregates import assert_view_is_the_raw_rule as assert_buckets_are_the_raw_rule
from tests.test_step_means import assert_view_is_the_raw_rule

pytestmark = [pytest.mark.broker, pytest.mark.timeout(120)]


def make_events(n_steps: int, run: str = "r1") -> list[Event]:
    """A mix over every topic a producer writes (the sink stores all seven)."""
    out: list[Event] = []
    for i in range(n_steps):
        # four ranks per step, unequal samples (one rank without): the per-step aggregates are weighted
        out.append(StepEvent(run_id=f"{run}-{i % 3}", step=i // 4, rank=i % 4, world_size=4, epoch=0, reward=i / 7,
                             n_samples=None if i % 29 == 0 else 10 * (i % 4 + 1), metrics={"m": float(i)}))
        if i % 10 == 0:
            out.append(EvalEvent(run_id=run, eval_id=f"e{i}", step=i, dataset="math500", accuracy=0.5,
                                 verdicts=[1, 0, 1], n_samples=3, replicas=3,
                                 samples=[{"prompt": f"q{i}", "response": "a", "verdict": 1}, {"prompt": "p", "response": "b"}]))
            out.append(EvalConsensusEvent(run_id=run, eval_id=f"e{i}", step=i, dataset="math500", accuracy=0.5,
                                          votes=3, replicas=3, agreement=1.0, dissenters=["n2"]))
            out.append(RewardSmoothedEvent(run_id=run, step=i, reward=0.1, window=5, sliding_avg=0.1, ema=0.1, slope=0.0))
            out.append(AlertEvent(run_id=run, kind="stalled", message=f"m{i}", step=i))
        if i % 25 == 0:
            out.append(CommandEvent(run_id=run, command="set_eval_interval", args={"steps": 5}))
    return out


def expected_counts(events: list[Event], invalid: int = 0) -> dict[str, int]:
    counts = {t.name: 0 for t in TABLES}
    for e in events:
        counts[type(e).table] += 1
        counts["generations"] += len(getattr(e, "samples", None) or ())  # one row per sample of an eval
    counts["deadletter"] += invalid
    return counts


class Producer:
    def __init__(self, bootstrap: str, topics: Topics) -> None:
        from kafka import KafkaProducer

        self.topics = topics
        self.producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)

    def send(self, event: Event) -> None:
        self.producer.send(self.topics.for_event(event), key=event.run_id.encode(), value=event.to_json())

    def send_raw(self, topic: str, value: bytes) -> None:
        self.producer.send(topic, key=b"r1", value=value)

    def close(self) -> None:
        self.producer.flush(30)
        self.producer.close(10)


def lag(bootstrap: str, topics: Topics, group: str, names: Sequence[str] | None = None) -> int:
    """Messages the group has not committed yet (all topics, or those `names`).

    The committed offsets are read before the log ends: the sink publishes a dead letter
    before it commits the bad message's offset, so an end read after a commit includes that
    dead letter. Read the other way round, an end read just before the dead letter and a
    commit read just after it gave 0 while the dead letter was not stored yet."""
    from kafka import KafkaConsumer
    from kafka.structs import TopicPartition

    # never subscribes, so it does not join (or disturb) the sink's group
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        tps = [TopicPartition(t, p) for t in (names or topics.all()) for p in range(3)]
        committed = {tp: consumer.committed(tp) or 0 for tp in tps}
        end = consumer.end_offsets(tps)
        return sum(end[tp] - committed[tp] for tp in tps)
    finally:
        consumer.close(autocommit=False)


def no_duplicate_positions(client) -> None:
    """Merges are stopped, so a block stored twice would leave two rows at one log position."""
    for t in TABLES:
        position = "_topic, _partition, _offset" + (", sample" if t.name == "generations" else "")
        n, distinct = client.query(f"SELECT count(), uniqExact({position}) FROM areal.{t.name}").result_rows[0]
        assert n == distinct, f"{t.name}: {n - distinct} rows stored twice"


def counts(client, final: bool = True) -> dict[str, int]:
    f = " FINAL" if final else ""
    return {t.name: int(client.command(f"SELECT count() FROM areal.{t.name}{f}")) for t in TABLES}


@pytest.fixture
def settings(kafka_bootstrap: str, topics: Topics, tmp_path: Path) -> Settings:
    return Settings(kafka_bootstrap=kafka_bootstrap, topic_prefix=topics.prefix,
                    clickhouse_url=f"chdb://{tmp_path / 'clickhouse'}")


@contextlib.contextmanager
def sink_in_a_thread(settings: Settings, policy: BatchPolicy, **options: Any) -> Iterator[Sink]:
    """A sink running in this process (its client and stats are the test's to read); stopped on exit."""
    sink = Sink(settings, policy=policy, **options)
    thread = threading.Thread(target=sink.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: sink.consumer is not None, 60, "the sink to start")
        yield sink
    finally:
        sink.stop()
        thread.join(30)
    assert not thread.is_alive()


@pytest.fixture
def running_sink(settings: Settings) -> Iterator[Sink]:
    with sink_in_a_thread(settings, BatchPolicy(max_rows=500, max_wait_s=0.1), stop_merges=True) as sink:
        yield sink


def test_resent_events_and_bad_input_give_exact_rows(running_sink: Sink, kafka_bootstrap: str, topics: Topics) -> None:
    events = make_events(300)
    producer = Producer(kafka_bootstrap, topics)
    for e in events:
        producer.send(e)
    resent = random.Random(1).sample(events, 60)
    for e in resent:
        producer.send(e)  # a producer retry: same event_id, same content
    producer.send_raw(topics.steps, b'{"type":"step","run_id":"r1","step":-1}')
    producer.send_raw(topics.evals, b"\xff not json")
    producer.send_raw(topics.deadletter, b"garbage on the dead-letter topic")
    producer.close()

    client = running_sink.client
    want = expected_counts(events, invalid=3)
    wait_for(lambda: lag(kafka_bootstrap, topics, running_sink.group) == 0, 60, "the sink to commit everything")
    assert counts(client) == want
    no_duplicate_positions(client)
    views = {t.name: int(client.command(f"SELECT count() FROM areal.{t.view}")) for t in TABLES}
    assert views == want
    assert_view_is_the_raw_rule(client)
    reasons = dict(client.query("SELECT source_topic, reason FROM areal.v_deadletter").result_rows)
    assert reasons[topics.steps] == "steps.event_id: missing"  # the envelope first
    assert reasons[topics.evals].startswith("event: not UTF-8")
    assert reasons[topics.deadletter].startswith("event: not valid JSON")
    assert running_sink.stats["dead_letters"] == 2  # the third was read FROM the dead-letter topic: stored only


def test_replay_rebuilds_identical_tables(running_sink: Sink, settings: Settings, kafka_bootstrap: str, topics: Topics, tmp_path: Path) -> None:
    events = make_events(200)
    producer = Producer(kafka_bootstrap, topics)
    for e in events + events[:20]:
        producer.send(e)
    producer.send_raw(topics.steps, b"{}")
    producer.close()
    want = expected_counts(events, invalid=1)
    wait_for(lambda: lag(kafka_bootstrap, topics, running_sink.group) == 0, 60, "ingestion")
    assert counts(running_sink.client) == want
    before = fingerprints(running_sink.client)

    # while the sink runs: `areal-metrics replay` goes through the sink that holds the store
    env = dict(os.environ, AREAL_KAFKA_BOOTSTRAP=kafka_bootstrap, AREAL_TOPIC_PREFIX=topics.prefix,
               AREAL_CLICKHOUSE_URL=settings.clickhouse_url)
    r = subprocess.run([sys.executable, "-m", "areal_metrics", "replay"], env=env, capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr
    assert dict(line.split("\t") for line in r.stdout.splitlines()) == {k: str(v) for k, v in want.items()}
    assert fingerprints(running_sink.client) == before

    # after the sink stopped: replay opens the store itself
    running_sink.stop()
    wait_for(lambda: not (Target.parse(settings.clickhouse_url).path / "owner.json").exists(), 30, "the sink to stop")
    time.sleep(0.5)
    client = open_client(Target.parse(settings.clickhouse_url), readonly=False, use_database=False)
    try:
        client.command("TRUNCATE TABLE areal.steps")  # damage: replay must repair it
        assert replay_into(client, settings) == want
        assert fingerprints(client) == before
        assert_view_is_the_raw_rule(client)  # replay made the per-step aggregates again
    finally:
        client.close()


def start_sink_process(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "areal_metrics.sinks"], env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def test_sigkill_mid_batch_repeatedly_loses_and_duplicates_nothing(stack_env: dict[str, str], kafka_bootstrap: str,
                                                                   topics: Topics, tmp_path: Path) -> None:
    env = dict(stack_env, AREAL_SINK_MAX_ROWS="150", AREAL_SINK_MAX_WAIT_MS="50", AREAL_SINK_STOP_MERGES="1",
               AREAL_LOG_LEVEL="DEBUG")
    log = tmp_path / "sink.log"
    events = make_events(1500)
    resent = events[::37]
    stream = events + resent
    random.Random(7).shuffle(stream)
    stop_producing = threading.Event()
    # One slice of the input per sink, released as that sink starts: every sink has
    # work to commit before it is killed, however slowly the machine restarts them.
    slices = [stream[i::5] for i in range(5)]
    go = [threading.Event() for _ in slices]

    def produce() -> None:
        producer = Producer(kafka_bootstrap, topics)
        for part, released in zip(slices, go):
            assert released.wait(300)
            for i, e in enumerate(part):
                producer.send(e)
                if i % 100 == 99:
                    producer.producer.flush()
                    time.sleep(0.5)  # steady input, so kills land while batches are in flight
            producer.producer.flush()
        producer.close()
        stop_producing.set()

    producer_thread = threading.Thread(target=produce)
    sink = start_sink_process(env, log)
    try:
        producer_thread.start()
        rng = random.Random(3)
        kills = 0
        for released in go[:4]:
            released.set()
            # Kill a sink at work: once it has committed a batch (its start takes 1-2 s on a
            # quiet machine, far longer under load), a little later, mid-way through the next.
            wait_for(lambda: "committed" in log.read_text().rsplit("=== SIGKILL", 1)[-1], 120,
                     "the sink to commit a batch before it is killed")
            time.sleep(rng.uniform(0.0, 0.3))
            sink.send_signal(signal.SIGKILL)
            sink.wait(10)
            kills += 1
            log.open("a").write(f"=== SIGKILL {kills} ===\n")
            sink = start_sink_process(env, log)
        go[4].set()
        producer_thread.join(60)
        assert stop_producing.is_set()

        url = env["AREAL_CLICKHOUSE_URL"]
        want = expected_counts(events)

        wait_for(lambda: lag(kafka_bootstrap, topics, f"{topics.prefix}sink") == 0, 60, "the restarted sink to catch up")
        sink.send_signal(signal.SIGTERM)
        assert sink.wait(30) == 0, log.read_text()[-3000:]
    finally:  # never leave a sink behind: an orphan keeps a core busy after the session's broker is gone
        if sink.poll() is None:
            sink.kill()
            sink.wait(10)

    client = open_client(Target.parse(url), readonly=True, use_database=False)
    try:
        got = counts(client)
        retried = [line for line in log.read_text().splitlines() if "re-inserting" in line or "were not stored" in line]
        # no loss, no double count; when not, which batches were retried after a kill
        assert got == want, (got, counts(client, final=False), retried)
        no_duplicate_positions(client)  # and no block stored twice, in spite of the kills
        assert_view_is_the_raw_rule(client)  # the per-step aggregates: each step's ranks counted once
    finally:
        client.close()
    assert kills == 4


def test_store_outage_backs_off_and_catches_up(running_sink: Sink, kafka_bootstrap: str, topics: Topics) -> None:
    """A table that cannot take inserts (detached: the real engine refuses them) holds the offsets back."""
    client = running_sink.client
    first = make_events(50)
    producer = Producer(kafka_bootstrap, topics)
    for e in first:
        producer.send(e)
    producer.producer.flush()
    wait_for(lambda: lag(kafka_bootstrap, topics, running_sink.group) == 0, 60, "the first events")

    client.command("DETACH TABLE areal.steps")
    second = make_events(80, run="r2")
    for e in second:
        producer.send(e)
    producer.close()
    wait_for(lambda: running_sink.stats["retries"] >= 2, 30, "the sink to retry")
    assert lag(kafka_bootstrap, topics, running_sink.group) > 0  # nothing committed that is not stored
    client.command("ATTACH TABLE areal.steps")

    wait_for(lambda: lag(kafka_bootstrap, topics, running_sink.group) == 0, 60, "the sink to catch up")
    assert counts(client) == expected_counts(first + second)
    no_duplicate_positions(client)


def test_a_consumer_that_stops_fetching_is_replaced_and_what_it_buffered_stored_once(
        settings: Settings, kafka_bootstrap: str, topics: Topics) -> None:
    """kafka-python 3.0.x has been seen to keep partitions assigned, positions set, and fetch nothing
    for 60-90 s (sinks/fetch_watch.py). The fault is made here with the consumer's own pause() of one
    partition, behind the sink's back, while the others' rows wait in the sink's buffer (max_wait 8 s).
    The sink stores what it buffered through the old consumer, makes a new one, and every row goes in once."""
    with sink_in_a_thread(settings, BatchPolicy(max_rows=5_000, max_wait_s=8, idle_s=0), stop_merges=True,
                          stall_s=2.0) as sink:
        wait_for(lambda: len(sink.consumer.assignment()) == 3 * len(topics.all()), 60, "the sink's partitions")
        from kafka.structs import TopicPartition

        stuck = sink.consumer
        stuck.pause(TopicPartition(topics.steps, 0))
        producer = Producer(kafka_bootstrap, topics)
        events = [StepEvent(run_id="stall", step=s, rank=r, world_size=3, epoch=0, reward=s / 10 + r)
                  for s in range(30) for r in range(3)]
        for e in events:  # a rank to a partition
            producer.producer.send(topics.steps, key=b"stall", value=e.to_json(), partition=e.rank)
        producer.close()
        wait_for(lambda: sink.stats["new_consumers"] == 1, 30, "the sink to replace its consumer")
        assert sink.consumer is not stuck
        assert sink.stats["rows"] == 60  # stored at the replacement, before their max_wait
        wait_for(lambda: lag(kafka_bootstrap, topics, sink.group) == 0, 60, "every row stored")
        _stored_once(sink.client, events)
        assert sink.stats["new_consumers"] == 1


def test_a_rebalance_that_waits_for_a_slow_member_is_not_taken_for_a_stalled_consumer(
        settings: Settings, kafka_bootstrap: str, topics: Topics) -> None:
    """During a rebalance kafka-python keeps the partitions assigned and fetches none of them until the group
    is joined again, which waits for every member, up to its rebalance timeout (a member that stopped
    polling: minutes). The sink's positions stand still behind their ends meanwhile: it does not replace its
    consumer for that."""
    from kafka import KafkaConsumer

    from areal_metrics.stack.kafka_broker import create_topics

    create_topics(kafka_bootstrap, [topics.prefix + "elsewhere"])
    with sink_in_a_thread(settings, BatchPolicy(max_wait_s=0.1), stop_merges=True, stall_s=2.0) as sink:
        wait_for(lambda: len(sink.consumer.assignment()) == 3 * len(topics.all()), 60, "the sink's partitions")
        slow = KafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=sink.group, enable_auto_commit=False,
                             max_poll_interval_ms=60_000)
        slow.subscribe([topics.prefix + "elsewhere"])
        wait_for(lambda: slow.poll(timeout_ms=200) is not None and bool(slow.assignment()), 60, "the slow member")
        joining = KafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=sink.group, enable_auto_commit=False)
        joining.subscribe([topics.prefix + "elsewhere"])
        done = threading.Event()

        def poll_until_done() -> None:
            while not done.is_set():
                joining.poll(timeout_ms=200)

        thread = threading.Thread(target=poll_until_done, daemon=True)
        thread.start()
        try:  # the slow member polls no more: the rebalance the joining one began waits for it
            wait_for(lambda: bool(sink.revoked), 30, "the sink in the rebalance")
            producer = Producer(kafka_bootstrap, topics)
            events = make_events(40)
            for e in events:
                producer.send(e)
            producer.close()
            time.sleep(8.0)  # four checks
            assert sink.revoked and lag(kafka_bootstrap, topics, sink.group) > 0  # still waiting, rows behind
            assert sink.stats["new_consumers"] == 0
        finally:
            slow.close()
            done.set()
            thread.join(30)
            joining.close()
        # Not asserted: that the rebalance then completes within a minute. In one CI run under load the sink,
        # which had revoked its partitions in a second rebalance right after the first (the leader's metadata
        # lacked the other member's topic), was not assigned again within 60 s of the slow member leaving:
        # a join that does not complete; the sink replaces its consumer only past the group's rebalance timeout
        # (600 s; docs/RELIABILITY.md).


def test_the_end_of_a_burst_is_stored_without_waiting_out_max_wait(settings: Settings, kafka_bootstrap: str,
                                                                   topics: Topics) -> None:
    """A minute's max_wait, but the log goes quiet after the burst: the rows are stored at once."""
    with sink_in_a_thread(settings, BatchPolicy(max_rows=5_000, max_wait_s=60, idle_s=0.05)) as sink:
        wait_for(lambda: bool(sink.consumer.assignment()), 30, "the sink's partitions")
        time.sleep(0.5)  # past the first poll, so the burst does not find a buffer aged since start-up
        producer = Producer(kafka_bootstrap, topics)
        events = [StepEvent(run_id="burst", step=i, epoch=0, reward=0.5) for i in range(50)]
        for e in events:
            producer.send(e)
        producer.close()
        # the sink counts its rows just after the insert that made them visible
        wait_for(lambda: counts(sink.client)["steps"] == 50 and sink.stats["rows"] == 50, 30,
                 "the burst's rows, long before max_wait")


def test_a_rebalance_while_rows_are_buffered_loses_none(settings: Settings, kafka_bootstrap: str,
                                                         topics: Topics) -> None:
    """Another member joins the sink's group while 50 rows wait in the sink's buffer, and the sink keeps
    its partitions. The buffer is dropped on the rebalance; kafka-python 3 keeps the positions of
    partitions kept, so the sink must seek back to its last commit, or those rows are never stored
    and the next commit steps over them."""
    from kafka import KafkaConsumer

    from areal_metrics.stack.kafka_broker import create_topics

    create_topics(kafka_bootstrap, [topics.prefix + "elsewhere"])
    with sink_in_a_thread(settings, BatchPolicy(max_rows=5_000, max_wait_s=10, idle_s=0)) as sink:
        wait_for(lambda: len(sink.consumer.assignment()) == 3 * len(topics.all()), 60, "the sink's partitions")
        producer = Producer(kafka_bootstrap, topics)
        for i in range(50):
            producer.send(StepEvent(run_id="kept", step=i, epoch=0, reward=0.5))
        producer.producer.flush()
        wait_for(lambda: sink.batcher.total == 50, 30, "the 50 rows in the sink's buffer")
        other = KafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=sink.group, enable_auto_commit=False)
        try:
            other.subscribe([topics.prefix + "elsewhere"])  # a topic of its own: the sink keeps all of its partitions
            wait_for(lambda: other.poll(timeout_ms=200) is not None and bool(other.assignment()), 60,
                     "the other member's join")
            assert sink.stats["rows"] == 0  # the rebalance came before the buffer's max_wait
            for i in range(50, 60):
                producer.send(StepEvent(run_id="kept", step=i, epoch=0, reward=0.5))
            producer.close()
            wait_for(lambda: lag(kafka_bootstrap, topics, sink.group) == 0, 60, "the sink to commit everything")
        finally:
            other.close()
        assert counts(sink.client)["steps"] == 60
        no_duplicate_positions(sink.client)


def test_a_commit_refused_by_a_rebalance_under_way_is_made_after_the_next_poll(settings: Settings,
                                                                               kafka_bootstrap: str,
                                                                               topics: Topics) -> None:
    """The broker refuses an offset commit (REBALANCE_IN_PROGRESS) while the group waits for a
    member's SyncGroup, and the sink sends that only from its poll: a sink that retried the
    commit without polling waited forever (a fault soak saw it once in 20 runs, the sink being
    the group's only member and so its leader). That state cannot be reached on purpose from
    outside the client, so the test gives the broker's answer to every commit from the first
    one until the sink polls again, as the broker would; everything else is the real broker.
    The sink must commit after its next poll, with every row stored once."""
    from kafka.errors import RebalanceInProgressError

    with sink_in_a_thread(settings, BatchPolicy(max_rows=5_000, max_wait_s=0.5)) as sink:
        wait_for(lambda: len(sink.consumer.assignment()) == 3 * len(topics.all()), 60, "the sink's partitions")
        real_commit, real_poll = sink.consumer.commit, sink.consumer.poll
        state = {"refused": 0, "waiting_for_poll": False, "done": False}

        def commit(offsets: Any) -> Any:
            if not state["done"]:
                state["waiting_for_poll"] = True
                state["refused"] += 1
                raise RebalanceInProgressError("the group is rebalancing (the test's answer for the broker)")
            return real_commit(offsets)

        def poll(*args: Any, **kwargs: Any) -> Any:
            if state["waiting_for_poll"]:
                state["done"] = True  # the poll would send the SyncGroup: the rebalance is over
            return real_poll(*args, **kwargs)

        sink.consumer.commit, sink.consumer.poll = commit, poll
        producer = Producer(kafka_bootstrap, topics)
        for i in range(50):
            producer.send(StepEvent(run_id="refused", step=i, epoch=0, reward=0.5))
        producer.close()
        wait_for(lambda: lag(kafka_bootstrap, topics, sink.group) == 0, 60, "the sink to commit everything")
        assert state["refused"] == 1  # put off once, not retried against the rebalance
        assert counts(sink.client)["steps"] == 50
        no_duplicate_positions(sink.client)


def test_the_sink_joins_its_group_only_once_its_metadata_has_every_topic(settings: Settings, topics: Topics,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A group leader that assigns from empty metadata gives itself nothing: a CI run's sink once
    joined that way (`No partition metadata for topic ...`) and stored nothing for a minute."""
    import kafka

    known_at_join: dict[str, object] = {}
    subscribe = kafka.KafkaConsumer.subscribe

    def noting_metadata(self, topics=(), *args, **kwargs):
        known_at_join.update({t: self._cluster.partitions_for_topic(t) for t in topics})
        return subscribe(self, topics, *args, **kwargs)

    monkeypatch.setattr(kafka.KafkaConsumer, "subscribe", noting_metadata)
    with sink_in_a_thread(settings, BatchPolicy(max_rows=500, max_wait_s=0.1)) as sink:
        wait_for(lambda: len(sink.consumer.assignment()) == 3 * len(topics.all()), 60, "every partition assigned")
    assert known_at_join == {t: {0, 1, 2} for t in topics.all()}


def test_replay_refuses_to_lose_data(settings: Settings, kafka_bootstrap: str, topics: Topics, tmp_path: Path) -> None:
    """No topics, or a log whose start retention deleted: refused before any table is touched."""
    from kafka import KafkaAdminClient
    from kafka.structs import TopicPartition

    from areal_metrics.sinks.migrations import apply_schema
    from areal_metrics.sinks.replay import ReplayRefused
    from areal_metrics.sinks.rows import Located
    from areal_metrics.sinks.writer import insert_rows

    client = open_client(Target.parse(settings.clickhouse_url), readonly=False, use_database=False)
    try:
        apply_schema(client)
        insert_rows(client, "areal", [Located(StepEvent(run_id="keep", step=0, epoch=0), topics.steps, 0, 0)], "k")
        wrong = Settings(kafka_bootstrap=kafka_bootstrap, topic_prefix="nosuchprefix.", clickhouse_url=settings.clickhouse_url)
        with pytest.raises(ReplayRefused, match="no topics named nosuchprefix"):
            replay_into(client, wrong)

        producer = Producer(kafka_bootstrap, topics)
        for e in make_events(30):
            producer.send(e)
        producer.close()
        admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        try:
            admin.delete_records({TopicPartition(topics.steps, p): 1 for p in range(3)})
        finally:
            admin.close()
        with pytest.raises(ReplayRefused, match="retention deleted events"):
            replay_into(client, settings)
        assert int(client.command("SELECT count() FROM areal.steps")) == 1  # untouched
        rebuilt = replay_into(client, settings, force=True)
        assert rebuilt["steps"] == 30 - 3  # forced: what the log still has
    finally:
        client.close()


def test_sink_waits_for_a_store_held_by_another_process(stack_env: dict[str, str], kafka_bootstrap: str,
                                                         topics: Topics, tmp_path: Path) -> None:
    """chdb's one-process rule: while a reader holds the directory the sink retries, then takes over."""
    url = stack_env["AREAL_CLICKHOUSE_URL"]
    holder = open_client(Target.parse(url), readonly=False, use_database=False)  # e.g. a long `report`
    producer = Producer(kafka_bootstrap, topics)
    events = make_events(40)
    for e in events:
        producer.send(e)
    producer.close()
    log = tmp_path / "sink.log"
    sink = start_sink_process(stack_env, log)
    try:
        wait_for(lambda: "opening the store failed" in log.read_text(), 30, "the sink to find the store held")
        holder.close()
        wait_for(lambda: lag(kafka_bootstrap, topics, f"{topics.prefix}sink") == 0, 60, "the sink to take over")
        from clickhouse_connect.driver.httpclient import HttpClient

        from areal_metrics.sinks.query import connect

        with connect(Settings(clickhouse_url=url)) as store:  # through the sink's ClickHouse HTTP endpoint
            assert isinstance(store.client, HttpClient)
            assert store.command("SELECT count() FROM v_steps") == 40
    finally:
        sink.send_signal(signal.SIGTERM)
        assert sink.wait(30) == 0, log.read_text()[-2000:]


def test_a_wandb_users_summary_and_notes_are_found_with_sql_once(running_sink: Sink, kafka_bootstrap: str,
                                                                topics: Topics, tmp_path: Path) -> None:
    """Issue 44, item 6: `init(notes=...)` and `run.summary[...] = v` from the client, through Kafka, into
    `runs` and `v_runs`; every run event delivered a second time (a producer's retry) is stored once."""
    from areal_metrics.producers.client.run import init
    from areal_metrics.producers.contract.events import parse_event
    from tests.kafka_reading import read_to_end

    run = init(run_id="wb-summary", config={"lr": 1e-5}, notes="trying a smaller lr", kafka_bootstrap=kafka_bootstrap,
               topic_prefix=topics.prefix, journal_dir=str(tmp_path / "journal"), git=False, rank=0, world_size=1)
    run.log({"reward": 0.25}, step=0)
    run.summary["best_acc"] = 0.4
    run.summary["eval"] = {"math500": 0.5}
    run.finish()
    sent = [parse_event(m.value) for m in read_to_end(kafka_bootstrap, topics.runs)]
    assert [e.status for e in sent] == ["running", "finished"]
    producer = Producer(kafka_bootstrap, topics)
    for e in sent:
        producer.send(e)  # the same events again: same event_id, same content, later offsets
    producer.close()

    client = running_sink.client
    wait_for(lambda: lag(kafka_bootstrap, topics, running_sink.group) == 0, 60, "the sink to commit everything")
    assert counts(client)["runs"] == 2 and int(client.command("SELECT count() FROM areal.runs")) == 4
    no_duplicate_positions(client)
    assert client.query("SELECT status, notes, summary FROM areal.runs FINAL ORDER BY status = 'finished', ts").result_rows == [
        ("running", "trying a smaller lr", None),
        ("finished", "trying a smaller lr", '{"best_acc":0.4,"eval":{"math500":0.5}}')]
    assert client.query("SELECT run_id, status, notes, JSONExtractFloat(summary, 'best_acc'), "
                        "JSONExtractFloat(summary, 'eval', 'math500') FROM areal.v_runs").result_rows == [
        ("wb-summary", "finished", "trying a smaller lr", 0.4, 0.5)]


class _Crash(RuntimeError):
    """The test's kill: the sink stops where it is, with nothing after it done."""


AGGREGATE_TABLES = ("step_aggregates", "rank_aggregates", "rank_aggregates_coarse")


class _CrashingSink(Sink):
    """A sink that dies at its first flush: before it inserts a block; or after, before it commits; or there,
    having lost what the block added to the tables its materialized views fill (as a kill between the
    block's part and theirs does)."""

    def __init__(self, settings: Settings, policy: BatchPolicy, where: str) -> None:
        super().__init__(settings, policy=policy, stop_merges=True)
        self.where = where

    def _store_block(self, block: Any, token: str, retried: bool = False) -> Any:
        if self.where == "before insert":
            raise _Crash(self.where)
        return super()._store_block(block, token, retried)

    def _commit(self, chunks: Any) -> None:
        if self.where == "views lost":
            for table in AGGREGATE_TABLES:
                self.client.command(f"TRUNCATE TABLE areal.{table}")
        if self.where in ("before commit", "views lost"):
            raise _Crash(self.where)
        super()._commit(chunks)


def _run_until_crash(sink: Sink) -> None:
    def run() -> None:
        with contextlib.suppress(_Crash):
            sink.run()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(90)
    assert not thread.is_alive(), "the sink did not reach its first flush"


def steps_parts(client: Any) -> int:
    return int(client.command("SELECT count() FROM system.parts WHERE database = 'areal' AND table = 'steps' "
                              "AND active"))


def _one_run_over_three_partitions(kafka_bootstrap: str, topics: Topics) -> list[StepEvent]:
    producer = Producer(kafka_bootstrap, topics)
    events = [StepEvent(run_id="block", step=s, rank=r, world_size=3, epoch=0, reward=s / 10 + r,
                        n_samples=r + 1, latency_ms=10.0 + s, metrics={"m": float(r)}) for s in range(40) for r in range(3)]
    for e in events:  # a rank to a partition
        producer.producer.send(topics.steps, key=b"block", value=e.to_json(), partition=e.rank)
    producer.close()
    return events


def _rewrite_plans(settings: Settings, last_offset: str = "last_offset", block: str = "block",
                   where: str = "1") -> None:
    """Record the crashed sink's plans again with these expressions, as a rebalance or a slow partition leaves them."""
    from areal_metrics.sinks.schema import BATCH_PLANS

    store = open_client(Target.parse(settings.clickhouse_url), readonly=False, use_database=False)
    try:
        store.command(f"INSERT INTO areal.{BATCH_PLANS} (consumer_group, topic, partition, first_offset, "
                      f"last_offset, block) SELECT consumer_group, topic, partition, first_offset, {last_offset}, "
                      f"{block} FROM areal.{BATCH_PLANS} FINAL WHERE {where}")
    finally:
        store.close()


def _a_crashed_block_read_in_part(settings: Settings, kafka_bootstrap: str, topics: Topics,
                                  where: str) -> list[StepEvent]:
    """A sink crashed at its first flush (`where`), its block's plans then naming a fourth partition too, as
    a block read in part by this sink does (another member reads that partition after a rebalance)."""
    events = _one_run_over_three_partitions(kafka_bootstrap, topics)
    _run_until_crash(_CrashingSink(settings, BatchPolicy(max_rows=len(events), max_wait_s=60, idle_s=0), where))
    _rewrite_plans(settings, block="concat(block, '+', topic, ':3:0-39')")
    return events


def _stored_once(client: Any, events: list[StepEvent]) -> None:
    assert counts(client, final=False)["steps"] == len(events)
    no_duplicate_positions(client)
    assert_view_is_the_raw_rule(client)  # the aggregates hold each row once too


@pytest.mark.parametrize("where", ["before insert", "before commit", "views lost"])
def test_a_flush_stores_a_topic_as_one_block_and_after_a_crash_the_same_block_again(
        settings: Settings, kafka_bootstrap: str, topics: Topics, where: str) -> None:
    """A flush's chunks of one topic (here one per partition) go into the store as one INSERT: the store's
    cost is mostly per INSERT. After a crash the next sink waits for every chunk of that block and inserts
    the same block with the same token: the store drops the rows it holds, and the tables its views fill
    get what they lost."""
    events = _one_run_over_three_partitions(kafka_bootstrap, topics)
    policy = BatchPolicy(max_rows=len(events), max_wait_s=60, idle_s=0)  # one flush, once all are read
    _run_until_crash(_CrashingSink(settings, policy, where))
    # the default policy: flushed once the block's three chunks are read (Batcher.take waits for them)
    with sink_in_a_thread(settings, BatchPolicy(), stop_merges=True) as again:
        wait_for(lambda: lag(kafka_bootstrap, topics, again.group, [topics.steps]) == 0, 60, "the retried flush")
        assert again.stats["replanned"] == 3  # the crashed flush's three chunks, cut again by their plans
        assert again.stats["restored"] == 0  # the token stored what was missing
        assert steps_parts(again.client) == 1  # one block, stored once
        _stored_once(again.client, events)


@pytest.mark.parametrize("where", ["before insert", "before commit", "views lost"])
def test_a_block_retried_without_a_partition_of_it_stores_each_row_once(
        settings: Settings, kafka_bootstrap: str, topics: Topics, where: str) -> None:
    """A block whose chunks cannot all be cut again by this sink (here: its plans name a fourth partition,
    as when another member of the group reads one after a rebalance): its token cannot be given again, so
    each chunk is stored alone, of its rows those the store does not hold, and those the tables its views
    fill did not count ("views lost": they are inserted again; `steps` keeps one copy of each)."""
    events = _a_crashed_block_read_in_part(settings, kafka_bootstrap, topics, where)
    with sink_in_a_thread(settings, BatchPolicy(), stop_merges=True) as again:
        wait_for(lambda: lag(kafka_bootstrap, topics, again.group, [topics.steps]) == 0, 60, "the retried chunks")
        assert again.stats["replanned"] == 3
        assert again.stats["restored"] == (0 if where == "before commit" else len(events))
        # a block each, or none; after "views lost" the crashed block's part and one a chunk
        assert steps_parts(again.client) == {"before insert": 3, "before commit": 1, "views lost": 4}[where]
        if where == "views lost":  # in `steps` twice until a merge; once through its view
            assert counts(again.client)["steps"] == len(events)
            assert_view_is_the_raw_rule(again.client)
            assert_buckets_are_the_raw_rule(again.client)
        else:
            _stored_once(again.client, events)
        # their plans name a block no cut gives: a later retry of them is never taken for the whole block
        plans = load_plans(again.client, "areal", again.group)
        assert {p.group.split(":")[0] for tp, p in plans.items() if tp[0] == topics.steps} == {"split"}


def test_partitions_held_for_a_retried_block_are_paused_until_it_goes_in(
        settings: Settings, kafka_bootstrap: str, topics: Topics) -> None:
    """After a crash, a block's partitions read to their plans' ends wait for its slow one (here: partition 1,
    whose plan ends 20 rows past what its log holds yet). Meanwhile they are paused: rows written to them are
    not fetched into a buffer that would only grow. The slow rows come, the block goes in, they are resumed,
    and every row is stored once."""
    events = _one_run_over_three_partitions(kafka_bootstrap, topics)
    _run_until_crash(_CrashingSink(settings, BatchPolicy(max_rows=len(events), max_wait_s=60, idle_s=0),
                                   "before insert"))
    _rewrite_plans(settings, last_offset="last_offset + 20", where="partition = 1")
    with sink_in_a_thread(settings, BatchPolicy(max_wait_s=0.1, replan_wait_s=60), stop_merges=True) as again:
        wait_for(lambda: again.paused == {(topics.steps, 0), (topics.steps, 2)}, 60, "the held partitions paused")
        producer = Producer(kafka_bootstrap, topics)
        later = [StepEvent(run_id="block", step=40 + i, rank=0, world_size=3, epoch=0, reward=1.0) for i in range(30)]
        for e in later:
            producer.producer.send(topics.steps, key=b"block", value=e.to_json(), partition=0)
        producer.producer.flush()
        time.sleep(2.0)  # many polls: a partition fetched would have these in its buffer
        assert again.batcher.buffered((topics.steps, 0)) == 40
        slow = [StepEvent(run_id="block", step=100 + i, rank=1, world_size=3, epoch=0, reward=1.0) for i in range(20)]
        for e in slow:
            producer.producer.send(topics.steps, key=b"block", value=e.to_json(), partition=1)
        producer.close()
        wait_for(lambda: lag(kafka_bootstrap, topics, again.group, [topics.steps]) == 0, 60, "every row stored")
        assert again.paused == set() and not again.consumer.paused()
        _stored_once(again.client, events + later + slow)


def test_chunks_stored_alone_and_interrupted_again_keep_one_split_plan(
        settings: Settings, kafka_bootstrap: str, topics: Topics) -> None:
    """A block retried without a partition of it is stored chunk by chunk and its plans re-recorded as split;
    a second crash before the commit, then a third sink: the plans still name it split once (a prefix per
    crash grew without bound), and every row is stored once."""
    events = _a_crashed_block_read_in_part(settings, kafka_bootstrap, topics, "before commit")
    _run_until_crash(_CrashingSink(settings, BatchPolicy(replan_wait_s=0), "before commit"))
    with sink_in_a_thread(settings, BatchPolicy(), stop_merges=True) as again:
        wait_for(lambda: lag(kafka_bootstrap, topics, again.group, [topics.steps]) == 0, 60, "the retried chunks")
        _stored_once(again.client, events)
        plans = load_plans(again.client, "areal", again.group)
        assert {p.group.count("split:") for tp, p in plans.items() if tp[0] == topics.steps} == {1}
