"""The embedded store (chdb through clickhouse-connect): schema, token deduplication, FINAL views,
read-only sessions, the holder's ClickHouse HTTP endpoint as `connect()` and the `sql` verb use it.
No broker needed (tests/test_clickhouse_http.py covers the endpoint itself)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from areal_metrics.producers.contract.errors import ConfigError
from areal_metrics.producers.contract.events import EvalEvent, StepEvent
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.sinks.http.server import ClickHouseHTTPServer
from areal_metrics.sinks.migrations import applied_version, apply_schema, migrations
from areal_metrics.sinks.query import (
    OWNER_FILE,
    DirectStore,
    QueryError,
    Target,
    connect,
    open_client,
    read_owner,
)
from areal_metrics.sinks.batching import Plan
from areal_metrics.sinks.rows import Located
from areal_metrics.sinks.schema import SCHEMA_VERSION, TABLES, SchemaOptions
from areal_metrics.sinks.writer import insert_missing, insert_rows, load_plans, record_plans


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"chdb://{tmp_path / 'clickhouse'}"


@pytest.fixture
def client(url: str) -> Iterator[object]:
    c = open_client(Target.parse(url), readonly=False, use_database=False)
    apply_schema(c)
    yield c
    c.close()  # chdb: one data directory per process at a time


def steps(n: int, run: str = "r1") -> list[StepEvent]:
    return [StepEvent(run_id=run, step=i, epoch=0, reward=i / 10, ts=1_700_000_000 + i) for i in range(n)]


def located(events: list, topic: str = "areal.steps", partition: int = 0, first: int = 0) -> list[Located]:
    return [Located(e, topic, partition, first + i) for i, e in enumerate(events)]


def test_schema_is_idempotent_and_versioned(client) -> None:
    assert apply_schema(client) == SCHEMA_VERSION
    assert apply_schema(client) == SCHEMA_VERSION
    assert applied_version(client) == SCHEMA_VERSION
    assert client.command("SELECT count() FROM areal.schema_migrations FINAL") == len(migrations(SchemaOptions()))
    types = dict(client.query("SELECT name, type FROM system.columns WHERE database='areal' AND table='steps'").result_rows)
    assert types["ts"] == "DateTime64(3, 'UTC')"
    assert types["run_id"] == "LowCardinality(String)"
    assert types["reward"] == "Nullable(Float64)" and types["metrics"] == "Map(String, Float64)"
    engines = dict(client.query("SELECT name, engine FROM system.tables WHERE database='areal'").result_rows)
    for t in TABLES:
        assert engines[t.name] == "ReplacingMergeTree" and engines[t.view] == "View"


def test_a_store_made_by_version_1_is_upgraded_in_place(url: str) -> None:
    """A store from before the client fields: steps with an integer epoch and no attempt; the rows stay."""
    c = open_client(Target.parse(url), readonly=False, use_database=False)
    try:
        c.command("CREATE DATABASE areal")
        c.command("CREATE TABLE areal.schema_migrations (version UInt32, description String, "
                  "applied_at DateTime64(3, 'UTC') DEFAULT now64(3, 'UTC')) ENGINE = ReplacingMergeTree ORDER BY version")
        c.command("INSERT INTO areal.schema_migrations (version, description) VALUES (1, 'v1')")
        c.command("CREATE TABLE areal.steps (event_id String, run_id String, step UInt64, epoch UInt32, _offset UInt64) "
                  "ENGINE = ReplacingMergeTree(_offset) ORDER BY (run_id, step, event_id)")
        c.command("CREATE TABLE areal.evals (event_id String, run_id String, step UInt64, _offset UInt64) "
                  "ENGINE = ReplacingMergeTree(_offset) ORDER BY (run_id, step, event_id)")
        c.command("INSERT INTO areal.steps VALUES ('e1', 'r1', 3, 2, 0)")
        assert apply_schema(c) == SCHEMA_VERSION
        types = dict(c.query("SELECT name, type FROM system.columns WHERE database='areal' AND table='steps'").result_rows)
        assert types["epoch"] == "Float64" and types["attempt"] == "UInt32" and types["non_finite"] == "Array(String)"
        assert c.query("SELECT step, epoch, attempt FROM areal.steps").result_rows == [(3, 2.0, 0)]
        assert c.command("SELECT count() FROM system.tables WHERE database='areal' AND name IN ('runs', 'v_runs')") == 2
    finally:
        c.close()


def test_retried_insert_with_the_same_token_is_dropped(client) -> None:
    rows = located(steps(50))
    insert_rows(client, "areal", rows, "areal.steps:0:0-49")
    insert_rows(client, "areal", rows, "areal.steps:0:0-49")  # the retry after a crash
    assert client.command("SELECT count() FROM areal.steps") == 50  # raw: no duplicate block
    insert_rows(client, "areal", rows, "areal.steps:0:0-49/other")  # same events, other batch
    assert client.command("SELECT count() FROM areal.steps") == 100
    assert client.command("SELECT count() FROM areal.steps FINAL") == 50
    assert client.command("SELECT count() FROM areal.v_steps") == 50


def evals_with_samples(n: int, run: str = "r1") -> list[EvalEvent]:
    return [EvalEvent(run_id=run, eval_id=f"e{i}", step=i, dataset="math500", accuracy=0.5, n_samples=2,
                      samples=[{"prompt": f"q{i}", "response": "a"}, {"prompt": f"q{i}", "response": "b"}] if i % 3 else [])
            for i in range(n)]


def positions(client, table: str) -> list[tuple[int, ...]]:
    extra = ", sample" if table == "generations" else ""
    return sorted(client.query(f"SELECT _offset{extra} FROM areal.{table}").result_rows)


def test_a_token_the_store_kept_without_its_rows_is_healed_by_insert_missing(client) -> None:
    """A process killed between ClickHouse recording a block's token and making its part visible
    leaves the token without the rows: a retry with that token is dropped. Simulated here by
    deleting the rows (the token stays in the deduplication log); insert_missing stores them once."""
    events = evals_with_samples(12)
    rows = located(events, "areal.evals", 2, 100)
    token = "areal.evals:2:100-111"
    insert_rows(client, "areal", rows, token)
    want = {t: positions(client, t) for t in ("evals", "generations")}
    assert len(want["evals"]) == 12 and len(want["generations"]) == 16  # 8 events with 2 samples

    client.command("ALTER TABLE areal.evals DELETE WHERE _offset IN (103, 104, 105, 110) SETTINGS mutations_sync = 2")
    client.command("ALTER TABLE areal.generations DELETE WHERE _offset = 104 SETTINGS mutations_sync = 2")
    insert_rows(client, "areal", rows, token)  # the retry after the crash: dropped by its token
    assert len(positions(client, "evals")) == 8 and len(positions(client, "generations")) == 14

    restore = f"{token}:restored:1"  # a token of its own (the sink makes one per restore)
    assert insert_missing(client, "areal", rows, restore) == 4
    assert {t: positions(client, t) for t in ("evals", "generations")} == want  # each row once
    assert insert_missing(client, "areal", rows, f"{token}:restored:2") == 0  # nothing missing: nothing inserted
    assert {t: positions(client, t) for t in ("evals", "generations")} == want
    # a row a merge replaced by a later copy of its event (re-sent) is held
    resent = located(events[:2], "areal.evals", 2, 200)
    insert_rows(client, "areal", resent, "areal.evals:2:200-201")
    client.command("ALTER TABLE areal.evals DELETE WHERE _offset IN (100, 101) SETTINGS mutations_sync = 2")
    assert insert_missing(client, "areal", rows, f"{token}:restored:3") == 0
    # the same rows of another run are not held (the check is by sorting key and version)
    other = located(evals_with_samples(3, run="r2"), "areal.evals", 3, 100)
    assert insert_missing(client, "areal", other, "areal.evals:3:100-102") == 3


def test_a_row_a_later_version_replaced_is_held_and_one_newer_than_what_is_stored_is_not(client) -> None:
    """Steps are keyed by (run_id, step, rank), versioned by (attempt, offset): a step logged again,
    or a resumed attempt's step, replaces the row in a merge. That row counts as held; a row newer
    than every stored version of its key does not."""
    first = located([StepEvent(run_id="r1", step=s, epoch=0, reward=0.1) for s in range(4)], first=10)
    insert_rows(client, "areal", first, "areal.steps:0:10-13")
    again = located([StepEvent(run_id="r1", step=s, epoch=0, reward=0.2) for s in (0, 1)], first=20)  # logged again
    resumed = located([StepEvent(run_id="r1", step=2, epoch=0, reward=0.3, attempt=1)], first=5)  # attempt 1
    insert_rows(client, "areal", again + resumed, "later")
    client.command("ALTER TABLE areal.steps DELETE WHERE _offset IN (10, 11, 12, 13) SETTINGS mutations_sync = 2")
    # steps 0-2 have a later version (offsets 20, 21; attempt 1 at offset 5); step 3 has none
    assert insert_missing(client, "areal", first, "areal.steps:0:10-13:restored") == 1
    assert client.query("SELECT step, _offset FROM areal.steps ORDER BY step, _offset").result_rows == [
        (0, 20), (1, 21), (2, 5), (3, 13)]
    newer = located([StepEvent(run_id="r1", step=0, epoch=0, reward=0.0)], first=30)  # after offset 20
    assert insert_missing(client, "areal", newer, "areal.steps:0:30-30:restored") == 1


AGGREGATES = ("step_aggregates", "rank_aggregates", "rank_aggregates_coarse")


@pytest.mark.parametrize("lost", [AGGREGATES, ("step_aggregates",), ("rank_aggregates_coarse",), ()])
def test_rows_a_block_left_in_steps_but_not_in_its_aggregates_are_counted_by_a_retry_in_part(client, lost) -> None:
    """A kill between a block's part in `steps` and its materialized views' parts leaves rows the aggregates
    never counted, which no count rule sees. Retried in part (its token cannot be given again), a chunk's rows
    held in `steps` but not counted by some aggregate go in again: the aggregates equal the raw rows' rule
    (the table that lacked them counts them once; one that had them counts them twice and reads those steps
    from the raw rows). With nothing lost, nothing is inserted."""
    from tests.test_rank_aggregates import assert_view_is_the_raw_rule as assert_buckets_are_the_raw_rule
    from tests.test_step_means import assert_view_is_the_raw_rule as assert_means_are_the_raw_rule

    events = [StepEvent(run_id="a", step=s, rank=r, world_size=4, epoch=0, reward=s / 10 + r, n_samples=r + 1,
                        latency_ms=10.0 + r, throughput=100.0 * r, metrics={"m": float(r)})
              for s in range(70) for r in range(4)]
    rows = located(events, partition=1, first=500)
    insert_rows(client, "areal", rows, "areal.steps:1:500-779+areal.steps:2:0-9")  # the block, with a chunk read elsewhere
    for table in lost:  # the kill: these views' parts of the block never made
        client.command(f"TRUNCATE TABLE areal.{table}")
    half = rows[: len(rows) // 2]  # one chunk of the block, retried alone
    expected = len(half) if lost else 0
    assert insert_missing(client, "areal", half, "areal.steps:1:500-639:redone", views_may_lack=True) == expected
    assert insert_missing(client, "areal", rows[len(half):], "areal.steps:1:640-779:redone",
                          views_may_lack=True) == (len(rows) - len(half) if lost else 0)
    assert client.query("SELECT count() FROM areal.v_steps").result_rows == [(len(events),)]
    assert_means_are_the_raw_rule(client)
    assert_buckets_are_the_raw_rule(client)
    # without the flag (a chunk whose own token went in whole) nothing is inserted for the views
    assert insert_missing(client, "areal", rows, "areal.steps:1:500-779:again") == 0


def test_a_step_logged_again_whose_second_version_the_views_lost_is_counted_by_a_retry_in_part(client) -> None:
    """A rank logs a step twice; its first version is stored and counted, its second goes in a block whose views'
    parts a kill lost. The rank's bit is set (by the first version), so the bits alone call the second counted
    and the view kept the first's value, while `steps` holds the second's (a review). The key is stored in two
    versions: its row goes in again, the step is counted twice and read from the raw rows: the second's value."""
    from areal_metrics.sinks import rank_aggregates, step_means
    from areal_metrics.sinks.schema import SchemaOptions
    from tests.test_step_means import assert_view_is_the_raw_rule as assert_means_are_the_raw_rule

    first = located([StepEvent(run_id="a", step=3, rank=r, world_size=2, epoch=0, reward=0.1) for r in range(2)])
    again = located([StepEvent(run_id="a", step=3, rank=0, world_size=2, epoch=0, reward=0.9)], first=10)
    insert_rows(client, "areal", first, "areal.steps:0:0-1")
    views = ("step_aggregates_mv", "rank_aggregates_mv", "rank_aggregates_coarse_mv")
    for view in views:  # the kill: the second version's block reaches `steps` alone
        client.command(f"DROP VIEW areal.{view}")
    insert_rows(client, "areal", again, "areal.steps:0:10-10+areal.steps:1:0-0")
    o = SchemaOptions()
    for sql in (step_means.aggregates_mv_sql(o), rank_aggregates.mv_sql(o), rank_aggregates.coarse_mv_sql(o)):
        client.command(sql)
    assert client.query("SELECT reward FROM areal.v_step_means").result_rows == [(0.1,)]  # the first's, unseen
    assert insert_missing(client, "areal", again, "areal.steps:0:10-10:redone", views_may_lack=True) == 1
    assert client.query("SELECT reward FROM areal.v_step_means").result_rows == [(0.5,)]  # (0.9 + 0.1) / 2
    assert_means_are_the_raw_rule(client)


