"""Schema version 4 on the embedded engine (no broker): tables partitioned by run, raw steps' TTL, the migration.

`FINAL` and merges deduplicate within a partition only, so every version of a
row must land in the partition of the row it replaces. These tests put the
versions far apart in every other respect (months apart in time, other Kafka
partitions and offsets, other insert blocks mixing several runs) and check
both that the views show one row per key, as a reference computed in Python
says, and that `OPTIMIZE ... FINAL` (which merges within partitions only)
leaves exactly that many rows in the table itself.
"""

from __future__ import annotations

import datetime as dt
import random
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_metrics.producers.contract.errors import ConfigError
from areal_metrics.producers.contract.events import EvalConsensusEvent, EvalEvent, StepEvent
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.sinks.migrations import apply_schema
from areal_metrics.sinks.query import Target, open_client
from areal_metrics.sinks.rows import Located
from areal_metrics.sinks.schema import (
    PARTITION_BY,
    SCHEMA_VERSION,
    TABLES,
    TABLES_BY_NAME,
    SchemaOptions,
    create_table_sql,
)
from areal_metrics.sinks.writer import insert_rows

# 23:59:50 on 31 January 2026 and 00:00:10 on 1 February: one step's two attempts straddle a month
JAN_31 = dt.datetime(2026, 1, 31, 23, 59, 50, tzinfo=dt.timezone.utc).timestamp()
FEB_1 = JAN_31 + 20
RUNS = [f"run-{i}" for i in range(8)]  # spread over several of the 16 partitions


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    url = f"chdb://{tmp_path_factory.mktemp('partitions') / 'clickhouse'}"
    c = open_client(Target.parse(url), readonly=False, use_database=False)
    apply_schema(c)
    yield c
    c.close()


def put(client: object, rows: list[tuple[object, int, int]], token: str, db: str = "areal") -> None:
    """rows: (event, Kafka partition, offset), inserted as one block, as one sink chunk."""
    topic = {"step": "areal.steps", "eval": "areal.evals", "eval_consensus": "areal.evals.consensus"}
    insert_rows(client, db, [Located(e, topic[e.type], p, o) for e, p, o in rows], token)


def clear(client: object) -> None:
    for t in TABLES:
        client.command(f"TRUNCATE TABLE areal.{t.name}")


def test_every_table_is_partitioned_by_a_function_of_its_sorting_key(client) -> None:
    rows = client.query("SELECT name, partition_key, sorting_key FROM system.tables "
                        "WHERE database = 'areal' AND engine LIKE '%MergeTree'").result_rows
    layout = {name: (part, key) for name, part, key in rows}
    for t in TABLES:
        part, key = layout[t.name]
        assert part == PARTITION_BY and key.split(", ")[0] == "run_id", t.name
    assert len({int(client.command(f"SELECT cityHash64('{r}') % 16")) for r in RUNS}) >= 4


def test_a_resumed_step_and_a_redelivery_collapse_across_months_blocks_and_partitions(client) -> None:
    clear(client)
    first = [StepEvent(run_id=r, rank=k, step=s, epoch=0, reward=0.1, attempt=0, ts=JAN_31 + s * 0.01)
             for r in RUNS for s in range(5) for k in (0, 1)]
    put(client, [(e, i % 3, 1000 + i) for i, e in enumerate(first)], "t0")  # one block, every run
    resumed = [StepEvent(run_id=r, rank=k, step=s, epoch=1, reward=0.9, attempt=1, ts=FEB_1 + s)
               for r in RUNS for s in range(3, 5) for k in (0, 1)]
    put(client, [(e, 7, i) for i, e in enumerate(resumed)], "t1")  # lower offsets, another Kafka partition
    put(client, [(e, 5, 9000 + i) for i, e in enumerate(first[::3])], "t2")  # re-sent, yet another block
    assert client.command("SELECT uniqExact(partition) FROM system.parts WHERE database = 'areal' "
                          "AND table = 'steps' AND active") >= 4
    rows = client.query("SELECT run_id, step, rank, reward, attempt, toMonth(ts) FROM areal.v_steps").result_rows
    expected = {(r, s, k): ((0.9, 1, 2) if s >= 3 else (0.1, 0, 1)) for r in RUNS for s in range(5) for k in (0, 1)}
    assert {(r, s, k): (w, a, m) for r, s, k, w, a, m in rows} == expected and len(rows) == len(expected)
    client.command("OPTIMIZE TABLE areal.steps FINAL")  # merges within partitions only
    assert client.command("SELECT count() FROM areal.steps") == len(expected)


