"""Rebuild every table from the Kafka log (earliest offsets).

Replay drops the per-topic tables, recreates them, and reads every partition of
every topic from its beginning up to the end offsets seen at the start, with
no consumer group (nothing is committed; the live sink's offsets are left
alone). Its inserts carry tokens with a fresh prefix, so ClickHouse does not
mistake them for the blocks of the dropped tables. Messages that fail
validation are skipped: the live sink already published their dead letters,
which replay reads back from the dead-letter topic like every other event.

While the stack runs, the sink holds an embedded store: replay then writes
through the sink's ClickHouse HTTP endpoint as its `writer` user, with the
same clickhouse-connect calls as against a ClickHouse server (it reads Kafka
in the calling process). The sink's own inserts that land during the replay
are deduplicated by `FINAL` and the views.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from areal_metrics.producers.contract.settings import Settings
from areal_metrics.sinks.batching import Batcher, BatchPolicy, dedup_token
from areal_metrics.sinks.decode import decode
from areal_metrics.sinks.migrations import apply_schema, drop_tables, recreate_tables
from areal_metrics.sinks.schema import TABLES, SchemaOptions
from areal_metrics.sinks.writer import insert_rows
from areal_metrics.producers.contract.errors import ServiceUnavailable, UserError

log = logging.getLogger("areal.sink.replay")
STALL_S = 60.0  # give up when the log stops yielding messages before the end offsets


class ReplayRefused(UserError):
    """Replaying would lose data, or there is nothing to replay from; the tables are untouched."""


def cluster_refusal(schema: SchemaOptions) -> str | None:
    """Why replay cannot be safe with these schema options; None when it can (pure)."""
    if schema.replicated and not schema.cluster:
        return ("replicated tables without AREAL_CLICKHOUSE_CLUSTER: replay could drop this server's replica only, "
                "and the other replicas would bring the old rows back; name the cluster (tables untouched)")
    if schema.cluster and not schema.replicated:
        return (f"cluster {schema.cluster} with non-replicated tables: replay writes through one server, so the "
                "rebuilt rows would live on that node alone and the other nodes' tables would be left empty; "
                "use AREAL_CLICKHOUSE_REPLICATED=1 (tables untouched)")
    return None


def check_cluster(client: Any, schema: SchemaOptions) -> None:
    """ReplayRefused unless the cluster is known to the server and has one shard (the tables are not sharded)."""
    if not schema.cluster:
        return
    shards = int(client.command(
        f"SELECT uniqExact(shard_num) FROM system.clusters WHERE cluster = '{schema.cluster}'") or 0)
    if shards == 0:
        raise ReplayRefused(f"no cluster named {schema.cluster} in this server's system.clusters (tables untouched)")
    if shards > 1:
        raise ReplayRefused(
            f"cluster {schema.cluster} has {shards} shards, and the tables are not sharded (no Distributed tables): "
            "replay would put every row on one shard (tables untouched)")


def rebuild_tables(client: Any, schema: SchemaOptions) -> None:
    """Drop the per-topic tables and make them again, empty (ON CLUSTER ... SYNC on a cluster)."""
    apply_schema(client, schema)
    drop_tables(client, schema)
    recreate_tables(client, schema)


def replay_into(client: Any, settings: Settings, schema: SchemaOptions | None = None,
                policy: BatchPolicy = BatchPolicy(max_rows=20_000, max_wait_s=0), *, force: bool = False) -> dict[str, int]:
    """Rebuild the tables through `client`; returns {table: rows (FINAL)}.

    Refuses (ReplayRefused, before touching anything) when the schema options
    cannot be replayed safely on their cluster (`cluster_refusal`, `check_cluster`),
    when no topic of the prefix exists, or when retention already deleted the start
    of a partition (the rebuilt tables would lack those events) unless `force`.
    """
    from kafka import KafkaConsumer
    from kafka.structs import TopicPartition

    schema = schema or SchemaOptions()
    refusal = cluster_refusal(schema)
    if refusal:
        raise ReplayRefused(refusal)
    topics = settings.topics
    consumer = KafkaConsumer(**settings.kafka_python_config(), group_id=None, enable_auto_commit=False,
                             client_id="areal-replay", isolation_level="read_committed")
    try:
        tps = []
        for topic in topics.all():
            parts = consumer.partitions_for_topic(topic) or set()
            tps.extend(TopicPartition(topic, p) for p in sorted(parts))
        if not tps:
            raise ReplayRefused(f"no topics named {topics.prefix}* on the broker: nothing to replay from (tables untouched)")
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        start = consumer.beginning_offsets(tps)
        expired = [f"{tp.topic}[{tp.partition}] from {start[tp]}" for tp in tps if start[tp] > 0]
        if expired and not force:
            raise ReplayRefused(
                f"the log no longer starts at offset 0 ({', '.join(expired[:3])}{', ...' if len(expired) > 3 else ''}): "
                "retention deleted events the tables hold; rebuild anyway with --force (tables untouched)")

        check_cluster(client, schema)
        rebuild_tables(client, schema)

        prefix = f"replay-{uuid.uuid4().hex[:12]}:"
        batcher: Batcher[Any] = Batcher(policy)
        last_progress = time.monotonic()

        def write_all() -> None:
            for chunk in batcher.take(time.monotonic()):
                rows = decode(chunk.items, topics).rows  # invalid input: already dead-lettered live
                insert_rows(client, schema.database, rows, dedup_token(chunk.topic, chunk.partition, chunk.first, chunk.last, prefix))

        while any(consumer.position(tp) < end[tp] for tp in tps):
            polled = consumer.poll(timeout_ms=500, max_records=policy.max_rows)
            now = time.monotonic()
            for tp, messages in polled.items():
                for m in messages:
                    if m.offset < end[tp]:
                        batcher.add((tp.topic, tp.partition), m.offset, m, now)
                        last_progress = now
            if batcher.total:
                write_all()
            if now - last_progress > STALL_S:
                raise ServiceUnavailable(f"replay stalled: no message for {STALL_S:.0f}s before the end offsets")
        write_all()
    finally:
        consumer.close(autocommit=False)
    return {t.name: int(client.command(f"SELECT count() FROM {schema.database}.{t.name} FINAL")) for t in TABLES}


def run_replay(settings: Settings, *, force: bool = False) -> dict[str, int]:
    """Replay against the configured store: through the running sink's endpoint when it holds the embedded store."""
    from areal_metrics.sinks.query import Target, open_client, owner_client, read_owner

    target = Target.parse(settings.clickhouse_url)
    schema = SchemaOptions.from_settings(settings, target.database, embedded=target.kind == "chdb")
    owner = read_owner(target.path) if target.path is not None else None
    if owner is not None:
        client = owner_client(owner, write=True)
    else:
        client = open_client(target, readonly=False, use_database=False)
    try:
        return replay_into(client, settings, schema, force=force)
    finally:
        client.close()


def fingerprints(store: Any, database: str = "areal") -> dict[str, tuple[int, int]]:
    """{table: (rows, checksum)} read with FINAL; `store` is a clickhouse-connect client or a `areal_metrics.sinks.query` store.

    The checksum (hashes of whole rows as tuples: NULLs included) covers every column but `_ingested_at` (the server's clock), so
    two builds from the same log give the same figures.
    """
    out: dict[str, tuple[int, int]] = {}
    for t in TABLES:
        cols = ", ".join(f"`{c}`" for c in t.insert_columns)
        value = store.command(f"SELECT count(), sum(cityHash64(tuple({cols}))) FROM {database}.{t.name} FINAL")
        n, checksum = value if isinstance(value, (list, tuple)) else str(value).split("\t")
        out[t.name] = (int(n), int(checksum))
    return out