def test_rows_of_two_partitions_at_the_same_offsets_are_told_apart_by_insert_missing(client) -> None:
    """A retried block holds a topic's chunks of several partitions, whose offsets overlap: a row is missing
    by its log position (partition and offset), not by its offset alone."""
    held = located([StepEvent(run_id="r1", step=s, epoch=0, reward=0.1) for s in range(3)], partition=0, first=100)
    lacking = located([StepEvent(run_id="r2", step=s, epoch=0, reward=0.2) for s in range(3)], partition=1, first=100)
    insert_rows(client, "areal", held, "areal.steps:0:100-102")
    assert insert_missing(client, "areal", held + lacking, "block:restored") == 3
    assert sorted(client.query("SELECT _partition, _offset FROM areal.steps").result_rows) == [
        (p, o) for p in (0, 1) for o in (100, 101, 102)]  # each once


def test_plans_name_their_block_and_those_recorded_before_it_their_own_chunk(client) -> None:
    """Schema 15: a plan names the token of the block its chunk went in; a plan recorded before that (no
    block) went in alone, under its chunk's token, which is what a retry must give again."""
    record_plans(client, "areal", "g", {("t", 0): Plan(0, 9, "t:0:0-9+t:1:5-7"), ("t", 1): Plan(5, 7, "t:0:0-9+t:1:5-7")})
    client.command("INSERT INTO areal._sink_batches (consumer_group, topic, partition, first_offset, last_offset) "
                   "VALUES ('g', 't', 2, 3, 4)")  # as the sink before schema 15 wrote it
    plans = load_plans(client, "areal", "g")
    assert plans == {("t", 0): Plan(0, 9), ("t", 1): Plan(5, 7), ("t", 2): Plan(3, 4)}
    assert {tp: p.group for tp, p in plans.items()} == {
        ("t", 0): "t:0:0-9+t:1:5-7", ("t", 1): "t:0:0-9+t:1:5-7", ("t", 2): "t:2:3-4"}


