"""AREAL_CLICKHOUSE_MERGE_SELECTOR_BASE: the merge width of the tables that take a row per step and rank
(sinks/migrations.py apply_merge_width), set, kept and reset at each start like the steps' TTL, on the
embedded engine; left alone on a server whose MergeTree has no such setting."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from areal_metrics.producers.contract.errors import ConfigError
from areal_metrics.sinks import migrations
from areal_metrics.producers.contract.events import StepEvent
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.sinks.migrations import (
    WIDE_MERGE_TABLES,
    apply_schema,
    drop_tables,
    recreate_tables,
    schema_statements,
)
from areal_metrics.sinks.query import Target, open_client
from areal_metrics.sinks.rows import Located
from areal_metrics.sinks.schema import SchemaOptions
from areal_metrics.sinks.writer import insert_rows
from tests.support import logger_warnings


class Recording:
    """The real client, with every statement recorded; `lacks_width`: answers as a server whose
    MergeTree has no merge_selector_base."""

    def __init__(self, client: Any, lacks_width: bool = False) -> None:
        self.client, self.lacks_width, self.statements = client, lacks_width, []

    def command(self, cmd: str, *args: Any, **kwargs: Any) -> Any:
        self.statements.append(cmd)
        if self.lacks_width and "system.merge_tree_settings" in cmd:
            return 0
        return self.client.command(cmd, *args, **kwargs)

    def alters(self) -> list[str]:
        return [s for s in self.statements if s.startswith("ALTER") and "merge_selector_base" in s]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    c = open_client(Target.parse(f"chdb://{tmp_path_factory.mktemp('width') / 'clickhouse'}"), readonly=False,
                    use_database=False)
    yield c
    c.close()


def widths(client: Any, db: str) -> dict[str, str]:
    rows = client.query("SELECT name, extract(create_table_query, 'merge_selector_base = ([0-9.]+)') FROM system.tables "
                        f"WHERE database = '{db}' AND engine LIKE '%MergeTree'").result_rows
    return {name: width for name, width in rows if width}


def test_the_setting_is_off_by_default_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AREAL_CLICKHOUSE_MERGE_SELECTOR_BASE", raising=False)
    assert Settings.from_env().clickhouse_merge_selector_base is None
    assert SchemaOptions.from_settings(Settings.from_env()).merge_selector_base is None
    monkeypatch.setenv("AREAL_CLICKHOUSE_MERGE_SELECTOR_BASE", "20")
    assert SchemaOptions.from_settings(Settings.from_env(), "x") == SchemaOptions("x", merge_selector_base=20)
    for raw in ("1", "0", "1001", "wide", "2.5"):
        monkeypatch.setenv("AREAL_CLICKHOUSE_MERGE_SELECTOR_BASE", raw)
        with pytest.raises(ConfigError, match="AREAL_CLICKHOUSE_MERGE_SELECTOR_BASE"):
            Settings.from_env()
    for bad in (1, 1001, 2.5, True):
        with pytest.raises(ValueError, match="merge_selector_base"):
            SchemaOptions(merge_selector_base=bad)  # type: ignore[arg-type]


def test_a_width_is_set_on_the_wide_tables_kept_and_reset(client: Any) -> None:
    db = "width"
    apply_schema(client, SchemaOptions(database=db))
    assert widths(client, db) == {}  # unset: the server's own, on every table
    rec = Recording(client)
    apply_schema(rec, SchemaOptions(database=db, merge_selector_base=20))
    assert widths(client, db) == {table: "20" for table in WIDE_MERGE_TABLES}
    assert rec.alters() == [f"ALTER TABLE {db}.{t} MODIFY SETTING merge_selector_base = 20" for t in WIDE_MERGE_TABLES]
    rec = Recording(client)
    apply_schema(rec, SchemaOptions(database=db, merge_selector_base=20))  # again: nothing to change
    assert rec.alters() == []
    # the tables still take rows and their aggregates: a step of two ranks, its mean in v_step_means
    rows = [Located(StepEvent(run_id="r", step=1, rank=rank, world_size=2, epoch=0, reward=reward), "areal.steps", 0, i)
            for i, (rank, reward) in enumerate(((0, 0.2), (1, 0.6)))]
    insert_rows(client, db, rows, "width-1")
    assert client.query(f"SELECT step, reward FROM {db}.v_step_means").result_rows == [(1, pytest.approx(0.4))]
    apply_schema(client, SchemaOptions(database=db, merge_selector_base=8))
    assert widths(client, db) == {table: "8" for table in WIDE_MERGE_TABLES}
    rec = Recording(client)
    apply_schema(rec, SchemaOptions(database=db))  # the setting removed: the server's own again
    assert widths(client, db) == {}
    assert rec.alters() == [f"ALTER TABLE {db}.{t} RESET SETTING merge_selector_base" for t in WIDE_MERGE_TABLES]


def test_a_server_without_the_setting_is_left_alone_with_a_warning(client: Any) -> None:
    db = "width_old"
    rec = Recording(client, lacks_width=True)
    with logger_warnings(migrations.log) as asked:
        apply_schema(rec, SchemaOptions(database=db, merge_selector_base=20))
    assert rec.alters() == [] and widths(client, db) == {}
    assert any("AREAL_CLICKHOUSE_MERGE_SELECTOR_BASE=20 not applied" in r.getMessage() for r in asked)
    with logger_warnings(migrations.log) as not_asked:
        apply_schema(Recording(client, lacks_width=True), SchemaOptions(database=db))  # not asked: no warning
    assert not any("merge_selector_base" in r.getMessage() for r in not_asked)


def test_tables_a_replay_makes_again_get_the_width(client: Any) -> None:
    db = "width_replay"
    o = SchemaOptions(database=db, merge_selector_base=20)
    apply_schema(client, o)
    drop_tables(client, o)  # what `replay` does before it reads the log again
    recreate_tables(client, o)
    assert widths(client, db) == {table: "20" for table in WIDE_MERGE_TABLES}


class ClusterServer:
    """Answers as a cluster node whose MergeTree has the setting and whose tables have it already:
    the ALTERs run anyway (ON CLUSTER), for the replicas this node cannot see."""

    def __init__(self) -> None:
        self.statements: list[str] = []

    def command(self, cmd: str, *args: Any, **kwargs: Any) -> Any:
        self.statements.append(cmd)
        if "system.merge_tree_settings" in cmd:
            return 1
        return "20" if "create_table_query" in cmd and "merge_selector_base" in cmd else 0


def test_on_a_cluster_the_width_is_set_on_every_start_and_the_statements_are_listed() -> None:
    clustered = SchemaOptions(cluster="prod", replicated=True, merge_selector_base=20)
    server = ClusterServer()
    apply_schema(server, clustered)
    wanted = [f"ALTER TABLE areal.{t} ON CLUSTER prod MODIFY SETTING merge_selector_base = 20" for t in WIDE_MERGE_TABLES]
    assert [s for s in server.statements if "MODIFY SETTING" in s] == wanted
    listed = schema_statements(clustered)
    assert all(statement in listed for statement in wanted)
    unset = schema_statements(SchemaOptions(cluster="prod", replicated=True))
    assert "ALTER TABLE areal.steps ON CLUSTER prod RESET SETTING merge_selector_base" in unset
