"""v_step_means: one rank mean per step, kept at insert time, the worker's rule, exactly once.

The per-step aggregates (sinks/step_means.py) are checked against the deduplicated raw rows
(`v_steps`) with the worker's own rule (`streams.core.ranks.mean_reward`), after every way a
row can reach the store twice: a retried batch (same token), the same event in another block
(a client's re-send), a step logged again by one rank, a resumed attempt, and a backfill that
races live inserts. The dashboards must read them: no panel averages raw rank rows.
"""

from __future__ import annotations

import random
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_metrics.grafana.catalog import BUILDERS, build
from areal_metrics.grafana.queries import dashboard_queries
from areal_metrics.producers.contract.events import StepEvent
from areal_metrics.analysis.report import load_metric, load_rewards
from areal_metrics.sinks.migrations import apply_schema
from areal_metrics.sinks.query import Target, open_client
from areal_metrics.sinks.rows import Located
from areal_metrics.sinks.schema import MIGRATIONS_TABLE, SCHEMA_VERSION, SchemaOptions
from areal_metrics.sinks.step_means import AGGREGATES, MEAN_COLUMNS, RANK_WORDS, delivered_twice_sql, drop_statements
from areal_metrics.sinks.writer import insert_rows
from areal_metrics.streams.core.ranks import RankReport, RankState, add_rank, mean_reward

TS = 1_800_000_000.0


@pytest.fixture
def client(tmp_path: Path) -> Iterator[Any]:
    c = open_client(Target.parse(f"chdb://{tmp_path / 'ch'}"), readonly=False, use_database=False)
    apply_schema(c)
    yield c
    c.close()


