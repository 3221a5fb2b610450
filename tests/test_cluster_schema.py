"""ClickHouse for clusters: settings, DDL with ON CLUSTER and replicated engines, a safe `replay`.

No ClickHouse cluster runs here: the cluster path is tested as the DDL text it sends
(a client that records every statement), the single-node path on the embedded engine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from areal_metrics.producers.contract.errors import ConfigError
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.sinks.migrations import apply_schema, schema_statements
from areal_metrics.sinks.query import Target, open_client
from areal_metrics.sinks.replay import (
    ReplayRefused,
    check_cluster,
    cluster_refusal,
    rebuild_tables,
    replay_into,
)
from areal_metrics.sinks.schema import BATCH_PLANS, MIGRATIONS_TABLE, TABLES, SchemaOptions
from areal_metrics.sinks.rank_aggregates import (
    RANK_AGGREGATES,
    RANK_AGGREGATES_COARSE,
    RANK_AGGREGATES_COARSE_MV,
    RANK_AGGREGATES_MV,
)
from areal_metrics.sinks.step_means import AGGREGATES, AGGREGATES_MV

CLUSTER = SchemaOptions(cluster="prod", replicated=True)


class RecordingClient:
    """Records every statement; answers SELECTs with `answer` (a shard count, a version)."""

    def __init__(self, answer: int = 0) -> None:
        self.statements: list[str] = []
        self.answer = answer

    def command(self, cmd: str, *args: Any, **kwargs: Any) -> Any:
        self.statements.append(cmd)
        return self.answer if cmd.lstrip().upper().startswith("SELECT") else None


def ddl(statements: list[str]) -> list[str]:
    return [s for s in statements if s.split(None, 1)[0].upper() in ("CREATE", "DROP", "ALTER")]


def test_settings_name_the_cluster_and_replication(monkeypatch) -> None:
    for name in ("AREAL_CLICKHOUSE_CLUSTER", "AREAL_CLICKHOUSE_REPLICATED"):
        monkeypatch.delenv(name, raising=False)
    assert (Settings.from_env().clickhouse_cluster, Settings.from_env().clickhouse_replicated) == (None, False)
    monkeypatch.setenv("AREAL_CLICKHOUSE_CLUSTER", "prod")
    assert Settings.from_env().clickhouse_replicated is True  # replicated by default on a cluster
    monkeypatch.setenv("AREAL_CLICKHOUSE_REPLICATED", "no")
    assert Settings.from_env().clickhouse_replicated is False
    monkeypatch.setenv("AREAL_CLICKHOUSE_REPLICATED", "maybe")
    with pytest.raises(ConfigError, match="AREAL_CLICKHOUSE_REPLICATED='maybe'"):
        Settings.from_env()


def test_schema_options_from_settings() -> None:
    assert SchemaOptions.from_settings(Settings()) == SchemaOptions()
    assert SchemaOptions.from_settings(Settings(clickhouse_cluster="prod", clickhouse_replicated=True), "m") == \
        SchemaOptions(database="m", cluster="prod", replicated=True)
    with pytest.raises(ConfigError, match="embedded engine"):
        SchemaOptions.from_settings(Settings(clickhouse_cluster="prod"), embedded=True)
    with pytest.raises(ConfigError, match="embedded engine"):
        SchemaOptions.from_settings(Settings(clickhouse_replicated=True), embedded=True)
    with pytest.raises(ConfigError, match="AREAL_CLICKHOUSE_CLUSTER: cluster name 'a;b'"):
        SchemaOptions.from_settings(Settings(clickhouse_cluster="a;b"))


def test_every_ddl_statement_runs_on_the_cluster_with_replicated_engines() -> None:
    client = RecordingClient()
    apply_schema(client, CLUSTER)
    statements = ddl(client.statements)
    documented = iter(ddl(schema_statements(CLUSTER)))
    # in the documented order; a new store skips the copies of a key change (Rekey makes the table in place)
    assert all(any(s == d for d in documented) for s in statements)
    assert all(" ON CLUSTER prod" in s for s in statements)
    tables = [s for s in statements if s.startswith("CREATE TABLE")]
    assert {s.split()[5] for s in tables} == {f"areal.{n}" for n in [t.name for t in TABLES]
                                              + [MIGRATIONS_TABLE, BATCH_PLANS, AGGREGATES, RANK_AGGREGATES,
                                                 RANK_AGGREGATES_COARSE]}
    aggregating = {f"areal.{AGGREGATES}", f"areal.{RANK_AGGREGATES}", f"areal.{RANK_AGGREGATES_COARSE}"}
    assert all(f"ENGINE = Replicated{'Aggregating' if s.split()[5] in aggregating else 'Replacing'}MergeTree("
               "'/clickhouse/tables/{shard}/areal/" in s for s in tables)
    assert not any("non_replicated_deduplication_window" in s for s in statements)


def test_replay_on_a_cluster_drops_on_cluster_sync_then_recreates_replicated() -> None:
    client = RecordingClient(answer=1)  # one shard
    check_cluster(client, CLUSTER)
    assert client.statements == ["SELECT uniqExact(shard_num) FROM system.clusters WHERE cluster = 'prod'"]
    client.statements.clear()
    rebuild_tables(client, CLUSTER)
    statements = ddl(client.statements)
    drops = [s for s in statements if s.startswith("DROP")]
    assert drops == [f"DROP VIEW IF EXISTS areal.{AGGREGATES_MV} ON CLUSTER prod SYNC",
                     f"DROP TABLE IF EXISTS areal.{AGGREGATES} ON CLUSTER prod SYNC",
                     f"DROP VIEW IF EXISTS areal.{RANK_AGGREGATES_COARSE_MV} ON CLUSTER prod SYNC",
                     f"DROP TABLE IF EXISTS areal.{RANK_AGGREGATES_COARSE} ON CLUSTER prod SYNC",
                     f"DROP VIEW IF EXISTS areal.{RANK_AGGREGATES_MV} ON CLUSTER prod SYNC",
                     f"DROP TABLE IF EXISTS areal.{RANK_AGGREGATES} ON CLUSTER prod SYNC",
                     *(f"DROP TABLE IF EXISTS areal.{t.name} ON CLUSTER prod SYNC" for t in TABLES)]
    after_drops = statements[statements.index(drops[-1]) + 1:]
    recreated = [s for s in after_drops if s.startswith("CREATE TABLE")
                 and s.split()[5] not in {f"areal.{AGGREGATES}", f"areal.{RANK_AGGREGATES}",
                                          f"areal.{RANK_AGGREGATES_COARSE}"}]
    assert [s.split()[5] for s in recreated] == [f"areal.{t.name}" for t in TABLES]
    # the per-step aggregates and their materialized view again, after the steps they are made from
    mvs = [s for s in after_drops if s.startswith("CREATE MATERIALIZED VIEW")]
    assert f"areal.{AGGREGATES_MV} ON CLUSTER prod TO areal.{AGGREGATES}" in mvs[0]
    assert f"areal.{RANK_AGGREGATES_MV} ON CLUSTER prod TO areal.{RANK_AGGREGATES}" in mvs[1]
    # the coarse level's after the fine table it reads
    assert f"areal.{RANK_AGGREGATES_COARSE_MV} ON CLUSTER prod TO areal.{RANK_AGGREGATES_COARSE}" in mvs[2]
    assert all(after_drops.index(mv) > after_drops.index(recreated[-1]) for mv in mvs)
    assert all("ON CLUSTER prod" in s and "ENGINE = ReplicatedReplacingMergeTree(" in s for s in recreated)
    views = [s for s in after_drops if s.startswith("CREATE OR REPLACE VIEW")]
    # a view per table, v_step_means, v_step_means_of, v_rank_buckets, v_rank_buckets_of, v_rank_buckets_coarse_of
    assert len(views) == len(TABLES) + 5 and all("ON CLUSTER prod" in s for s in views)
    assert after_drops.index(views[0]) > after_drops.index(recreated[-1])  # views over the new tables


@pytest.mark.parametrize("options, reason", [
    (SchemaOptions(cluster="prod", replicated=False), "non-replicated tables"),
    (SchemaOptions(replicated=True), "without AREAL_CLICKHOUSE_CLUSTER"),
])
def test_replay_refuses_in_one_line_where_it_cannot_be_safe_and_touches_nothing(options, reason) -> None:
    message = cluster_refusal(options)
    assert message is not None and reason in message and "\n" not in message
    client = RecordingClient()
    with pytest.raises(ReplayRefused, match=reason):  # before Kafka is even asked: no broker here
        replay_into(client, Settings(kafka_bootstrap="127.0.0.1:1"), options)
    assert client.statements == []


def test_safe_options_are_not_refused() -> None:
    assert cluster_refusal(SchemaOptions()) is None and cluster_refusal(CLUSTER) is None


@pytest.mark.parametrize("shards, reason", [(0, "no cluster named prod"), (2, "has 2 shards")])
def test_an_unknown_or_sharded_cluster_is_refused(shards, reason) -> None:
    with pytest.raises(ReplayRefused, match=reason):
        check_cluster(RecordingClient(answer=shards), CLUSTER)


@pytest.mark.broker
def test_a_sharded_cluster_is_refused_before_any_table_is_dropped(kafka_bootstrap, topics) -> None:
    from areal_metrics.producers.contract.events import StepEvent
    from areal_metrics.producers.delivery.publisher import Publisher

    publisher = Publisher(kafka_bootstrap, topics)
    publisher.publish(StepEvent(run_id="r1", step=1, epoch=0))
    assert publisher.flush(30)
    publisher.close()
    client = RecordingClient(answer=2)
    with pytest.raises(ReplayRefused, match="2 shards"):
        replay_into(client, Settings(kafka_bootstrap=kafka_bootstrap, topic_prefix=topics.prefix), CLUSTER)
    assert ddl(client.statements) == []


def test_the_single_node_path_on_the_embedded_engine(tmp_path: Path) -> None:
    options = SchemaOptions.from_settings(Settings(), embedded=True)
    client = open_client(Target.parse(f"chdb://{tmp_path / 'ch'}"), readonly=False, use_database=False)
    try:
        apply_schema(client, options)
        client.command("INSERT INTO areal.deadletter (event_id, run_id, node, rank, ts, schema, reason, source_topic, "
                       "raw, _topic, _partition, _offset) VALUES ('e1', 'r1', 'n', 0, now64(3), 1, 'x', 't', '', "
                       "'t', 0, 0)")
        check_cluster(client, options)  # no cluster: nothing asked
        rebuild_tables(client, options)
        engines = {name: engine for name, engine in client.query(
            "SELECT name, engine FROM system.tables WHERE database = 'areal'").result_rows}
        assert int(client.command("SELECT count() FROM areal.deadletter")) == 0  # rebuilt empty
    finally:
        client.close()
    assert {engines[t.name] for t in TABLES} == {"ReplacingMergeTree"}
    assert {engines[t.view] for t in TABLES} == {"View"}


def one_line_exit(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result


def test_a_cluster_on_the_embedded_engine_stops_the_sink_and_replay_with_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "AREAL_HOME": str(tmp_path), "AREAL_CLICKHOUSE_URL": f"chdb://{tmp_path / 'ch'}",
           "AREAL_CLICKHOUSE_CLUSTER": "prod", "AREAL_KAFKA_BOOTSTRAP": "127.0.0.1:1"}
    sink = one_line_exit(["-m", "areal_metrics.sinks"], env)
    assert sink.returncode == 2 and "embedded engine" in sink.stderr
    replay = one_line_exit(["-m", "areal_metrics", "replay"], env)
    assert replay.returncode == 2 and "embedded engine" in replay.stderr
    assert not (tmp_path / "ch").exists()  # refused before the store was opened
