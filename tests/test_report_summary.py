"""`report`'s config table shows W&B's `run.summary` and `init(notes=...)` (issue 44, item 6), read from
`v_runs` of a store the sink's code path loaded. A module of its own: a process holds one embedded store at
a time, and tests/test_report.py keeps its workload store open for the whole module."""

from __future__ import annotations

from pathlib import Path

from areal_metrics.producers.contract.events import RunEvent
from areal_metrics.analysis.report import load_runs
from areal_metrics.analysis.figures import config_table
from tests.test_grafana_data import loaded_store


def test_the_config_table_shows_each_runs_summary_and_notes(tmp_path: Path) -> None:
    """Issue 44, item 6: `run.summary` and `init(notes=...)` from `v_runs` in the report's config table:
    every summary key (a result, shown equal or not), then the notes; a run without them shows `-`."""
    events = [RunEvent(run_id="a", status="running", config={"lr": 1e-5}, notes="smaller lr", ts=1.0),
              RunEvent(run_id="a", status="finished", config={"lr": 1e-5}, notes="smaller lr", ts=2.0,
                       summary={"best_acc": 0.4, "final_loss": 0.125, "per_set": {"math500": 0.5}}),
              RunEvent(run_id="b", status="finished", config={"lr": 1e-4}, ts=2.0, summary={"best_acc": 0.4}),
              RunEvent(run_id="c", status="finished", config={"lr": 1e-4}, ts=2.0)]
    with loaded_store(tmp_path / "store", events) as opened:
        info = load_runs(opened, "1")
    assert info["a"].summary == {"best_acc": 0.4, "final_loss": 0.125, "per_set": {"math500": 0.5}}
    assert info["a"].notes == "smaller lr" and info["c"].summary == {} and info["c"].notes is None
    keys, runs, cells = config_table(info)
    assert runs == ["a", "b", "c"]
    assert dict(zip(keys, cells)) == {"world_size": ["1", "1", "1"], "lr": ["1e-05", "0.0001", "0.0001"],
                                      "summary.best_acc": ["0.4", "0.4", "-"], "summary.final_loss": ["0.125", "-", "-"],
                                      "notes": ["smaller lr", "-", "-"]}
    assert keys[-3:] == ["summary.best_acc", "summary.final_loss", "notes"]