def test_resent_event_counts_once_in_views_of_every_table(client) -> None:
    ev = EvalEvent(run_id="r1", eval_id="e1", step=5, dataset="math500", accuracy=0.5, verdicts=[1, 0], n_samples=2)
    insert_rows(client, "areal", located([ev], "areal.evals", 0, 0), "a")
    insert_rows(client, "areal", located([ev], "areal.evals", 1, 9), "b")
    assert client.command("SELECT count() FROM areal.v_evals") == 1
    assert client.query("SELECT verdicts, dataset FROM areal.v_evals").result_rows == [([1, 0], "math500")]


def test_a_runs_display_name_is_kept_beside_its_id(client) -> None:
    from areal_metrics.producers.contract.events import RunEvent

    events = [RunEvent(run_id="exp-lr-1e-6-0a1b2c3d", status=s, name="proj/exp lr=1e-6 · 实验", ts=t)
              for s, t in (("running", 1.0), ("finished", 2.0))]
    insert_rows(client, "areal", located(events, "areal.runs"), "names")
    assert client.query("SELECT run_id, name, status FROM areal.v_runs").result_rows == [
        ("exp-lr-1e-6-0a1b2c3d", "proj/exp lr=1e-6 · 实验", "finished")]


def test_a_run_logged_from_rank_zero_alone_finishes_when_rank_zero_does(client) -> None:
    """Issue 40, item 12: RANK=0 WORLD_SIZE=2 and only rank 0 calls init: the run ends when its
    registered ranks finished; a second rank that registered keeps it running until it ends."""
    from areal_metrics.producers.contract.events import RunEvent
    from areal_metrics.producers.contract.run_status import fold

    alone = [RunEvent(run_id="r0-alone", rank=0, world_size=2, status=s, ts=t, event_id=f"a{t}")
             for s, t in (("running", 1.0), ("finished", 2.0))]
    both = [*(e.replace(run_id="r0-both", event_id="b" + e.event_id) for e in alone),
            RunEvent(run_id="r0-both", rank=1, world_size=2, status="running", ts=1.5, event_id="b1")]
    insert_rows(client, "areal", located([*alone, *both], "areal.runs"), "ranks")
    rows = client.query("SELECT run_id, status FROM areal.v_runs ORDER BY run_id").result_rows
    assert rows == [("r0-alone", "finished"), ("r0-both", "running")]
    assert {k: s.status for k, s in fold([*alone, *both]).items()} == dict(rows)