class ClientStore:
    """What `report`'s loaders need of a store (`.query(sql, parameters).rows`), over a client."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> Any:
        result = self.client.query(re.sub(r"\bFROM v_", "FROM areal.v_", sql), parameters=parameters)

        class R:
            rows = result.result_rows
        return R


_offsets = iter(range(10**9))


def put(client: Any, events: list[StepEvent], token: str | None = None) -> None:
    """One insert block, as the sink writes it (every row a new log position unless `token` repeats a batch)."""
    rows = [Located(e, "areal.steps", 0, next(_offsets)) for e in events]
    insert_rows(client, "areal", rows, token or f"t{rows[0].offset}")


def put_with_retries(client: Any, events: list[StepEvent], size: int, retried: int) -> None:
    """`events` in insert blocks of `size`, then the first `retried` blocks again with the same tokens:
    a sink retrying its planned batches."""
    blocks = [events[i:i + size] for i in range(0, len(events), size)]
    for i, block in enumerate([*blocks, *blocks[:retried]]):
        put(client, block, token=f"batch-{i % len(blocks)}")


def worker_mean(client: Any, column: str) -> dict[tuple[str, int, int], float | None]:
    """(run, attempt, step) -> the worker's rule over the deduplicated raw rows of the step's latest attempt."""
    raw = client.query(f"SELECT run_id, attempt, step, rank, toFloat64({column}), n_samples FROM areal.v_steps").result_rows
    latest: dict[tuple[str, int], int] = {}
    for run, attempt, step, *_ in raw:
        latest[(run, step)] = max(attempt, latest.get((run, step), -1))
    reports: dict[tuple[str, int, int], list[RankReport]] = defaultdict(list)
    for run, attempt, step, rank, value, n in raw:
        if attempt == latest[(run, step)]:
            reports[(run, attempt, step)].append(RankReport(rank=rank, reward=value, n_samples=n))
    return {k: mean_reward(tuple(v)) for k, v in reports.items()}


def view_means(client: Any, column: str) -> dict[tuple[str, int, int], float | None]:
    rows = client.query(f"SELECT run_id, attempt, step, `{column}` FROM areal.v_step_means").result_rows
    return {(r, a, s): v for r, a, s, v in rows}


def metric_means(client: Any, source: str) -> dict[tuple[str, int, int], dict[str, float]]:
    """(run, attempt, step) -> the `metrics` keys' plain means over ranks: from the raw rows (`v_steps`,
    in Python) or from `v_step_means`."""
    if source == "view":
        rows = client.query("SELECT run_id, attempt, step, metrics FROM areal.v_step_means").result_rows
        return {(r, a, st): dict(m) for r, a, st, m in rows if m}
    raw = client.query("SELECT run_id, attempt, step, metrics FROM areal.v_steps").result_rows
    latest: dict[tuple[str, int], int] = {}
    for run, attempt, step, _ in raw:
        latest[(run, step)] = max(attempt, latest.get((run, step), -1))
    values: dict[tuple[str, int, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run, attempt, step, metrics in raw:
        if attempt == latest[(run, step)]:
            for key, value in metrics.items():
                values[(run, attempt, step)][key].append(value)
    return {k: {key: sum(v) / len(v) for key, v in keys.items()} for k, keys in values.items() if keys}


def assert_view_is_the_raw_rule(client: Any, columns: tuple[str, ...] = MEAN_COLUMNS) -> None:
    one_row_each = client.query("SELECT count(), uniqExact(run_id, attempt, step) FROM areal.v_step_means").result_rows
    assert one_row_each[0][0] == one_row_each[0][1]
    assert_of_runs_is_the_view(client)
    want_metrics, got_metrics = metric_means(client, "raw"), metric_means(client, "view")
    assert set(got_metrics) == set(want_metrics)
    for key, means in want_metrics.items():
        assert got_metrics[key] == pytest.approx(means, rel=1e-12), key
    for column in columns:
        want, got = worker_mean(client, column), view_means(client, column)
        assert set(got) == set(want), column
        for key, value in want.items():
            assert got[key] == (None if value is None else pytest.approx(value, rel=1e-12)), (column, key)


def assert_of_runs_is_the_view(client: Any) -> None:
    """v_step_means_of(runs) holds v_step_means' rows of those runs, every column: given every run, and
    given each run alone (the steps of other runs delivered twice stay out)."""
    runs = sorted(r for (r,) in client.query("SELECT DISTINCT run_id FROM areal.steps").result_rows)
    order = " ORDER BY run_id, attempt, step"
    view = client.query("SELECT * FROM areal.v_step_means" + order).result_rows
    assert client.query(f"SELECT * FROM areal.v_step_means_of(runs = {runs!r})" + order).result_rows == view
    for run in runs:
        of_one = client.query(f"SELECT * FROM areal.v_step_means_of(runs = {[run]!r})" + order).result_rows
        assert of_one == [row for row in view if row[0] == run], run


def test_unequal_n_samples_the_worker_the_view_and_the_report_agree(client: Any) -> None:
    """Two ranks with 10 and 30 samples at rewards 0.2 and 0.8: 0.65 everywhere (not 0.5)."""
    ranks = [StepEvent(run_id="r", step=3, epoch=0, rank=0, reward=0.2, n_samples=10, world_size=2, ts=TS),
             StepEvent(run_id="r", step=3, epoch=0, rank=1, reward=0.8, n_samples=30, world_size=2, ts=TS + 1)]
    state, ready = RankState(), []
    for e in ranks:  # the stream worker's core, as it meets the two reports
        state, out = add_rank(state, (e.attempt, e.step), e.world_size,
                              RankReport(rank=e.rank, reward=e.reward, n_samples=e.n_samples), e.ts, e.event_id, now=0.0)
        ready += out
    assert [r.reward for r in ready] == [pytest.approx(0.65)]
    put(client, ranks)
    assert view_means(client, "reward") == {("r", 0, 3): pytest.approx(0.65)}
    raw, _ = load_rewards(ClientStore(client), "run_id = 'r'")
    assert raw == {"r": [(3, pytest.approx(0.65))]}
    assert load_metric(ClientStore(client), "run_id = 'r'", "reward") == {"r": [(3, pytest.approx(0.65))]}
    row = client.query("SELECT ranks, world_size, n_samples, reward_min, reward_max FROM areal.v_step_means").result_rows
    assert row == [(2, 2, 40, 0.2, 0.8)]


def test_a_rank_without_n_samples_makes_the_step_unweighted_as_in_the_worker(client: Any) -> None:
    put(client, [StepEvent(run_id="r", step=1, epoch=0, rank=0, reward=0.2, n_samples=10, ts=TS),
                 StepEvent(run_id="r", step=1, epoch=0, rank=1, reward=0.8, ts=TS),
                 StepEvent(run_id="r", step=1, epoch=0, rank=2, n_samples=50, ts=TS),  # no reward: not counted
                 StepEvent(run_id="r", step=2, epoch=0, rank=0, reward=0.4, n_samples=0, ts=TS),
                 StepEvent(run_id="r", step=2, epoch=0, rank=1, reward=0.6, n_samples=0, ts=TS),  # weights sum to 0
                 StepEvent(run_id="r", step=3, epoch=0, rank=0, kl=0.1, ts=TS)])  # no rank has a reward
    assert view_means(client, "reward") == {("r", 0, 1): pytest.approx(0.5), ("r", 0, 2): pytest.approx(0.5),
                                            ("r", 0, 3): None}
    assert_view_is_the_raw_rule(client)


def test_every_way_a_row_arrives_twice_counts_once(client: Any) -> None:
    rng = random.Random(42)
    events: list[StepEvent] = []
    for run in ("a", "b"):
        for step in range(30):
            for rank in range(rng.choice([1, 3, 8, 70])):  # 70 ranks: the rank set spans two words
                events.append(StepEvent(
                    run_id=run, step=step, epoch=step / 10, rank=rank, world_size=70, ts=TS + step,
                    reward=None if rng.random() < 0.1 else rng.random(), kl=rng.random() / 10,
                    n_samples=None if rng.random() < 0.05 else rng.randrange(1, 64),
                    tokens=rng.randrange(1000), latency_ms=rng.uniform(10, 100),
                    metrics={f"k{j}": rng.uniform(-1, 1) for j in range(rng.randrange(3))}))
    rng.shuffle(events)
    put_with_retries(client, events, size=97, retried=5)
    assert int(client.command(f"SELECT sum(rows) FROM areal.{AGGREGATES}")) == len(events)  # dropped in both tables
    assert_view_is_the_raw_rule(client)

    put(client, rng.sample(events, 40))  # a client re-sending events it was unsure of: new positions, new block
    again = [e for e in events if e.run_id == "a" and e.step == 4]
    put(client, [StepEvent(**{**{f: getattr(e, f) for f in e.__struct_fields__ if f != "event_id"},
                              "reward": 0.99}) for e in again[:1]])  # a rank logs step 4 again: the later one wins
    resumed = [StepEvent(run_id="b", step=s, epoch=0, rank=r, attempt=1, reward=0.5 + r / 10, n_samples=r + 1,
                         ts=TS + 100 + s) for s in (10, 11) for r in range(2)]
    put(client, resumed)  # attempt 1 replaces attempt 0's steps 10 and 11
    assert int(client.command(f"SELECT sum(rows) FROM areal.{AGGREGATES}")) > len(events)  # the sums did see them
    assert_view_is_the_raw_rule(client)
    got = client.query("SELECT attempt, step, reward FROM areal.v_step_means WHERE run_id = 'b' AND step IN (10, 11) "
                       "ORDER BY step").result_rows
    assert got == [(1, 10, pytest.approx((0.5 * 1 + 0.6 * 2) / 3)), (1, 11, pytest.approx((0.5 * 1 + 0.6 * 2) / 3))]


def test_an_older_store_is_backfilled_by_the_migration(client: Any) -> None:
    events = [StepEvent(run_id="old", step=s, epoch=0, rank=r, reward=r / 4, n_samples=r + 1, ts=TS + s)
              for s in range(20) for r in range(4)]
    for stmt in drop_statements(SchemaOptions()):  # a store of schema 8: no aggregates
        client.command(stmt)
    client.command(f"ALTER TABLE areal.{MIGRATIONS_TABLE} DELETE WHERE version >= 9 SETTINGS mutations_sync = 1")
    put(client, events[:50])
    assert apply_schema(client) == SCHEMA_VERSION
    put(client, events[50:])
    assert int(client.command("SELECT count() FROM areal.v_step_means")) == 20
    assert_view_is_the_raw_rule(client)


def delivered_twice(client: Any) -> set[tuple[str, int, int]]:
    """The (run_id, attempt, step) the views take from the raw rows: some rank's row reached the sums twice."""
    return set(client.query(delivered_twice_sql("areal", of_runs=False)).result_rows)


