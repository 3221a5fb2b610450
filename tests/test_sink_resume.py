"""Resume, generations and runs on the embedded engine (no broker): what FINAL reads and the views show.

- a later attempt's step replaces an earlier attempt's step for the same (run, rank, step),
  whatever their log positions; a re-sent event and a step logged twice collapse too;
- eval results likewise, per node; each sample of an eval event is one `generations` row;
- `v_runs` folds run events with the rule `areal_metrics.producers.contract.run_status` states (checked against it);
- a store made by schema version 2 (steps keyed by event_id) is rekeyed in place (and partitioned:
  tests/test_sink_partitions.py has the version 3 -> 4 move).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_metrics.producers.contract.events import EvalEvent, RunEvent, StepEvent
from areal_metrics.producers.contract.run_status import fold
from areal_metrics.sinks.migrations import apply_schema
from areal_metrics.sinks.query import Target, open_client
from areal_metrics.sinks.rows import Located
from areal_metrics.sinks.schema import (
    SCHEMA_VERSION,
    TABLES,
    TABLES_BY_NAME,
    SchemaOptions,
    create_table_sql,
)
from areal_metrics.sinks.writer import insert_rows


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    url = f"chdb://{tmp_path_factory.mktemp('resume') / 'clickhouse'}"
    c = open_client(Target.parse(url), readonly=False, use_database=False)
    apply_schema(c)
    yield c
    c.close()


def put(client: object, events: list, offsets: list[int], token: str, partition: int = 0) -> None:
    topic = {"step": "areal.steps", "eval": "areal.evals", "run": "areal.runs"}[events[0].type]
    insert_rows(client, "areal", [Located(e, topic, partition, o) for e, o in zip(events, offsets)], token)


def test_a_later_attempt_replaces_the_earlier_one_whatever_the_offsets(client) -> None:
    first = [StepEvent(run_id="res", rank=r, step=s, epoch=0, reward=0.1, attempt=0) for s in range(10) for r in (0, 1)]
    put(client, first, list(range(100, 120)), "a0")
    # attempt 1 resumes from step 5; its events sit at lower offsets (another partition count, a replay...)
    again = [StepEvent(run_id="res", rank=r, step=s, epoch=1, reward=0.9, attempt=1) for s in range(5, 10) for r in (0, 1)]
    put(client, again, list(range(10)), "a1")
    rows = client.query("SELECT step, rank, reward, attempt FROM areal.steps FINAL WHERE run_id = 'res' ORDER BY step, rank").result_rows
    assert len(rows) == 20
    assert {(s, r): (rew, a) for s, r, rew, a in rows} == {
        (s, r): ((0.9, 1) if s >= 5 else (0.1, 0)) for s in range(10) for r in (0, 1)}
    assert client.command("SELECT count() FROM areal.v_steps WHERE run_id = 'res'") == 20
    # a redelivery of attempt 0's events afterwards changes nothing
    put(client, first, list(range(200, 220)), "a0-again", partition=1)
    assert float(client.command("SELECT sum(reward) FROM areal.v_steps WHERE run_id = 'res'")) == pytest.approx(10.0)


def test_eval_results_replace_per_node_and_generations_have_one_row_per_sample(client) -> None:
    samples = [{"prompt": f"q{i}", "response": f"a{i}", "verdict": i % 2, "reward": float(i)} for i in range(3)]
    first = [EvalEvent(run_id="gen", node=f"h:{r}", rank=r, eval_id="gen:4:math:full", step=4, dataset="math",
                       accuracy=0.5, verdicts=[1, 0, 1], samples=samples, attempt=0) for r in (0, 1)]
    put(client, first, [10, 11], "g0")
    put(client, first, [10, 11], "g0")  # a retried chunk: dropped from both tables
    assert client.command("SELECT count() FROM areal.generations WHERE run_id = 'gen'") == 6  # raw: no second block
    resumed = [EvalEvent(run_id="gen", node="h:0", rank=0, eval_id="gen:4:math:full", step=4, dataset="math",
                         accuracy=1.0, verdicts=[1, 1, 1], samples=[{**s, "verdict": 1} for s in samples], attempt=1)]
    put(client, resumed, [3], "g1")
    evals = client.query("SELECT node, accuracy, attempt FROM areal.v_evals WHERE run_id = 'gen' ORDER BY node").result_rows
    assert evals == [("h:0", 1.0, 1), ("h:1", 0.5, 0)]
    gens = client.query("SELECT node, sample, prompt, response, verdict, reward FROM areal.v_generations "
                        "WHERE run_id = 'gen' ORDER BY node, sample").result_rows
    assert gens == [("h:0", i, f"q{i}", f"a{i}", 1, float(i)) for i in range(3)] + [
        ("h:1", i, f"q{i}", f"a{i}", i % 2, float(i)) for i in range(3)]
    no_samples = EvalEvent(run_id="gen", eval_id="x", step=5, dataset="math", accuracy=0.5)
    put(client, [no_samples], [20], "g2")
    assert client.command("SELECT count() FROM areal.v_generations WHERE run_id = 'gen'") == 6


def _run_events() -> st.SearchStrategy[list[RunEvent]]:
    one = st.builds(
        lambda run, attempt, rank, status, ts, ws: RunEvent(
            run_id=run, node=f"h:{rank}", rank=rank, status=status, attempt=attempt, world_size=max(ws, rank + 1), ts=ts,
            config={"lr": 0.1}, tags=("t",), group="g"),
        st.sampled_from(["ra", "rb"]), st.integers(0, 2), st.integers(0, 2),
        st.sampled_from(["running", "finished", "failed", "killed"]),
        st.integers(1_700_000_000, 1_700_000_100).map(float), st.integers(1, 3))
    return st.lists(one, min_size=1, max_size=12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_run_events())
def test_v_runs_agrees_with_the_python_rule(client, events: list[RunEvent]) -> None:
    client.command("TRUNCATE TABLE areal.runs")
    random.Random(len(events)).shuffle(events)
    put(client, events, list(range(len(events))), f"runs-{random.random()}")
    rows = client.query("SELECT run_id, status, attempt, attempts, ranks, world_size, toUnixTimestamp64Milli(started), "
                        "toUnixTimestamp64Milli(ended) FROM areal.v_runs").result_rows
    got = {r[0]: (r[1], r[2], r[3], r[4], r[5], r[6] / 1000, None if r[7] is None else r[7] / 1000) for r in rows}
    want = {k: (s.status, s.attempt, s.attempts, s.ranks, s.world_size, s.started, s.ended) for k, s in fold(events).items()}
    assert got == want


def test_v_runs_shows_config_tags_group_and_the_finished_status(client) -> None:
    client.command("TRUNCATE TABLE areal.runs")
    common = dict(run_id="cfg", config={"lr": 0.001, "model": {"layers": 2}}, tags=("grpo", "small"), group="sweep-1",
                  world_size=2, host="h", framework="trl", git_commit="abc1234")
    events = [RunEvent(**common, node=f"h:{r}", rank=r, status=s, ts=1_700_000_000.0 + i)
              for i, (r, s) in enumerate([(0, "running"), (1, "running"), (1, "finished"), (0, "finished")])]
    put(client, events[:3], [0, 1, 2], "cfg-a")
    assert client.query("SELECT status FROM areal.v_runs WHERE run_id = 'cfg'").result_rows == [("running",)]
    put(client, events[3:], [3], "cfg-b")
    row = client.query("SELECT status, config, tags, `group`, framework, git_commit, hosts, ended IS NOT NULL "
                       "FROM areal.v_runs WHERE run_id = 'cfg'").result_rows
    assert row == [("finished", '{"lr":0.001,"model":{"layers":2}}', ["grpo", "small"], "sweep-1", "trl", "abc1234",
                    ["h"], True)]


def test_a_version_2_store_is_rekeyed_in_place(client) -> None:
    """(In another database of the module's store: chdb opens one data directory per process.)"""
    o = SchemaOptions(database="legacy")
    c = client
    c.command("CREATE DATABASE legacy")
    c.command("CREATE TABLE legacy.schema_migrations (version UInt32, description String, applied_at "
              "DateTime64(3, 'UTC') DEFAULT now64(3, 'UTC')) ENGINE = ReplacingMergeTree ORDER BY version")
    c.command("INSERT INTO legacy.schema_migrations (version, description) VALUES (1, 'v1'), (2, 'v2')")
    for name, old_key in (("steps", "run_id, step, event_id"), ("evals", "run_id, dataset, step, event_id")):
        sql = create_table_sql(TABLES_BY_NAME[name], o).replace("ReplacingMergeTree(_version)", "ReplacingMergeTree(_offset)")
        sql = "\n".join(line for line in sql.splitlines() if "`_version`" not in line and "PARTITION BY" not in line)
        key = ", ".join(TABLES_BY_NAME[name].order_by)
        c.command(sql.replace(f"ORDER BY ({key})", f"ORDER BY ({old_key})"))
    for t in TABLES:  # the other tables as version 2 left them (no partitions before version 4)
        if t.name not in ("steps", "evals", "generations"):
            c.command("\n".join(line for line in create_table_sql(t, o).splitlines() if "PARTITION BY" not in line))
    old = [StepEvent(run_id="old", step=s, epoch=0, reward=float(s), event_id=f"e{s}-{i}") for s in range(3) for i in range(2)]
    insert_rows(c, "legacy", [Located(e, "areal.steps", 0, o) for o, e in enumerate(old)], "old")
    assert c.command("SELECT count() FROM legacy.steps FINAL") == 6  # two events per step: v2 kept both
    assert apply_schema(c, o) == SCHEMA_VERSION
    keys = dict(c.query("SELECT name, sorting_key FROM system.tables WHERE database = 'legacy'").result_rows)
    assert keys["steps"] == "run_id, step, rank" and keys["evals"] == "run_id, dataset, step, stage, eval_id, node, rank"
    assert "steps__v3" not in keys and "steps__v4" not in keys and "generations" in keys and "v_runs" in keys
    assert c.command("SELECT count() FROM legacy.steps") == 3  # the copy is one block: collapsed as it lands
    assert c.query("SELECT step, event_id FROM legacy.v_steps ORDER BY step").result_rows == [(s, f"e{s}-1") for s in range(3)]
    assert apply_schema(c, o) == SCHEMA_VERSION  # and again: nothing to do