def test_direct_store_is_read_only_unless_write(client, url: str) -> None:
    insert_rows(client, "areal", located(steps(3)), "t")
    client.close()
    settings = Settings(clickhouse_url=url)
    with connect(settings) as store:
        assert isinstance(store, DirectStore)
        columns, rows = store.query("SELECT count() AS n FROM steps FINAL")
        assert columns == ["n"] and rows == [(3,)]
        with pytest.raises(QueryError, match="readonly"):
            store.query("INSERT INTO steps (event_id, run_id) VALUES ('x', 'y')")
        with pytest.raises(QueryError) as err:
            store.query("SELEC 1")
        assert "\n" not in str(err.value) and "Syntax error" in str(err.value)
    with connect(settings, write=True) as store:
        store.command("TRUNCATE TABLE steps")
        assert store.query("SELECT count() FROM steps").rows == [(0,)]


def cli(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, AREAL_CLICKHOUSE_URL=url)
    return subprocess.run([sys.executable, "-m", "areal_metrics", *args], capture_output=True, text=True, env=env, timeout=60)


def test_sql_verb_through_the_http_endpoint_while_the_store_is_held(client, url: str) -> None:
    """This process holds the directory (like a running sink); `connect` and another process's `sql` use
    its ClickHouse HTTP endpoint with clickhouse-connect."""
    from clickhouse_connect.driver.httpclient import HttpClient

    insert_rows(client, "areal", located(steps(4)), "t")
    target = Target.parse(url)
    endpoint = ClickHouseHTTPServer(target.path, "areal")
    endpoint.publish()
    try:
        owner = read_owner(target.path)
        assert owner is not None and owner.port == endpoint.port
        assert owner.dsn() == endpoint.dsn() and owner.dsn(write=True) == endpoint.dsn("writer")
        assert (target.path / OWNER_FILE).stat().st_mode & 0o077 == 0  # the passwords are private
        store = connect(Settings(clickhouse_url=url))
        assert isinstance(store, DirectStore) and isinstance(store.client, HttpClient)
        # server-side parameters and typed values survive the trip through the endpoint
        r = store.query("SELECT step, ts, metrics FROM v_steps WHERE run_id IN {runs:Array(String)} AND step < {n:UInt32} ORDER BY step",
                        {"runs": ["r1"], "n": 2})
        assert [row[0] for row in r.rows] == [0, 1] and r.rows[1][1].year == 2023 and r.rows[0][2] == {}
        assert r.types == ["UInt64", "DateTime64(3, 'UTC')", "Map(String, Float64)"]
        assert store.command("SELECT count() FROM v_steps WHERE run_id = {r:String}", {"r": "r1"}) == 4
        with pytest.raises(QueryError, match="Code: 164.*readonly") as err:
            store.command("TRUNCATE TABLE steps")
        assert "\n" not in str(err.value) and "for url" not in str(err.value)

        r = cli("sql", "SELECT step, reward, ts FROM v_steps ORDER BY step", "--format", "json", url=url)
        assert r.returncode == 0, r.stderr
        lines = [json.loads(x) for x in r.stdout.splitlines()]
        assert [x["step"] for x in lines] == [0, 1, 2, 3]
        assert lines[1]["ts"].startswith("2023-11-14T22:13:21")

        r = cli("sql", "SELECT count() AS n FROM steps FINAL", url=url)
        assert r.returncode == 0 and r.stdout.split() == ["n", "-", "4", "(1", "row)"]
        r = cli("sql", "SELECT run_id, step FROM v_steps ORDER BY step LIMIT 2", "--format", "csv", url=url)
        assert r.stdout == "run_id,step\nr1,0\nr1,1\n"
        r = cli("sql", "SELECT run_id, step FROM v_steps ORDER BY step LIMIT 1", "--format", "tsv", url=url)
        assert r.stdout == "run_id\tstep\nr1\t0\n"

        r = cli("sql", "SELECT nope FROM steps", url=url)
        assert r.returncode == 2 and r.stdout == ""
        assert len(r.stderr.strip().splitlines()) == 1 and "nope" in r.stderr and "Traceback" not in r.stderr

        r = cli("sql", "TRUNCATE TABLE steps", url=url)
        assert r.returncode == 2 and "readonly" in r.stderr and "Code: 164" in r.stderr
        r = cli("sql", "TRUNCATE TABLE steps", "--write", url=url)
        assert r.returncode == 0, r.stderr
        assert client.command("SELECT count() FROM areal.steps") == 0
    finally:
        endpoint.close()
    assert read_owner(target.path) is None