_examples = iter(range(10**9))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ranks=st.lists(st.integers(0, 200), min_size=1, max_size=40), cuts=st.lists(st.integers(1, 40), max_size=4),
       merge=st.booleans())
def test_the_summed_rank_words_find_exactly_the_steps_a_rank_reached_twice(
        client: Any, ranks: list[int], cuts: list[int], merge: bool) -> None:
    """A step's rank reports in any order and any blocks (a rank repeated in its own block or in another,
    ranks around a word's edge at 63/64 and its top bit): the check flags the step exactly when some rank
    came twice, and the view's means and rank count are the raw rows' whatever it flags."""
    run = f"r{next(_examples)}"
    events = [StepEvent(run_id=run, step=1, epoch=0, rank=r, world_size=201, ts=TS + i, reward=r / 7, n_samples=r % 5 + 1)
              for i, r in enumerate(ranks)]
    bounds = sorted({0, *(c for c in cuts if c < len(events)), len(events)})
    for lo, hi in zip(bounds, bounds[1:]):
        put(client, events[lo:hi])
    if merge:
        client.command(f"OPTIMIZE TABLE areal.{AGGREGATES} FINAL")
    twice = len(set(ranks)) != len(ranks)
    assert ((run, 0, 1) in delivered_twice(client)) == twice
    got = client.query(f"SELECT ranks, reward FROM areal.v_step_means_of(runs = ['{run}'])").result_rows
    distinct = sorted(set(ranks))
    assert got == [(len(distinct), pytest.approx(sum(r / 7 * (r % 5 + 1) for r in distinct)
                                                 / sum(r % 5 + 1 for r in distinct), rel=1e-12))]


