"""The sink loop: every topic -> its ClickHouse table, exactly once.

Per flush: cut chunks (one per partition, `Batcher`); for each topic, record
its chunks' plans (each naming the block's token) and insert them as one block
with that token (the store's cost is mostly per INSERT); publish the dead
letters, and only then commit the Kafka offsets. A crash anywhere in between
re-reads the same messages from the last committed offset, the plans cut the
same chunks, and `Batcher.take` waits until a block's chunks are all cut again:
the block goes in again with its token, so ClickHouse drops what it has and the
tables its views fill get what they lack (and `FINAL` collapses any re-sent
event by `event_id`). A block that cannot be cut again whole goes in chunk by
chunk, of its rows those the store lacks (docs/CLICKHOUSE.md). When the store
is down the sink retries with backoff, holding its position; nothing is
committed that is not stored.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from areal_metrics.producers.runtime.backoff import Backoff
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.producers.runtime.kafka_wait import closed_on_failure, quick_bootstrap, until_kafka_answers
from areal_metrics.producers.runtime.topic_metadata import known_partitions
from areal_metrics.sinks.batching import (
    Batcher,
    BatchPolicy,
    Chunk,
    Plan,
    TopicPartition,
    block_token,
    blocks_by_topic,
    dedup_token,
)
from areal_metrics.producers.runtime.poison import OK, POISON, CrashGuard, crash_now, poison_events, spans
from areal_metrics.sinks.fetch_watch import FetchWatch
from areal_metrics.sinks.decode import SINK_NODE, Decoded, dead_letter, decode
from areal_metrics.sinks.http.server import QueryLimits
from areal_metrics.sinks.isolate import DataError, is_data_error, isolate
from areal_metrics.sinks.migrations import apply_schema
from areal_metrics.sinks.query import Target, open_client
from areal_metrics.sinks.rows import Located
from areal_metrics.sinks.schema import TABLES, SchemaOptions
from areal_metrics.sinks.writer import insert_missing, insert_rows, load_plans, record_plans
from areal_metrics.producers.contract.errors import ArealError

log = logging.getLogger("areal.sink")
_TOPIC_WAIT_S = 30.0  # for every topic's partitions, before joining the group
_SPLIT = "split:"  # the block a plan names once its chunk was stored alone after a crash
# the sink's max_poll_interval_ms, which is also its rebalance timeout: how long the coordinator waits for a
# member to join a rebalance (a sink retrying its insert through a store outage polls no more)
_REBALANCE_TIMEOUT_MS = 600_000
_OFFSETS_TIMEOUT_MS = 5_000  # the fetch watch's reads of positions and end offsets
R = TypeVar("R")


class Stopped(ArealError):
    """The sink was asked to stop while waiting for the store."""


def consumer_group(settings: Settings) -> str:
    return f"{settings.topic_prefix}sink"


class Sink:
    def __init__(
        self,
        settings: Settings,
        *,
        policy: BatchPolicy = BatchPolicy(),
        backoff: Backoff = Backoff(),
        group: str | None = None,
        serve_queries: bool = True,
        http_port: int = 0,
        schema: SchemaOptions | None = None,
        stop_merges: bool = False,
        guard: CrashGuard | None = None,
        crash_marker: bytes | None = None,
        instance_id: str | None = None,
        query_limits: QueryLimits | None = None,
        stall_s: float = 30.0,
    ) -> None:
        self.settings = settings
        self.topics = settings.topics
        self.target = Target.parse(settings.clickhouse_url)
        self.schema = schema or SchemaOptions.from_settings(settings, self.target.database,
                                                            embedded=self.target.kind == "chdb")
        self.policy = policy
        self.backoff = backoff
        self.group = group or consumer_group(settings)
        # the static member id (AREAL_SINK_INSTANCE_ID), else one per group and host
        self.instance_id = instance_id or f"{self.group}@{socket.gethostname()}"
        self.query_limits = query_limits or QueryLimits()  # the endpoint's bounds of a reader query (AREAL_HTTP_*)
        self.serve_queries = serve_queries  # the embedded store: serve it over ClickHouse's HTTP interface
        self.http_port = http_port  # 0: a free port (recorded in <store>/owner.json)
        # audits and tests: keep every inserted block unmerged, so a block stored
        # twice would show in the raw (non-FINAL) counts
        self.stop_merges = stop_merges
        # a crash never loops (producers/runtime/poison.py): the positions in flight, the suspects;
        # `crash_marker`: its test hook (AREAL_TEST_CRASH_ON)
        self.guard = guard
        self.crash_marker = crash_marker
        self.stop_event = threading.Event()
        self.batcher: Batcher[Any] = Batcher(policy)
        self.revoked: set[TopicPartition] = set()  # by a rebalance under way: dropped unless assigned again
        self.paused: set[TopicPartition] = set()  # by the sink itself (`_pause_held`), not fetched on purpose
        self.rebalance_since: float | None = None  # when the rebalance under way began (`revoked`)
        self._replacing = False  # a flush before the consumer is replaced: its commit is tried once
        self.uncommitted: dict[Any, Any] = {}  # stored offsets a rebalance kept us from committing yet
        self.plans: dict[TopicPartition, Plan] = {}
        # a consumer that stopped fetching is replaced after `stall_s` to `2 * stall_s` (0: never)
        self.watch: FetchWatch[Any] = FetchWatch(stall_s)
        self.stats = {"rows": 0, "chunks": 0, "dead_letters": 0, "retries": 0, "commits": 0, "replanned": 0,
                      "unstorable": 0, "restored": 0, "poison": 0, "new_consumers": 0}
        self.client: Any = None
        self.consumer: Any = None
        self.producer: Any = None
        self.endpoint: Any = None
        self._kafka_config: dict[str, Any] = {}

    # ------------------------------------------------------------ plumbing

    def _retry(self, what: str, fn: Callable[[], R], *, data_errors: bool = False) -> R:
        """Run fn until it succeeds, backing off; raise Stopped when asked to stop meanwhile.
        With `data_errors`, an error no retry can pass (isolate.is_data_error) raises DataError."""
        attempt = 0
        while True:
            try:
                return fn()
            except (Stopped, ImportError):  # a missing package does not come back by waiting
                raise
            except Exception as exc:  # noqa: BLE001 - the store or broker is down: wait, never drop
                if data_errors and is_data_error(exc):
                    raise DataError(exc) from exc
                attempt += 1
                self.stats["retries"] += 1
                delay = self.backoff.delay(attempt)
                log.warning("%s failed (attempt %d, retrying in %.1fs): %s", what, attempt, delay, " ".join(str(exc).split())[:300])
                if self.stop_event.wait(delay):
                    raise Stopped from None

    def _open_store(self) -> None:
        def open_and_migrate() -> Any:
            client = open_client(self.target, readonly=False, use_database=False)
            try:
                apply_schema(client, self.schema)
                if self.stop_merges:
                    for t in TABLES:
                        client.command(f"SYSTEM STOP MERGES {self.schema.database}.{t.name}")
            except Exception:
                client.close()
                raise
            return client

        self.client = self._retry("opening the store", open_and_migrate)
        if self.target.kind == "chdb" and self.serve_queries:
            from areal_metrics.sinks.http.server import ClickHouseHTTPServer

            assert self.target.path is not None
            self.endpoint = ClickHouseHTTPServer(self.target.path, self.schema.database, port=self.http_port,
                                                 limits=self.query_limits)
            self.endpoint.publish()
        self.plans = self._retry("loading batch plans", lambda: load_plans(self.client, self.schema.database, self.group))

    def _listener(self) -> Any:
        from kafka import ConsumerRebalanceListener

        sink = self

        class Listener(ConsumerRebalanceListener):
            # A rebalance revokes every partition, then assigns the new set. kafka-python 3
            # keeps the position of a partition the sink keeps, so its buffer is kept too
            # (dropped, its rows would never be read again and the next commit would step
            # over them); where a client resets the position to the last commit instead,
            # the batcher skips the offsets it already holds. Only what went elsewhere is dropped.
            def on_partitions_revoked(self, revoked: Any) -> None:
                sink.revoked |= {(tp.topic, tp.partition) for tp in revoked}
                if sink.rebalance_since is None:
                    sink.rebalance_since = time.monotonic()

            def on_partitions_assigned(self, assigned: Any) -> None:
                kept = set(assigned)
                sink.batcher.drop(sink.revoked - {(tp.topic, tp.partition) for tp in kept})
                sink.revoked = set()
                sink.rebalance_since = None
                # what went elsewhere is its new owner's to commit (it re-reads from our last commit)
                sink.uncommitted = {tp: o for tp, o in sink.uncommitted.items() if tp in kept}
                try:
                    sink.plans = load_plans(sink.client, sink.schema.database, sink.group)
                except Exception as exc:  # noqa: BLE001 - keep the plans we have
                    log.warning("could not reload batch plans: %s", exc)

        return Listener()

    def _new_consumer(self) -> Any:
        """A member of the sink's group, subscribed to every topic (waits for their partitions first)."""
        from kafka import KafkaConsumer

        consumer = closed_on_failure(
            KafkaConsumer,
            **self._kafka_config,
            group_id=self.group,
            client_id="areal-sink",
            enable_auto_commit=False,  # offsets are committed after the insert, by hand
            auto_offset_reset="earliest",
            max_poll_interval_ms=_REBALANCE_TIMEOUT_MS,  # a long store outage must not look like a dead consumer
            # static membership: a sink restarted after a crash takes its old place at
            # once instead of waiting for the dead member's session to expire
            group_instance_id=self.instance_id,
            session_timeout_ms=10_000,
            isolation_level="read_committed",
        )
        try:
            # Join the group once the metadata has every topic's partitions: a leader that
            # assigned from empty metadata gave itself nothing (seen in CI: the sink stored
            # nothing for over a minute, until another rebalance).
            topics = self.topics.all()
            missing = set(topics) - set(known_partitions(consumer, topics, _TOPIC_WAIT_S, self.stop_event))
            if missing and not self.stop_event.is_set():
                log.warning("topics without partitions after %.0f s: %s; subscribing anyway", _TOPIC_WAIT_S,
                            ", ".join(sorted(missing)))
            consumer.subscribe(topics, listener=self._listener())
            return consumer
        except BaseException:
            consumer.close(autocommit=False)
            raise

    def _until_kafka_answers(self, make: Callable[[], R]) -> R:
        # a broker that does not answer yet is waited for, until stop() (producers/runtime/kafka_wait.py)
        made = until_kafka_answers(make, f"sink, Kafka at {self.settings.kafka_bootstrap}",
                                   self.settings.kafka_bootstrap.split(","), self.stop_event)
        if made is None:
            raise Stopped("stopped while waiting for Kafka")
        return made

    def _open_kafka(self) -> None:
        from kafka import KafkaProducer

        self._kafka_config = quick_bootstrap(self.settings.kafka_python_config())
        self.consumer = self._until_kafka_answers(self._new_consumer)
        self.producer = self._until_kafka_answers(
            lambda: KafkaProducer(**self._kafka_config, client_id="areal-sink-deadletter", acks="all", retries=5,
                                  linger_ms=5))

    def _watch_fetching(self, now: float) -> None:
        """A new consumer when this one stopped fetching partitions with records to read (sinks/fetch_watch.py)."""
        if self.revoked:  # a rebalance under way: positions stand still until its assignment
            since = now if self.rebalance_since is None else self.rebalance_since
            if self.watch.rebalance_stuck(now, since, _REBALANCE_TIMEOUT_MS / 1000 + self.watch.stall_s):
                log.warning("the consumer has been in a rebalance for %.0f s, past the group's rebalance timeout "
                            "(a join that does not complete); making a new one", now - since)
                self._replace_consumer()
            return
        try:
            # a partition the sink paused is not fetched on purpose (one a rebalance gave back fresh is)
            paused = {(tp.topic, tp.partition) for tp in self.consumer.paused()} & self.paused
            assigned = [tp for tp in self.consumer.assignment() if (tp.topic, tp.partition) not in paused]
            positions = {tp: self.consumer.position(tp, timeout_ms=_OFFSETS_TIMEOUT_MS) for tp in assigned}
            ends = self.consumer.end_offsets(assigned, timeout_ms=_OFFSETS_TIMEOUT_MS) if assigned else {}
        except Exception as exc:  # noqa: BLE001 - a rebalance or the broker away: judge at the next check
            log.debug("could not read the offsets to watch fetching: %s", exc)
            self.watch.reset(now)
            return
        stalled = self.watch.check(now, {tp: p for tp, p in positions.items() if p is not None}, ends)
        if stalled:
            log.warning("the consumer fetched nothing of %s for over %.0f s with records to read (a kafka-python "
                        "fault); making a new one",
                        ", ".join(sorted(f"{tp.topic}[{tp.partition}]" for tp in stalled)), self.watch.stall_s)
            self._replace_consumer()

    def _replace_consumer(self) -> None:
        """Close the consumer and make a new member in its place (static membership: it takes the old one's
        partitions). First what is buffered goes in and is committed through the old one, whose membership
        still works (only its fetching stopped; one try: what it cannot commit, the new member commits
        after its join, or reads again and its plans cut the same); what cannot go yet (a block held for a slow partition) is
        dropped and read again from the commit, its plans cutting it the same. So the new member starts with
        nothing buffered, and nothing is flushed before it has joined."""
        old = self.consumer
        self._replacing = True
        try:
            self.flush()
        finally:
            self._replacing = False
        self.batcher.drop()
        self.paused = set()
        try:
            old.close(autocommit=False)
        except Exception as exc:  # noqa: BLE001 - the new member fences the old one anyway
            log.warning("closing the stalled consumer: %s", exc)
        self.consumer = None
        # nothing is buffered, and the old member's rebalance (its close revokes) is not the new one's
        self.revoked, self.rebalance_since = set(), None
        self.consumer = self._until_kafka_answers(self._new_consumer)
        self.stats["new_consumers"] += 1
        self.watch.reset(time.monotonic())

    # ------------------------------------------------------------ the loop

    def run(self) -> None:
        """Consume until `stop()`; then flush what is buffered (one try) and close."""
        try:
            self._open_store()
            self._open_kafka()
            log.info("sink running: group %s, topics %s*, store %s", self.group, self.topics.prefix, self.target.kind)
            last_report = time.monotonic()
            while not self.stop_event.is_set():
                now = time.monotonic()
                # at most a second: stop() is seen within one poll, whatever max_wait is
                timeout_ms = min(1000, max(10, int(self.batcher.poll_timeout(now) * 1000)))
                polled = self.consumer.poll(timeout_ms=timeout_ms, max_records=self.policy.max_rows)
                self.watch.polled(time.monotonic() - now)
                now = time.monotonic()
                for tp, messages in polled.items():
                    for m in messages:
                        self.batcher.add((tp.topic, tp.partition), m.offset, m, now)
                if self.uncommitted:  # a commit a rebalance put off: the poll may have joined the group again
                    self._retry("committing offsets", self._commit_stored)
                if self.batcher.due(now, quiet=not polled):
                    self.flush()
                if self.watch.due(now):
                    self._watch_fetching(now)
                if now - last_report > 30:
                    log.info("sink stats: %s", self.stats)
                    last_report = now
        except Stopped:
            pass
        finally:
            self._close()

    def stop(self) -> None:
        self.stop_event.set()

    def flush(self) -> None:
        positions = {}
        for tp in self.consumer.assignment():
            if (tp.topic, tp.partition) in self.plans:
                positions[(tp.topic, tp.partition)] = self.consumer.position(tp)
        chunks = self.batcher.take(time.monotonic(), self.plans, positions)
        self._pause_held()
        if not chunks:
            return
        if self.guard is None or not self.guard.suspects:
            self.write_chunks(chunks)
            return
        for c in chunks:  # a message in flight in a crash goes in a chunk of its own; in log order
            for piece, _ in self._split(c):
                self.write_chunks([piece])

    def _pause_held(self) -> None:
        """Pause the partitions the batcher holds read to their planned chunk's end (after a crash, while the
        rest of their block is read again, at most AREAL_SINK_REPLAN_WAIT_MS): what they would fetch meanwhile
        only grows their buffers, and buffers past max_rows make every poll a flush. Resumed once cut."""
        if not self.batcher.held and not self.paused:  # the usual flush: nothing to pause or resume
            return
        assigned = {(tp.topic, tp.partition): tp for tp in self.consumer.assignment()}
        held = {assigned[k] for k in self.batcher.held if k in assigned}
        pause = held - set(self.consumer.paused())
        resume = {assigned[k] for k in self.paused if k in assigned} - held
        if pause:
            self.consumer.pause(*pause)
        if resume:
            self.consumer.resume(*resume)
            self.watch.forget(resume)
        self.paused = {(tp.topic, tp.partition) for tp in held}

    def _split(self, c: Chunk[Any]) -> list[tuple[Chunk[Any], str]]:
        """The chunk in log order: runs of usual messages, and each suspect alone, with their verdicts."""
        assert self.guard is not None
        out: list[tuple[Chunk[Any], str]] = []
        run: list[Any] = []

        def cut(items: list[Any], verdict: str) -> None:
            if items:
                out.append((Chunk(c.topic, c.partition, items[0].offset, items[-1].offset, tuple(items)), verdict))

        for m in c.items:
            verdict = self.guard.verdict(c.topic, c.partition, m.offset)
            if verdict == OK:
                run.append(m)
                continue
            cut(run, OK)
            run = []
            cut([m], verdict)
        cut(run, OK)
        return out

    def _decode_all(self, chunks: list[Chunk[Any]], alerts: list[Any]) -> list[tuple[Chunk[Any], Decoded]]:
        """Each chunk's rows and dead letters. The work a message does in the sink is its decoding
        (after it, the chunk is one block, whose insert fails as the store's, retried, not the
        message's): its positions are recorded while it runs, so a message that crashes the
        sink there twice is dead-lettered and skipped (producers/runtime/poison.py). A crash
        after it keeps the chunk's plan, so the retried insert stays exactly once."""
        if self.guard is None:
            return [(c, self._decode(c, alerts)) for c in chunks]
        self.guard.begin(spans((c.topic, c.partition, o) for c in chunks for o in (c.first, c.last)))
        out = [(c, self._decode(c, alerts)) for c in chunks]
        self.guard.end()
        return out

    def _decode(self, c: Chunk[Any], alerts: list[Any]) -> Decoded:
        """The chunk's rows and dead letters; a poison message's dead letter (and its alert, into `alerts`)."""
        guard = self.guard
        if guard is not None and len(c.items) == 1 and guard.verdict(c.topic, c.partition, c.first) == POISON:
            m = c.items[0]
            n = guard.crashes(c.topic, c.partition, c.first)
            log.error("%s[%d]@%d crashed the sink %d times; dead-lettered and skipped", c.topic, c.partition,
                      c.first, n)
            self.stats["poison"] += 1
            dead, alert = poison_events(m.value, m.key, c.topic, c.partition, c.first, n, service="sink",
                                        node=SINK_NODE, now=time.time(),
                                        ts=None if m.timestamp is None else m.timestamp / 1000.0)
            alerts.append(alert)
            if c.topic == self.topics.deadletter:  # stored as itself, never published again
                return Decoded(rows=[Located(dead, c.topic, c.partition, c.first)])
            return Decoded(dead_letters=[dead])
        if self.crash_marker is not None and c.topic != self.topics.deadletter:  # a poison's letter holds its text
            for m in c.items:
                if m.value is not None and self.crash_marker in m.value:
                    crash_now("sink", (c.topic, c.partition, m.offset))
        return decode(c.items, self.topics)

    def write_chunks(self, chunks: list[Chunk[Any]]) -> None:
        alerts: list[Any] = []
        decoded = self._decode_all(chunks, alerts)
        redone = {(c.topic, c.partition) for c in chunks if self.plans.get((c.topic, c.partition)) == Plan(c.first, c.last)}
        if redone:  # a crash interrupted these batches: the same blocks again, same tokens
            log.info("re-inserting %d planned batches: %s", len(redone), sorted(redone))
            self.stats["replanned"] += len(redone)
        planned_block = (lambda c: self.plans[(c.topic, c.partition)].group)  # the block a chunk's plan names
        for block in blocks_by_topic([(c, d) for c, d in decoded if (c.topic, c.partition) in redone], planned_block):
            self._store_again(block)
        for block in blocks_by_topic([(c, d) for c, d in decoded if (c.topic, c.partition) not in redone]):
            token = block_token([c for c, _ in block])
            self._record_plans({(c.topic, c.partition): Plan(c.first, c.last, token) for c, _ in block})
            self._store_block(block, token)
        dead = [ev for _, d in decoded for ev in d.dead_letters]
        if dead:
            self._retry("publishing dead letters", lambda: self._publish(dead))
            self.stats["dead_letters"] += len(dead)
        if alerts:
            self._retry("publishing alerts", lambda: self._publish(alerts, self.topics.alerts))
        self._commit(chunks)
        if self.guard is not None and self.guard.suspects:  # those wholly processed are forgotten
            self.guard.end([(c.topic, c.partition, c.first, c.last) for c in chunks])
        log.debug("committed %d chunks: %s", len(chunks), ", ".join(f"{c.topic}[{c.partition}]@{c.next_offset}" for c in chunks))

    def _record_plans(self, plans: dict[TopicPartition, Plan]) -> None:
        """Chunks' plans, each naming the block its chunk goes in, recorded before the block goes in."""
        self._retry("recording batch plans", lambda: record_plans(self.client, self.schema.database, self.group, plans))
        self.plans.update(plans)

    def _store_again(self, block: list[tuple[Chunk[Any], Decoded]]) -> None:
        """A block a crash interrupted (its chunks' plans name its token). Whole (every chunk of it cut again,
        as `Batcher.take` waits for), it goes in again with its token: the store drops what it holds, and the
        tables its materialized views fill get what they lack; then the rows the store lacks in spite of its
        token are stored (`_store`, `retried`). A part of it (a partition of it read by another sink now, or
        not read again within `replan_wait_s`): no insert can give its token again, so each chunk goes in
        alone, of its rows those the store lacks."""
        first = block[0][0]
        token = self.plans[(first.topic, first.partition)].group
        if block_token([c for c, _ in block]) == token:
            failed = self._store_block(block, token, retried=True)
            unstorable = {(loc.partition, loc.offset) for loc, _ in failed}
            kept = [r for _, d in block for r in d.rows if (r.partition, r.offset) not in unstorable]
            self._store(_label(block), kept, token, retried=True)
            return
        log.warning("%s: %d chunks of a block retried after a crash without the rest of it (%s); each is stored "
                    "alone, its rows the store lacks", first.topic, len(block), token)
        # Their plans now name a block no cut gives: a later retry of them (another crash before the commit,
        # the rest of the block back in this sink) must not take the block for whole and insert it again.
        if not token.startswith(_SPLIT):  # once: a second crash here finds them so already
            self._record_plans({(c.topic, c.partition): Plan(c.first, c.last, _SPLIT + token) for c, _ in block})
        for c, d in block:
            self._store_redone(c, d)

    def _store_block(self, block: list[tuple[Chunk[Any], Decoded]], token: str,
                     retried: bool = False) -> list[tuple[Located, DataError]]:
        """One topic's chunks of a flush (one per partition), inserted as one block with their joint `token`:
        a store's cost is mostly per INSERT (its materialized views are planned for each), not per row.
        Returns the rows no insert could store (each dead-lettered here); `retried`: the block again after
        a crash (the letters of a dead-letter topic's rows, stored, are then checked as its rows are)."""
        stored, failed = self._store(_label(block), [r for _, d in block for r in d.rows], token)
        self.stats["rows"] += stored
        self.stats["chunks"] += len(block)
        for c, d in block:
            mine = [(loc, exc) for loc, exc in failed if loc.partition == c.partition]
            if mine:
                d.dead_letters.extend(self._unstored(c, mine, dedup_token(c.topic, c.partition, c.first, c.last),
                                                     retried))
        return failed

    def _store_redone(self, c: Chunk[Any], d: Decoded) -> None:
        """A chunk of a recorded plan, cut again after a crash: stored alone, of its rows those the store lacks."""
        token = dedup_token(c.topic, c.partition, c.first, c.last)
        # its block went in (or not) under a token no insert gives again: its views may lack what its table holds
        stored, failed = self._store(f"{c.topic}[{c.partition}]", d.rows, token, retried=True, views_may_lack=True)
        self.stats["rows"] += stored
        self.stats["chunks"] += 1
        if failed:
            d.dead_letters.extend(self._unstored(c, failed, token, retried=True))

    def _store(self, label: str, rows: list[Located], token: str, retried: bool = False,
               views_may_lack: bool = False) -> tuple[int, list[tuple[Located, DataError]]]:
        """Insert `rows` as one block with `token`, bisected on a data error (`isolate`): (rows stored, rows that
        failed alone). `retried`: the rows of a chunk cut again after a crash, which may have been stored before
        in a block with other partitions' chunks (whose token a new cut cannot give again), in part (ClickHouse
        records a block's token before its part is visible), or not at all. So the store is asked which of them
        it holds, and only the others are inserted (`insert_missing`), under a token of this retry's, the same
        across its own retries and bisections. `views_may_lack`: a chunk of a block stored in part, whose rows
        the aggregates may lack though their table holds them (`insert_missing`)."""
        if not retried:
            return isolate(rows, token, lambda part, t: self._insert(label, part, t))
        restored = 0

        def insert_missing_of(part: Sequence[Located], t: str) -> int:
            nonlocal restored
            restored += self._retry(f"storing the retried batch {label}",
                                    lambda: insert_missing(self.client, self.schema.database, part, t,
                                                           views_may_lack),
                                    data_errors=True)
            return len(part)

        stored, failed = isolate(rows, f"{token}:redone:{uuid.uuid4().hex}", insert_missing_of)
        if restored:
            log.info("%s: %d events of a batch retried after a crash were not stored yet; stored them", label, restored)
            self.stats["restored"] += restored
        return stored, failed

    def _insert(self, label: str, rows: Sequence[Located], token: str) -> int:
        return self._retry(f"inserting {label}",
                           lambda: insert_rows(self.client, self.schema.database, rows, token), data_errors=True)

    def _unstored(self, c: Chunk[Any], failed: list[tuple[Located, DataError]], token: str,
                  retried: bool = False) -> list[Any]:
        """Dead letters for the rows no insert could store. A row read from the dead-letter
        topic is not published again (that would loop): its own dead letter is stored instead,
        and when even that fails, it is logged and passed over."""
        by_offset = {m.offset: m for m in c.items}
        letters = []
        for loc, exc in failed:
            reason = f"{loc.event.table}: could not be stored ({exc})"
            log.warning("%s[%d]@%d %s; dead-lettered", c.topic, c.partition, loc.offset, reason)
            letters.append(dead_letter(by_offset[loc.offset], reason))
        self.stats["unstorable"] += len(letters)
        if c.topic != self.topics.deadletter:
            return letters
        rows = [Located(e, c.topic, c.partition, loc.offset) for e, (loc, _) in zip(letters, failed)]
        _, lost = self._store(f"{c.topic}[{c.partition}]", rows, f"{token}:letters", retried)
        for loc, exc in lost:
            log.error("%s[%d]@%d cannot be stored even as a dead letter (%s); passed over",
                      c.topic, c.partition, loc.offset, exc)
        return []

    def _publish(self, events: list[Any], topic: str | None = None) -> None:
        topic = topic or self.topics.deadletter
        futures = [self.producer.send(topic, key=e.run_id.encode(), value=e.to_json()) for e in events]
        self.producer.flush(timeout=30)
        for f in futures:
            f.get(timeout=0)  # raises the send error, if any

    def _commit(self, chunks: list[Chunk[Any]]) -> None:
        from kafka.structs import OffsetAndMetadata, TopicPartition

        self.uncommitted.update({TopicPartition(c.topic, c.partition): OffsetAndMetadata(c.next_offset, "", -1)
                                 for c in chunks})
        if self._replacing:  # one try through a consumer being replaced: the new member commits what is left
            try:
                self._commit_stored()
            except Exception as exc:  # noqa: BLE001
                log.warning("committing through the replaced consumer failed: %s", exc)
        else:
            self._retry("committing offsets", self._commit_stored)
        self.stats["commits"] += 1

    def _commit_stored(self) -> None:
        """Commit the offsets of what is stored and not yet committed (`uncommitted`)."""
        from kafka.errors import CommitFailedError, IllegalStateError, RebalanceInProgressError

        try:
            self.consumer.commit(dict(self.uncommitted))
        except RebalanceInProgressError:
            # Only a poll joins the group again: retrying here would wait forever. The
            # offsets stay in `uncommitted`, committed after the next poll.
            log.info("offset commit put off until the group's rebalance is done")
            return
        except (CommitFailedError, IllegalStateError) as exc:
            # the group moved on: the new owner re-reads from the last commit and
            # our plans make its batches identical, so the inserts deduplicate. The
            # buffers stay: the rebalance drops those of partitions that went elsewhere.
            log.warning("offset commit refused (%s); partitions will be re-read", exc)
        self.uncommitted = {}

    def _close(self) -> None:
        if self.consumer is not None and self.client is not None and self.batcher.total:
            self.stop_event.set()  # one try each: what is not committed is read again next time
            try:
                self.flush()
            except Exception as exc:  # noqa: BLE001 - includes Stopped
                log.info("stopping with uncommitted messages (read again on restart): %r", exc)
        for closer in (
            lambda: self.consumer and self.consumer.close(autocommit=False),
            lambda: self.producer and self.producer.close(timeout=5),
            lambda: self.endpoint and self.endpoint.close(),
            lambda: self.client and self.client.close(),
        ):
            try:
                closer()
            except Exception as exc:  # noqa: BLE001
                log.debug("close: %s", exc)
        log.info("sink stopped: %s", self.stats)


def _label(block: list[tuple[Chunk[Any], Decoded]]) -> str:
    """A block's chunks as the log names them: `<topic>[<partition>], ...`."""
    return ", ".join(f"{c.topic}[{c.partition}]" for c, _ in block)