def test_a_stale_or_foreign_owner_file_is_ignored(client, url: str) -> None:
    target = Target.parse(url)
    users = {"reader": {"user": "reader", "password": "x", "readonly": True},
             "writer": {"user": "writer", "password": "y", "readonly": False}}
    (target.path / OWNER_FILE).write_text(json.dumps({"pid": 2**22 + 12345, "port": 1, "database": "areal", "users": users}))
    assert read_owner(target.path) is None  # no such process
    (target.path / OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "port": 1, "token": "x"}))
    assert read_owner(target.path) is None  # the private protocol's file: not ours any more
    (target.path / OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "port": 1, "database": "areal", "users": users}))
    assert read_owner(target.path) is None  # nothing listens on the port


def test_bad_url_is_one_line() -> None:
    with pytest.raises(ConfigError, match="expected chdb:///path or http"):
        Target.parse("mysql://x")
    r = cli("sql", "SELECT 1", url="chdb://memory")
    assert r.returncode == 2 and "give a data directory" in r.stderr


def test_a_runs_notes_and_summary_are_stored_and_v_runs_shows_them(client) -> None:
    """Issue 44, item 6: `init(notes=...)` and `run.summary` are columns of `runs` (canonical JSON text for the
    summary) and of `v_runs`: rank 0's summary of the latest attempt that has one, and that attempt's notes."""
    from areal_metrics.producers.contract.events import RunEvent

    def run(rank: int, attempt: int, status: str, ts: float, **fields) -> RunEvent:
        return RunEvent(run_id="wb", rank=rank, world_size=2, attempt=attempt, status=status, ts=ts,
                        event_id=f"{rank}-{attempt}-{status}", **fields)

    events = [run(r, 0, "running", 1.0 + r, notes="first try") for r in (0, 1)] + [
        run(1, 0, "finished", 5.0, notes="first try", summary={"best_acc": 0.3, "rank": 1}),
        run(0, 0, "finished", 6.0, notes="first try", summary={"best_acc": 0.4, "z": [1, 2], "a": {"b": None}})]
    insert_rows(client, "areal", located(events, "areal.runs"), "runs-1")
    insert_rows(client, "areal", located(events[2:], "areal.runs", 1, 40), "runs-again")  # redelivered
    assert client.command("SELECT count() FROM areal.runs FINAL") == 4
    stored = client.query("SELECT rank, status, notes, summary FROM areal.runs FINAL ORDER BY ts").result_rows
    assert stored == [(0, "running", "first try", None), (1, "running", "first try", None),
                      (1, "finished", "first try", '{"best_acc":0.3,"rank":1}'),
                      (0, "finished", "first try", '{"a":{"b":null},"best_acc":0.4,"z":[1,2]}')]
    view = "SELECT status, notes, summary, JSONExtractFloat(summary, 'best_acc') FROM areal.v_runs"
    assert client.query(view).result_rows == [
        ("finished", "first try", '{"a":{"b":null},"best_acc":0.4,"z":[1,2]}', 0.4)]
    # a resumed attempt, still running, with other notes: its notes, and the summary the last attempt ended with
    insert_rows(client, "areal", located([run(0, 1, "running", 9.0, notes="resumed")], "areal.runs", 0, 50), "runs-2")
    assert client.query(view).result_rows == [
        ("running", "resumed", '{"a":{"b":null},"best_acc":0.4,"z":[1,2]}', 0.4)]


def test_migration_10_adds_notes_and_summary_to_an_older_store_and_keeps_its_runs(client) -> None:
    from areal_metrics.producers.contract.events import RunEvent

    old = RunEvent(run_id="before", status="finished", name="kept", ts=1.0)
    insert_rows(client, "areal", located([old], "areal.runs"), "old")
    client.command("DROP VIEW areal.v_runs")  # a store of schema 9: runs without the two columns
    client.command("ALTER TABLE areal.runs DROP COLUMN notes")
    client.command("ALTER TABLE areal.runs DROP COLUMN summary")
    client.command("ALTER TABLE areal.schema_migrations DELETE WHERE version >= 10 SETTINGS mutations_sync = 1")
    assert applied_version(client) == 9
    assert apply_schema(client) == SCHEMA_VERSION and apply_schema(client) == SCHEMA_VERSION
    new = RunEvent(run_id="after", status="finished", notes="n", summary={"best_acc": 0.4}, ts=2.0)
    insert_rows(client, "areal", located([new], "areal.runs", 0, 1), "new")
    assert client.query("SELECT run_id, name, notes, summary FROM areal.v_runs ORDER BY run_id").result_rows == [
        ("after", None, "n", '{"best_acc":0.4}'), ("before", "kept", None, None)]