def test_a_store_made_before_the_rank_words_gets_them_for_the_rows_it_holds(client: Any) -> None:
    """Migration 13 adds `rank_words` and writes it into the parts already stored (a part without it
    would compute it from `rank_bits` at every read: the cost it removes); steps are taken from the
    sums again, and the check still finds the steps delivered twice before and after it."""
    events = [StepEvent(run_id="old", step=s, epoch=0, rank=r, world_size=70, reward=r / 4, ts=TS + s)
              for s in range(20) for r in range(70)]
    client.command(f"ALTER TABLE areal.{AGGREGATES} DROP COLUMN {RANK_WORDS}")  # a store of schema 12
    client.command(f"ALTER TABLE areal.{MIGRATIONS_TABLE} DELETE WHERE version >= 13 SETTINGS mutations_sync = 1")
    put(client, events[:700])
    put(client, events[:70])  # step 0 delivered twice, before the migration
    assert apply_schema(client) == SCHEMA_VERSION
    parts = client.query(f"SELECT name, has(groupArray(column), '{RANK_WORDS}') FROM system.parts_columns "
                         f"WHERE database = 'areal' AND table = '{AGGREGATES}' AND active GROUP BY name").result_rows
    assert parts and all(stored for _, stored in parts), parts
    put(client, events[700:])
    put(client, events[1330:])  # step 19 delivered twice, after it
    assert delivered_twice(client) == {("old", 0, 0), ("old", 0, 19)}
    assert_view_is_the_raw_rule(client)