def test_evals_generations_and_re_emitted_derived_events_collapse_too(client) -> None:
    clear(client)
    samples = [{"prompt": "q", "response": "a", "verdict": 1, "reward": 1.0}] * 2
    evals = [EvalEvent(run_id=r, node="h:0", eval_id=f"{r}:4:math:full", step=4, dataset="math", accuracy=0.5,
                       samples=samples, attempt=0, ts=JAN_31) for r in RUNS]
    put(client, [(e, 0, i) for i, e in enumerate(evals)], "e0")
    put(client, [(e.replace(accuracy=0.75, attempt=1, ts=FEB_1), 3, i) for i, e in enumerate(evals)], "e1")
    consensus = [EvalConsensusEvent(run_id=r, eval_id=f"{r}:4:math:full", step=4, dataset="math", accuracy=0.5,
                                    votes=2, replicas=2, agreement=1.0, ts=JAN_31) for r in RUNS]
    put(client, [(e, 0, i) for i, e in enumerate(consensus)], "c0")
    # the worker re-emits a round after a restart: same event_id, a new ts in the next month
    put(client, [(e.replace(ts=FEB_1), 1, 50 + i) for i, e in enumerate(consensus)], "c1")
    assert client.query("SELECT DISTINCT accuracy, attempt FROM areal.v_evals").result_rows == [(0.75, 1)]
    assert client.command("SELECT count() FROM areal.v_evals") == len(RUNS)
    assert client.command("SELECT count() FROM areal.v_generations") == 2 * len(RUNS)
    assert client.command("SELECT count() FROM areal.v_eval_consensus") == len(RUNS)
    for table in ("evals", "generations", "eval_consensus"):
        client.command(f"OPTIMIZE TABLE areal.{table} FINAL")
    assert [client.command(f"SELECT count() FROM areal.{t}") for t in ("evals", "generations", "eval_consensus")] == [
        len(RUNS), 2 * len(RUNS), len(RUNS)]


@st.composite
def histories(draw: st.DrawFn) -> list[tuple[StepEvent, int, int]]:
    """Step events of a few runs with resumed attempts, re-sent events and times spread over months."""
    runs = draw(st.lists(st.sampled_from(RUNS), min_size=1, max_size=5, unique=True))
    out: list[tuple[StepEvent, int, int]] = []
    offset = 0
    for run in runs:
        ranks = draw(st.integers(1, 3))
        steps = draw(st.integers(1, 6))
        for attempt in range(draw(st.integers(1, 3))):
            start = draw(st.integers(0, steps - 1)) if attempt else 0  # a resumed attempt redoes steps start..
            t0 = JAN_31 + draw(st.integers(-40, 40)) * 86_400 * (attempt + 1)  # clocks are not monotonic across hosts
            for step in range(start, steps):
                for rank in range(ranks):
                    offset += draw(st.integers(1, 3))
                    event = StepEvent(run_id=run, rank=rank, step=step, epoch=attempt, attempt=attempt,
                                      reward=draw(st.floats(0, 1)), ts=t0 + step)
                    out.append((event, draw(st.integers(0, 3)), offset))
    resent = draw(st.lists(st.sampled_from(out), max_size=len(out) // 2 + 1))
    for event, partition, _ in resent:  # the same event again, later in the log (or in another partition)
        offset += 1
        out.append((event, draw(st.integers(0, 3)), offset))
    return out


def reference(rows: list[tuple[StepEvent, int, int]]) -> dict[tuple[str, int, int], tuple[float, int]]:
    """Per (run, step, rank): the row of the highest (attempt, offset), as ReplacingMergeTree(_version) keeps."""
    best: dict[tuple[str, int, int], tuple[tuple[int, int], StepEvent]] = {}
    for event, _, offset in rows:
        key = (event.run_id, event.step, event.rank)
        version = (event.attempt, offset)
        if key not in best or version > best[key][0]:
            best[key] = (version, event)
    return {key: (event.reward, event.attempt) for key, (_, event) in best.items()}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow, HealthCheck.data_too_large])
@given(rows=histories(), blocks=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_views_keep_the_latest_version_of_every_step_whatever_the_blocks(client, rows, blocks, seed) -> None:
    clear(client)
    shuffled = list(rows)
    random.Random(seed).shuffle(shuffled)  # the blocks arrive in any order (Kafka partitions interleave)
    for b in range(blocks):
        chunk = shuffled[b::blocks]
        if chunk:
            put(client, chunk, f"h{seed}-{b}")
    expected = reference(rows)
    got = client.query("SELECT run_id, step, rank, reward, attempt FROM areal.v_steps").result_rows
    assert {(r, s, k): (w, a) for r, s, k, w, a in got} == expected and len(got) == len(expected)
    client.command("OPTIMIZE TABLE areal.steps FINAL")
    assert client.command("SELECT count() FROM areal.steps") == len(expected)


# ------------------------------------------------------------------ TTL of raw steps


def test_steps_ttl_setting_is_off_by_default_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AREAL_CLICKHOUSE_STEPS_TTL_DAYS", raising=False)
    assert Settings.from_env().clickhouse_steps_ttl_days is None
    for raw, days in (("30", 30), ("0", None), ("", None)):
        monkeypatch.setenv("AREAL_CLICKHOUSE_STEPS_TTL_DAYS", raw)
        assert Settings.from_env().clickhouse_steps_ttl_days == days
    for raw in ("-1", "thirty", "1.5"):
        monkeypatch.setenv("AREAL_CLICKHOUSE_STEPS_TTL_DAYS", raw)
        with pytest.raises(ConfigError, match="AREAL_CLICKHOUSE_STEPS_TTL_DAYS"):
            Settings.from_env()
    assert SchemaOptions.from_settings(Settings(clickhouse_steps_ttl_days=7), "x") == SchemaOptions("x", steps_ttl_days=7)
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="steps_ttl_days"):
            SchemaOptions(steps_ttl_days=bad)  # type: ignore[arg-type]


