"""The per-rank aggregates kept at insert time (sinks/rank_aggregates.py, migration 11) are exactly the
deduplicated raw rows' sums, per run, node, rank and 64 steps, whatever arrived twice: a sink's retried
batch, a client re-sending events, a rank logging a step again, a resume inside a bucket, a rank on a
new node after a resume. The efficiency board's 'Nodes and ranks' table (read from them) equals the raw
rows' rule computed here in Python."""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

import numpy as np
import pytest

from areal_metrics.grafana import efficiency
from areal_metrics.producers.contract.events import StepEvent
from areal_metrics.sinks.migrations import apply_schema
from areal_metrics.sinks.rank_aggregates import (
    BUCKET_STEPS,
    COARSE_BUCKETS,
    RANK_AGGREGATES,
    RANK_AGGREGATES_COARSE,
    coarse_create_statements,
    drop_statements,
)
from areal_metrics.sinks.schema import MIGRATIONS_TABLE, SCHEMA_VERSION, SchemaOptions
from tests.test_step_means import TS, client, put, put_with_retries  # noqa: F401  (the fixture)

Key = tuple[str, str, int, int]  # run_id, node, rank, bucket


def raw_buckets(c: Any) -> dict[Key, dict[str, Any]]:
    """The rule over the deduplicated raw rows (`v_steps`), in Python."""
    rows = c.query("SELECT run_id, node, rank, step, ts, toFloat64(throughput), toFloat64(latency_ms), "
                   "toFloat64(tokens), ifNull(toFloat64(gpu_mem_bytes), metrics['mem_bytes']) FROM areal.v_steps"
                   ).result_rows
    out: dict[Key, dict[str, Any]] = defaultdict(lambda: {"steps": 0, "ts": None, "memory": None, "latency": [],
                                                         "throughput": [], "tokens": []})
    for run, node, rank, step, ts, throughput, latency, tokens, memory in rows:
        b = out[(run, node, rank, step // BUCKET_STEPS)]
        b["steps"] += 1
        b["ts"] = ts if b["ts"] is None else max(b["ts"], ts)
        b["memory"] = memory if b["memory"] is None else max(b["memory"], memory)
        for name, value in (("latency", latency), ("throughput", throughput), ("tokens", tokens)):
            if value is not None:
                b[name].append(value)
    return out


def view_buckets(c: Any) -> dict[Key, tuple[Any, ...]]:
    rows = c.query("SELECT run_id, node, rank, bucket, steps, ts, memory, latency_max, latency_ms_n, latency_ms_sum, throughput_n, "
                   "throughput_sum, tokens_n, tokens_sum FROM areal.v_rank_buckets").result_rows
    assert len(rows) == len({tuple(r[:4]) for r in rows})  # one row per run, node, rank and bucket
    runs = [r for (r,) in c.query("SELECT DISTINCT run_id FROM areal.steps").result_rows]
    of_runs = c.query("SELECT run_id, node, rank, bucket, steps, ts, memory, latency_max, latency_ms_n, "
                      "latency_ms_sum, throughput_n, throughput_sum, tokens_n, tokens_sum FROM "
                      f"areal.v_rank_buckets_of(runs = {runs!r})").result_rows
    assert sorted(of_runs) == sorted(rows)  # the same rows, given every run
    return {tuple(r[:4]): tuple(r[4:]) for r in rows}  # type: ignore[misc]


COARSE_COLUMNS = ("run_id, node, rank, bucket, steps, ts, memory, latency_max, latency_ms_n, latency_ms_sum, "
                  "throughput_n, throughput_sum, tokens_n, tokens_sum")


def coarse_rows(c: Any) -> list[tuple[Any, ...]]:
    runs = [r for (r,) in c.query("SELECT DISTINCT run_id FROM areal.steps").result_rows]
    return c.query(f"SELECT {COARSE_COLUMNS} FROM areal.v_rank_buckets_coarse_of(runs = {runs!r})").result_rows


def assert_coarse_is_the_raw_rule(c: Any) -> None:
    """v_rank_buckets_coarse_of: per rank, its rows hold exactly the raw rows' steps, sums and maxima
    (some coarse buckets as one row, the others as their 64-step rows)."""
    totals: dict[tuple[str, str, int], dict[str, Any]] = defaultdict(
        lambda: {"steps": 0, "ts": [], "memory": [], "latency": [], "throughput": [], "tokens": []})
    for (run, node, rank, _), b in raw_buckets(c).items():
        t = totals[(run, node, rank)]
        t["steps"] += b["steps"]
        t["ts"].append(b["ts"])
        t["memory"].append(b["memory"])
        for name in ("latency", "throughput", "tokens"):
            t[name] += b[name]
    got: dict[tuple[str, str, int], list[tuple[Any, ...]]] = defaultdict(list)
    for row in coarse_rows(c):
        got[tuple(row[:3])].append(row[3:])  # type: ignore[index]
    assert set(got) == set(totals)
    for key, t in totals.items():
        rows = got[key]
        assert sum(r[1] for r in rows) == t["steps"], key
        assert max(r[2] for r in rows) == max(t["ts"]) and max(r[3] for r in rows) == max(t["memory"]), key
        assert max(r[4] for r in rows) == max(t["latency"]), key
        for i, name in ((5, "latency"), (7, "throughput"), (9, "tokens")):
            assert sum(r[i] for r in rows) == len(t[name]), (key, name)
            assert sum(r[i + 1] for r in rows) == pytest.approx(sum(t[name]), rel=1e-12), (key, name)


def assert_view_is_the_raw_rule(c: Any) -> None:
    assert_coarse_is_the_raw_rule(c)
    want, got = raw_buckets(c), view_buckets(c)
    assert set(got) == set(want)
    for key, b in want.items():
        steps, ts, memory, lat_max, lat_n, lat_sum, thr_n, thr_sum, tok_n, tok_sum = got[key]
        assert (steps, ts, memory, lat_max) == (b["steps"], b["ts"], b["memory"], max(b["latency"])), key
        for n, s, name in ((lat_n, lat_sum, "latency"), (thr_n, thr_sum, "throughput"), (tok_n, tok_sum, "tokens")):
            assert n == len(b[name]) and s == pytest.approx(sum(b[name]), rel=1e-12), (key, name)


def sqlstring(value: object) -> str:
    """A text box's value as Grafana's `${name:sqlstring}` writes it."""
    return "'" + str(value).replace("'", "''") + "'"


RAW, BUCKETS, COARSE = 10**12, 0, -1  # the raw rows, the 64-step aggregates, the coarse ones, whatever the range


def everything(sql: str, level: int, ranks: int | str = 1_000_000) -> str:
    """A per-rank query of the efficiency board over every run and node and all time, its bounds set to
    read `level` (RAW, BUCKETS or COARSE)."""
    raw_rows, coarse_rows = (0, 0) if level == COARSE else (level, 10**12)
    return (sql.replace("$__timeFilter(ts)", "1").replace("$__timeInterval(ts)", "toStartOfSecond(ts)").replace("run_id IN (${run:singlequote})", "1")
            .replace("$__conditionalAll(node IN (${node:singlequote}), $node)", "1")
            .replace("${rank_raw_rows:sqlstring}", sqlstring(raw_rows)).replace("${ranks:sqlstring}", sqlstring(ranks))
            .replace("${rank_coarse_rows:sqlstring}", sqlstring(coarse_rows))
            .replace("${run:singlequote}", "'a', 'b', 'c', 'old'"))  # every run of these tests


def nodes_and_ranks(c: Any, raw_rows: int) -> dict[tuple[str, str, int], tuple[Any, ...]]:
    """The efficiency board's 'Nodes and ranks' query, over every run and node and all time."""
    sql = everything(efficiency.WORKERS.build().raw_sql, raw_rows)
    return {tuple(r[:3]): tuple(r[3:]) for r in c.query(sql).result_rows}  # type: ignore[misc]


def assert_table_is_the_raw_rule(c: Any) -> None:
    """Both ways: from the raw rows (a short range) and from the aggregates (a long one)."""
    per_rank: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for (run, node, rank, _), b in raw_buckets(c).items():
        per_rank[(run, node, rank)].append(b)
    for raw_rows in (RAW, BUCKETS, COARSE):
        got = nodes_and_ranks(c, raw_rows)
        assert set(got) == set(per_rank)
        for key, buckets in per_rank.items():
            steps, throughput, latency, p95, slowest, memory, last = got[key]
            latencies = [x for b in buckets for x in b["latency"]]
            throughputs = [x for b in buckets for x in b["throughput"]]
            assert steps == sum(b["steps"] for b in buckets), key
            assert throughput == pytest.approx(sum(throughputs) / len(throughputs), rel=1e-12), key
            assert latency == pytest.approx(float(np.mean(latencies)), rel=1e-12) and slowest == max(latencies), key
            assert memory == max(b["memory"] for b in buckets) and last == max(b["ts"] for b in buckets), key
            # the p95 needs every step's latency: from the raw rows only
            assert p95 == (pytest.approx(float(np.percentile(latencies, 95)), rel=1e-12) if raw_rows == RAW else None)


def step(run: str, s: int, rank: int, rng: random.Random, **kw: Any) -> StepEvent:
    fields: dict[str, Any] = {"run_id": run, "node": f"n{rank // 4}", "step": s, "epoch": 0, "rank": rank,
                              "world_size": 8, "ts": TS + s, "latency_ms": rng.uniform(10, 100),
                              "throughput": None if rng.random() < 0.1 else rng.uniform(100, 1000),
                              "tokens": rng.randrange(1000), "gpu_mem_bytes": rng.randrange(1 << 30)}
    return StepEvent(**{**fields, **kw})


def test_every_way_a_row_arrives_twice_counts_once(client: Any) -> None:  # noqa: F811
    rng = random.Random(7)
    events = [step(run, s, r, rng) for run in ("a", "b") for s in range(150) for r in range(8)]
    rng.shuffle(events)
    put_with_retries(client, events, size=211, retried=3)
    assert int(client.command(f"SELECT sum(rows) FROM areal.{RANK_AGGREGATES}")) == len(events)  # dropped here too
    assert_view_is_the_raw_rule(client)
    assert_table_is_the_raw_rule(client)

    put(client, rng.sample(events, 30))  # a client re-sending events it was unsure of: new positions, new block
    again = next(e for e in events if e.run_id == "a" and e.step == 70 and e.rank == 3)
    put(client, [StepEvent(**{**{f: getattr(again, f) for f in again.__struct_fields__ if f != "event_id"},
                              "latency_ms": 5000.0})])  # rank 3 logs step 70 again: the later one wins
    # run b resumed at step 100 (inside the bucket of steps 64-127) by attempt 1, rank 7 now on node n9;
    # attempt 1 stops at step 140, so attempt 0's steps 141-149 stay
    resumed = [step("b", s, r, rng, attempt=1, ts=TS + 1000 + s, node="n9" if r == 7 else f"n{r // 4}")
               for s in range(100, 141) for r in range(8)]
    put(client, resumed)
    # run c: rank 0 resumed on node n5 at step 10 with no step again (attempt 0 stopped at 9)
    put(client, [step("c", s, 0, rng, attempt=int(s >= 10), node="n5" if s >= 10 else "n0") for s in range(20)])
    assert int(client.command(f"SELECT sum(rows) FROM areal.{RANK_AGGREGATES}")) > len(events)  # the sums saw them
    assert_view_is_the_raw_rule(client)
    assert_table_is_the_raw_rule(client)
    latency = client.query("SELECT latency_ms_sum FROM areal.v_rank_buckets WHERE run_id = 'a' AND rank = 3 "
                           "AND bucket = 1").result_rows
    raw = client.query("SELECT sum(latency_ms) FROM areal.v_steps WHERE run_id = 'a' AND rank = 3 "
                       "AND intDiv(step, 64) = 1").result_rows
    assert latency == [(pytest.approx(raw[0][0]),)] and raw[0][0] > 5000
    nodes = client.query("SELECT node, sum(steps) FROM areal.v_rank_buckets WHERE run_id = 'b' AND rank = 7 "
                         "GROUP BY node ORDER BY node").result_rows
    assert nodes == [("n1", 150 - 41), ("n9", 41)]
    assert client.query("SELECT node, steps FROM areal.v_rank_buckets WHERE run_id = 'c' ORDER BY node").result_rows == [
        ("n0", 10), ("n5", 10)]


def test_an_older_store_is_backfilled_by_migration_11(client: Any) -> None:  # noqa: F811
    rng = random.Random(3)
    events = [step("old", s, r, rng) for s in range(100) for r in range(4)]
    for stmt in drop_statements(SchemaOptions()):  # a store of schema 10: no per-rank aggregates
        client.command(stmt)
    client.command("DROP VIEW areal.v_rank_buckets")
    client.command("DROP VIEW areal.v_rank_buckets_of")
    client.command(f"ALTER TABLE areal.{MIGRATIONS_TABLE} DELETE WHERE version >= 11 SETTINGS mutations_sync = 1")
    put(client, events[:250])
    assert apply_schema(client) == SCHEMA_VERSION == 15  # 11, and 12 to 15 on top
    put(client, events[250:])
    assert int(client.command("SELECT sum(steps) FROM areal.v_rank_buckets")) == 400
    assert_view_is_the_raw_rule(client)
    assert_table_is_the_raw_rule(client)


def test_the_coarse_level_is_a_row_per_512_steps_and_a_bucket_delivered_twice_its_64_step_rows(client: Any) -> None:  # noqa: F811
    rng = random.Random(13)
    steps = 3 * BUCKET_STEPS * COARSE_BUCKETS + 100  # three whole coarse buckets and part of a fourth
    put_with_retries(client, [step("a", s, r, rng) for s in range(steps) for r in range(4)], size=997, retried=2)
    span = BUCKET_STEPS * COARSE_BUCKETS

    def by_bucket() -> dict[tuple[int, int], list[tuple[Any, ...]]]:
        out: dict[tuple[int, int], list[tuple[Any, ...]]] = defaultdict(list)
        for row in coarse_rows(client):
            out[(row[2], row[3] // COARSE_BUCKETS)].append(row)
        return out

    rows = by_bucket()
    assert {k: len(v) for k, v in rows.items()} == {(r, b): 1 for r in range(4) for b in range(4)}
    assert all(v[0][4] == min(span, steps - b * span) for (_, b), v in rows.items())  # a row covers its steps
    assert_coarse_is_the_raw_rule(client)
    put(client, [step("a", span + 7, 2, rng)])  # rank 2's step 519 again, in another block
    rows = by_bucket()
    assert len(rows[(2, 1)]) == COARSE_BUCKETS  # that coarse bucket as its eight 64-step rows
    assert all(len(v) == 1 for k, v in rows.items() if k != (2, 1))
    assert_coarse_is_the_raw_rule(client)


def test_an_older_store_gets_the_coarse_level_from_its_fine_rows(client: Any) -> None:  # noqa: F811
    rng = random.Random(17)
    events = [step("old", s, r, rng) for s in range(1200) for r in range(4)]
    for stmt in drop_statements(SchemaOptions())[:2]:  # a store of schema 13: no coarse level
        client.command(stmt)
    client.command("DROP VIEW areal.v_rank_buckets_coarse_of")
    client.command(f"ALTER TABLE areal.{MIGRATIONS_TABLE} DELETE WHERE version >= 14 SETTINGS mutations_sync = 1")
    put(client, events[:2500])
    assert apply_schema(client) == SCHEMA_VERSION
    put(client, events[2500:])
    assert int(client.command(f"SELECT sum(rows) FROM areal.{RANK_AGGREGATES_COARSE}")) == len(events)
    assert len(coarse_rows(client)) == 4 * 3  # every coarse bucket exact: one row each
    assert_coarse_is_the_raw_rule(client)
    assert len(coarse_create_statements(SchemaOptions())) == 3


def rows_read(c: Any, sql: str) -> int:
    """The rows the engine read running `sql`: the growth of its SelectedRows counter (every table,
    scalar subqueries and IN sets included), less what reading the counter adds; the second of two runs
    (a first run of a query read a row more, now and then)."""
    def counter() -> int:
        return int(c.command("SELECT value FROM system.events WHERE event = 'SelectedRows'"))
    c.query(sql)
    probe = -counter() + counter()
    before = counter()
    c.query(sql)
    return counter() - before - probe


def latency_series(c: Any, raw_rows: int, ranks: int = 1_000_000) -> dict[str, list[tuple[Any, float]]]:
    """'Step latency per node and rank', a point per second (a step each), every run, all time."""
    sql = everything(efficiency._per_worker("latency_ms", "step latency").build().raw_sql, raw_rows, ranks)
    out: dict[str, list[tuple[Any, float]]] = defaultdict(list)
    for time, worker, value in c.query(sql).result_rows:
        out[worker].append((time, value))
    return out


def test_a_short_range_reads_a_point_per_step_a_long_one_the_buckets_and_never_both(client: Any) -> None:  # noqa: F811
    rng = random.Random(5)
    put(client, [step("a", s, r, rng) for s in range(200) for r in range(8)])
    raw = latency_series(client, RAW)
    assert {len(points) for points in raw.values()} == {200}  # a step a second: a point per step
    steps = client.query("SELECT rank, toStartOfSecond(ts), latency_ms FROM areal.v_steps").result_rows
    by_worker = {(f"a · n{rank // 4} · rank {rank}", t): v for rank, t, v in steps}
    assert all(v == pytest.approx(by_worker[(w, t)]) for w, points in raw.items() for t, v in points)
    buckets = latency_series(client, BUCKETS)
    assert {len(points) for points in buckets.values()} == {4}  # steps 0-63, 64-127, 128-191, 192-199
    coarse = latency_series(client, COARSE)
    assert {len(points) for points in coarse.values()} == {1}  # steps 0-199: one coarse bucket
    # the raw rows are read only when the gate takes them; each gated query reads what its branch alone
    # reads. A view not taken is given no run, so its checks for rows delivered twice (IN sets, which
    # ClickHouse builds whatever the WHERE) read nothing: with every branch off, the gate's scalar (a row
    # per step of step_aggregates) is all that is read.
    per_step = int(client.command("SELECT count() FROM areal.step_aggregates"))
    branches = {RAW: "FROM areal.v_steps\n", BUCKETS: "FROM areal.v_rank_buckets_of(", COARSE: "FROM areal.v_rank_buckets_coarse_of("}

    def off(sql: str, *levels: int) -> str:
        for level in levels:
            at = sql.index(branches[level])
            where = sql.index("\n    WHERE ", at) + len("\n    WHERE ")
            sql = sql[:where] + "0 AND " + sql[where:]
        return sql

    for sql in (efficiency.WORKERS.build().raw_sql, efficiency._per_worker(None, "memory").build().raw_sql):
        for level in branches:
            gated = everything(sql, level)
            alone = off(gated, *(other for other in branches if other != level))
            assert alone != gated and rows_read(client, gated) == rows_read(client, alone)
        none = off(everything(sql, RAW), *branches)
        assert client.query(none).result_rows == [] and rows_read(client, none) == per_step
        coarse_read, fine_read = (rows_read(client, everything(sql, level)) for level in (COARSE, BUCKETS))
        assert coarse_read < fine_read < 1600 < rows_read(client, everything(sql, RAW))


def test_a_per_rank_panel_returns_at_most_ranks_series_the_farthest_from_the_run_mean_first(client: Any) -> None:  # noqa: F811
    # run a: 12 ranks, rank r's latency 1000 + r² (-1)^r: distinct distances from the run's mean;
    # run b: 3 ranks, distances 0, 30, 30 from its mean 110 (a tie: broken by node, then rank)
    latency = {("a", r): 1000.0 + r * r * (-1) ** r for r in range(12)} | {("b", 0): 110.0, ("b", 1): 80.0,
                                                                             ("b", 2): 140.0}
    put(client, [step(run, s, r, random.Random(s), latency_ms=v, world_size=12)
                 for (run, r), v in latency.items() for s in range(10)])
    run_mean = {run: float(np.mean([v for (x, _), v in latency.items() if x == run])) for run in ("a", "b")}
    distance = {k: abs(v - run_mean[k[0]]) for k, v in latency.items()}
    assert len(set(distance.values())) == 14  # the one tie is run b's
    order = sorted(distance, key=lambda k: (-distance[k], k[0], f"n{k[1] // 4}", k[1]))
    for raw_rows in (RAW, BUCKETS, COARSE):
        for n in (1, 4, 30):
            got = latency_series(client, raw_rows, ranks=n)
            assert len(got) == min(n, 15)
            assert set(got) == {f"{run} · n{r // 4} · rank {r}" for run, r in order[:n]}
            assert all(v == pytest.approx(latency[(w.split(" · ")[0], int(w.rsplit(" ", 1)[1]))])
                       for w, points in got.items() for _, v in points)
        table = list(nodes_and_ranks(client, raw_rows))  # in the query's order: the slowest first
        sql = everything(efficiency.WORKERS.build().raw_sql, raw_rows, ranks=3)
        assert [tuple(r[:3]) for r in client.query(sql).result_rows] == table[:3] == [
            ("a", "n2", 10), ("a", "n2", 8), ("a", "n1", 6)]


def test_a_ranks_value_that_is_no_number_is_the_default(client: Any) -> None:  # noqa: F811
    put(client, [step("a", s, r, random.Random(s), world_size=32) for s in range(3) for r in range(32)])
    for typed in ("", "twenty", "-1", "20'; SELECT 1 --", "'"):  # a quote too: sqlstring, never broken SQL
        sql = everything(efficiency.WORKERS.build().raw_sql, RAW, ranks=typed)
        assert len(client.query(sql).result_rows) == efficiency.RANKS_DEFAULT == 20


def call_replaced(sql: str, call: str, by: str) -> str:
    """`sql` with the call that begins with `call` (up to its closing parenthesis) replaced by `by`."""
    start = sql.index(call)
    depth, end = 0, start + len(call) - 1
    for end in range(start + len(call) - 1, len(sql)):
        depth += {"(": 1, ")": -1}.get(sql[end], 0)
        if depth == 0:
            break
    return sql[:start] + by + sql[end + 1:]


def test_the_buckets_of_one_run_read_that_runs_aggregates_alone(client: Any) -> None:  # noqa: F811
    """v_rank_buckets_of(runs) narrows its check for buckets delivered twice to the runs it is given
    (an IN set over every run's aggregates in v_rank_buckets): a panel on one run of three reads none
    of the other runs' aggregates, with a bucket of the run delivered twice (its raw rows read again)."""
    rng = random.Random(11)
    for run in ("a", "b", "c"):
        put(client, [step(run, s, r, rng) for s in range(1000) for r in range(8)])
    put(client, [step("a", 5, r, rng) for r in range(8)])  # run a's step 5 delivered twice
    one = everything(efficiency.WORKERS.build().raw_sql, BUCKETS).replace("'a', 'b', 'c', 'old'", "'a'")
    assert {r[0] for r in client.query(one).result_rows} == {"a"}
    run_a = int(client.command(f"SELECT count() FROM areal.{RANK_AGGREGATES} WHERE run_id = 'a'"))
    every = int(client.command(f"SELECT count() FROM areal.{RANK_AGGREGATES}"))
    assert every > 2 * run_a  # (run a has a bucket's rows once more)
    one = one.replace("1) AS range_rows", "run_id = 'a') AS range_rows")
    narrowed = rows_read(client, one)
    every_runs_check = rows_read(client, call_replaced(one, "areal.v_rank_buckets_of(", "areal.v_rank_buckets"))
    # v_rank_buckets reads the other runs' aggregates at least once more (measured: twice, 512 rows here)
    assert every_runs_check - narrowed >= every - run_a > 0, (every_runs_check, narrowed)