def test_a_step_delivered_twice_costs_its_own_raw_rows_not_the_runs(client: Any) -> None:
    """The check for steps delivered twice is an IN (subquery) on the raw table's key, so one run's
    query reads the raw rows of the repeated step's granules, never all of the run's raw rows.
    (An INNER JOIN on that check, tried for migration 11, let the run filter reach the aggregates
    but read every raw row of the run once any step of it was delivered twice: at 1,000 ranks a
    thousand times the aggregates.)"""
    ranks, steps = 16, 4000
    for run in ("a", "b", "c"):
        for s0 in range(0, steps, 500):
            put(client, [StepEvent(run_id=run, step=s, epoch=0, rank=r, world_size=ranks, reward=s + r / 4,
                                   ts=TS + s) for s in range(s0, s0 + 500) for r in range(ranks)])
    put(client, [StepEvent(run_id="a", step=5, epoch=0, rank=r, world_size=ranks, reward=5 + r / 4, ts=TS + 5)
                 for r in range(ranks)])  # step 5 of run a delivered twice, in another block
    query = "SELECT step, reward FROM areal.v_step_means WHERE run_id = 'a' ORDER BY step"
    expected = client.query(query).result_rows
    assert len(expected) == steps and expected[5] == (5, pytest.approx(5 + (ranks - 1) / 8))
    raw_rows_of_the_run = ranks * steps
    bounded = client.query(query + f" SETTINGS max_rows_to_read = {raw_rows_of_the_run - 1}").result_rows
    assert bounded == expected
    # v_step_means_of (what the dashboards read) narrows the check to the run too: it reads the
    # run's aggregates, not the three runs' (v_step_means reads every run's for its check)
    of_run = "SELECT step, reward FROM areal.v_step_means_of(runs = ['a']) ORDER BY step"
    assert client.query(of_run).result_rows == expected
    # every read of the aggregates (the steps' rows, their latest attempts, the two passes of the check) reads
    # run a's alone: measured 26,212 rows in all, with the repeated step's raw granule (8,208), where
    # v_step_means reads 42,212
    run_rows = int(client.command(f"SELECT count() FROM areal.{AGGREGATES} WHERE run_id = 'a'"))
    limit = 6 * run_rows + 8192
    assert int(client.command(f"SELECT count() FROM areal.{AGGREGATES}")) > 2.9 * run_rows
    with pytest.raises(Exception, match="TOO_MANY_ROWS|max_rows_to_read|Limit for rows"):
        client.query(query + f" SETTINGS max_rows_to_read = {limit}")
    assert client.query(of_run + f" SETTINGS max_rows_to_read = {limit}").result_rows == expected


# ------------------------------------------------------------------ the dashboards read the aggregates


RAW_STEPS = re.compile(r"\bFROM\s+\S*\b(v_steps|steps)\b(\s+FINAL)?", re.IGNORECASE)


def raw_step_reads(sql: str) -> list[str]:
    """The SELECTs of `sql` (a panel's query) that read raw step rows and aggregate them: an aggregate
    function or GROUP BY over raw steps, over ranks or per rank (a per-rank line or table reads the
    per-rank aggregates, v_rank_buckets: the raw rows per rank grow with every step in the range too)."""
    found = []
    for match in RAW_STEPS.finditer(sql):
        # the SELECT this FROM belongs to: back to its SELECT, on to the end of its level (or its UNION)
        start = sql.rfind("SELECT", 0, match.start())
        depth, end = 0, len(sql)
        for i in range(match.end(), len(sql)):
            depth += {"(": 1, ")": -1}.get(sql[i], 0)
            if depth < 0 or (depth == 0 and sql.startswith("UNION", i)):
                end = i
                break
        select = sql[start:end]
        group = re.search(r"GROUP BY (.*?)(ORDER BY|LIMIT|$)", select, re.S)
        aggregates = group is not None or re.search(r"\b(avg|sum|max|min|quantile\w*|median|count)\(", select)
        if aggregates:
            found.append(select)
    return found