def test_a_ttl_expires_raw_steps_and_the_view_hides_them_before_any_merge(client) -> None:
    o = SchemaOptions(database="ttl", steps_ttl_days=30)
    apply_schema(client, o)
    client.command("SYSTEM STOP TTL MERGES ttl.steps")  # what the view shows must not wait for a merge
    now = dt.datetime.now(dt.timezone.utc).timestamp()
    old = [StepEvent(run_id="r", step=s, epoch=0, reward=0.1, ts=now - 40 * 86_400) for s in range(3)]
    new = [StepEvent(run_id="r", step=s, epoch=0, reward=0.9, ts=now - 86_400) for s in range(3, 5)]
    put(client, [(e, 0, i) for i, e in enumerate(old + new)], "ttl", db="ttl")
    assert "TTL toDateTime(ts) + toIntervalDay(30)" in client.command(
        "SELECT create_table_query FROM system.tables WHERE database = 'ttl' AND name = 'steps'")
    assert client.command("SELECT count() FROM ttl.steps") == 5  # stored until a TTL merge removes them
    assert client.query("SELECT step FROM ttl.v_steps ORDER BY step").result_rows == [(3,), (4,)]
    assert client.command("SELECT count() FROM ttl.v_evals") == 0  # other tables: no TTL, no filter
    apply_schema(client, o)  # again: nothing changes
    apply_schema(client, SchemaOptions(database="ttl"))  # the setting removed: the TTL goes, the rows show
    assert "TTL" not in client.command("SELECT create_table_query FROM system.tables WHERE database = 'ttl' "
                                       "AND name = 'steps'")
    assert client.command("SELECT count() FROM ttl.v_steps") == 5
    client.command("SYSTEM START TTL MERGES ttl.steps")
    apply_schema(client, SchemaOptions(database="ttl", steps_ttl_days=30))  # applied to the stored parts too
    client.command("OPTIMIZE TABLE ttl.steps FINAL")
    assert client.command("SELECT count() FROM ttl.steps") == 2


# ------------------------------------------------------------------ the migration


def legacy_layout_sql(name: str, o: SchemaOptions) -> str:
    """A table as schema version 3 created it: the same columns and key, no partitions."""
    return "\n".join(line for line in create_table_sql(TABLES_BY_NAME[name], o).splitlines()
                     if not line.startswith("PARTITION BY"))


def test_a_version_3_store_is_moved_to_partitions_in_place(client) -> None:
    o = SchemaOptions(database="v3")
    client.command("CREATE DATABASE v3")
    client.command("CREATE TABLE v3.schema_migrations (version UInt32, description String, applied_at "
                   "DateTime64(3, 'UTC') DEFAULT now64(3, 'UTC')) ENGINE = ReplacingMergeTree ORDER BY version")
    client.command("INSERT INTO v3.schema_migrations (version, description) VALUES (1, 'v1'), (2, 'v2'), (3, 'v3')")
    for t in TABLES:
        client.command(legacy_layout_sql(t.name, o))
    client.command("SYSTEM STOP MERGES v3.steps")
    first = [StepEvent(run_id=r, step=s, epoch=0, reward=0.1, ts=JAN_31) for r in RUNS for s in range(4)]
    put(client, [(e, 0, i) for i, e in enumerate(first)], "a", db="v3")
    put(client, [(e.replace(reward=0.9, attempt=1, ts=FEB_1), 1, i) for i, e in enumerate(first[::2])], "b", db="v3")
    put(client, [(e, 2, 100 + i) for i, e in enumerate(first[:5])], "c", db="v3")  # re-sent
    consensus = [EvalConsensusEvent(run_id=r, eval_id="e", step=1, dataset="d", accuracy=0.5, votes=1, replicas=1,
                                    agreement=1.0) for r in RUNS]
    put(client, [(e, 0, i) for i, e in enumerate(consensus)], "d", db="v3")
    view = "SELECT run_id, step, reward, attempt, _ingested_at FROM v3.steps FINAL ORDER BY run_id, step"
    before, raw_before = client.query(view).result_rows, client.command("SELECT count() FROM v3.steps")
    assert raw_before == len(first) + len(first[::2]) + 5 and len(before) == len(first)

    assert apply_schema(client, o) == SCHEMA_VERSION
    layout = dict(client.query("SELECT name, partition_key FROM system.tables WHERE database = 'v3'").result_rows)
    assert all(layout[t.name] == PARTITION_BY for t in TABLES)
    assert not [name for name in layout if "__v" in name]  # no copy left behind
    assert client.query(view.replace("v3.steps FINAL", "v3.v_steps")).result_rows == before  # _ingested_at kept
    assert client.command("SELECT count() FROM v3.v_eval_consensus") == len(RUNS)
    assert apply_schema(client, o) == SCHEMA_VERSION  # and again: nothing to do
    assert client.query(view).result_rows == before
