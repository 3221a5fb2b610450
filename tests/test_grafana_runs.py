"""The run picker, the run lifecycle, configs side by side and generations, on the recorded run.

The store holds tests/data/demo_events.jsonl (two runs of group `demo` with
their `run` events and eval samples) plus a run of another group and a run
that sent no run events at all (a producer other than the client), loaded
through the sink's code path. Queries are expanded as Grafana would.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest

from areal_metrics.grafana.catalog import build
from areal_metrics.grafana.evaluation import GENERATIONS
from areal_metrics.grafana.macros import expand
from areal_metrics.grafana.queries import QueryRunner, context_for, resolve_variables
from areal_metrics.grafana.runs import CONFIG, LIFECYCLE
from areal_metrics.producers.contract.events import RunEvent, StepEvent
from tests.test_grafana_data import RUNS, fixture_events, fixture_span, loaded_store


def extra_events() -> list:
    """Two more runs, a minute after the recorded ones."""
    later = max(e.ts for e in fixture_events()) + 60
    other = [RunEvent(run_id="other-run", rank=0, node="n:0", status=s, group="sweep", tags=("ppo",), config={"lr": 0.5},
                      ts=later + i) for i, s in enumerate(("running", "failed"))]
    legacy = [StepEvent(run_id="legacy-run", step=i, epoch=0, reward=0.1, ts=later + i) for i in range(3)]
    return other + legacy


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QueryRunner]:
    with loaded_store(tmp_path_factory.mktemp("grafana-runs"), fixture_events() + extra_events()) as store:
        yield QueryRunner.of_store(store)


@pytest.fixture(scope="module")
def ctx_span() -> tuple:
    start, end = fixture_span(fixture_events() + extra_events())
    return start - timedelta(minutes=5), end + timedelta(minutes=5)


def picked(runner: QueryRunner, span: tuple, **choice: tuple[str, ...]) -> tuple[str, ...]:
    ctx = resolve_variables(build("runs"), runner, context_for(*span),
                            lambda v, options: choice.get(v, "$__all" if v in ("group", "tag", "node", "dataset") else tuple(options)))
    return ctx.variables["run"].options


def test_run_picker_filters_by_group_and_tag(runner: QueryRunner, ctx_span: tuple) -> None:
    assert set(picked(runner, ctx_span)) == {*RUNS, "other-run", "legacy-run"}  # All: runs without run events too
    assert set(picked(runner, ctx_span, group=("demo",))) == set(RUNS)
    assert picked(runner, ctx_span, group=("sweep",)) == ("other-run",)
    assert picked(runner, ctx_span, tag=("group-4",)) == ("demo-g4",)
    assert set(picked(runner, ctx_span, tag=("group-4", "ppo"))) == {"demo-g4", "other-run"}
    assert picked(runner, ctx_span)[0] in ("other-run", "legacy-run")  # newest first


def _run(runner: QueryRunner, span: tuple, sql: str, runs: tuple[str, ...]) -> tuple[list[str], list[tuple]]:
    ctx = resolve_variables(build("runs"), runner, context_for(*span),
                            lambda v, o: runs if v == "run" else "$__all")
    columns, _, rows = runner.run(expand(sql, ctx))
    return columns, rows


def test_lifecycle_shows_status_attempts_group_and_tags(runner: QueryRunner, ctx_span: tuple) -> None:
    columns, rows = _run(runner, ctx_span, LIFECYCLE.build().raw_sql, (*RUNS, "other-run"))
    by_run = {r[columns.index("run_id")]: dict(zip(columns, r)) for r in rows}
    assert by_run["demo-g4"]["status"] == "finished" and by_run["demo-g4"]["group"] == "demo"
    assert by_run["demo-g4"]["tags"] == "grpo, group-4" and by_run["demo-g4"]["ranks reported"] == 2
    assert by_run["other-run"]["status"] == "failed" and by_run["other-run"]["attempts"] == 1


def test_configs_side_by_side(runner: QueryRunner, ctx_span: tuple) -> None:
    columns, rows = _run(runner, ctx_span, CONFIG.build().raw_sql, RUNS)
    assert columns == ["key", "run_id", "value"]
    group_size = {run: value for key, run, value in rows if key == "group_size"}
    assert group_size == {"demo-g4": "4", "demo-g2": "2"}  # the one hyperparameter the two runs differ in


def test_generations_panel_shows_each_sample(runner: QueryRunner, ctx_span: tuple) -> None:
    ctx = resolve_variables(build("evaluation"), runner, context_for(*ctx_span),
                            lambda v, o: (RUNS[0],) if v == "run" else "$__all")
    columns, _, rows = runner.run(expand(GENERATIONS.build().raw_sql, ctx))
    assert rows and {r[columns.index("run_id")] for r in rows} == {RUNS[0]}
    sample = dict(zip(columns, rows[0]))
    assert sample["prompt"].endswith("=") and sample["verdict"] in (0, 1)
    assert sample["reward"] == float(sample["verdict"])