def test_the_scan_finds_a_panel_that_averages_raw_rank_rows() -> None:
    """The check itself: the queries the dashboards had before v_step_means, and the per-rank ones they
    had before v_rank_buckets (migration 11), are caught."""
    before = ("SELECT $__timeInterval(ts) AS time, run_id, avg(entropy) AS entropy\nFROM areal.v_steps\n"
              "WHERE $__timeFilter(ts)\nGROUP BY time, run_id\nORDER BY time")
    assert raw_step_reads(before)
    assert raw_step_reads("SELECT step, run_id, avg(reward) AS reward FROM areal.steps FINAL GROUP BY step, run_id")
    per_rank = ("SELECT $__timeInterval(ts) AS time, run_id, node, rank, avg(throughput) AS t FROM areal.v_steps "
                "GROUP BY time, run_id, node, rank")
    assert raw_step_reads(per_rank)
    table = ("SELECT run_id, node, rank, count() AS steps, quantile(0.95)(latency_ms) AS p95 FROM areal.v_steps "
             "WHERE $__timeFilter(ts) GROUP BY run_id, node, rank ORDER BY run_id, node, rank")
    assert raw_step_reads(table)
    assert not raw_step_reads("SELECT DISTINCT node FROM areal.steps WHERE run_id IN ('a')")  # the node picker
    assert not raw_step_reads(per_rank.replace("avg(throughput)", "sum(throughput_sum) / sum(throughput_n)")
                              .replace("v_steps", "v_rank_buckets"))
    assert not raw_step_reads("SELECT avg(step) AS step, avg(reward) FROM areal.v_step_means GROUP BY run_id")


def test_no_dashboard_query_aggregates_raw_rank_rows() -> None:
    """Panels, variables and annotations: none aggregates raw step rows, over ranks or per rank."""
    offenders = []
    for name in BUILDERS:
        for q in dashboard_queries(build(name)):
            if raw_step_reads(q.sql):
                offenders.append(f"{name}: {q.where}")
    assert not offenders, offenders


def test_raw_step_rows_are_read_only_behind_the_range_gate() -> None:
    """A panel may read raw step rows only where its range holds few (the efficiency board's per-rank
    panels, behind `$rank_raw_rows`); else only the node picker reads them, without aggregating."""
    from areal_metrics.grafana.efficiency import RAW_GATE

    ungated = []
    for name in BUILDERS:
        for q in dashboard_queries(build(name)):
            for match in RAW_STEPS.finditer(q.sql):
                start = q.sql.rfind("SELECT", 0, match.start())
                end = q.sql.find("UNION ALL", match.end())
                if RAW_GATE not in q.sql[start:end if end >= 0 else len(q.sql)] and q.kind != "variable":
                    ungated.append(f"{name}: {q.where}")
    assert not ungated, ungated
    readers = {(name, q.where) for name in BUILDERS for q in dashboard_queries(build(name)) if RAW_STEPS.search(q.sql)}
    assert ("efficiency", "panel 'Nodes and ranks' target A") in readers  # the check sees the gated reads


def test_a_rank_weight_is_a_uint32_so_a_steps_summed_weights_cannot_wrap(client: Any) -> None:
    """The store sums a step's `n_samples` over its ranks in UInt64 (`n_samples`, each column's `__w`);
    a weight beyond a UInt32 is refused naming the field (2^63 on two ranks wrapped the sum to 0 and the
    view fell back to the plain mean while the worker weighed), and the client keeps such a value in
    `metrics` under its own name. At the bound, 1,024 ranks' weights sum past 2^32 and the view is the
    worker's mean."""
    from areal_metrics.producers.client.coerce import split_step
    from areal_metrics.producers.contract.events import UINT32_MAX, parse_event
    from areal_metrics.producers.contract.field_rules import ValidationError

    over = StepEvent(run_id="r", step=1, epoch=0, reward=0.5, ts=TS).to_json().replace(b'"step":1', b'"step":1,"n_samples":4294967296')
    with pytest.raises(ValidationError, match=r"steps\.n_samples"):
        parse_event(over, StepEvent)
    assert split_step({"reward": 0.5, "n_samples": 2**33}).metrics == {"n_samples": 2.0**33}
    ranks = [StepEvent(run_id="r", step=1, epoch=0, rank=r, world_size=1024, reward=(r % 10) / 10,
                       n_samples=UINT32_MAX - (r % 2), ts=TS) for r in range(1024)]
    put(client, ranks)
    assert client.query("SELECT n_samples FROM areal.v_step_means").result_rows == [(1024 * UINT32_MAX - 512,)]
    assert_view_is_the_raw_rule(client, ("reward",))
