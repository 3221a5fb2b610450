"""The quick run's goals (benchmarks/table.py): each one judged on the run's own figures, the
client's numpy step against the same run's `wandb.log`, and shown met or missed in the table."""

from __future__ import annotations

from benchmarks.table import GOALS, ROWS, goals, table


def test_each_goal_is_judged_on_the_runs_own_figures() -> None:
    figures = {"pipeline_to_raw": 0.79, "worker_cpu_us_per_event": 30.0, "wandb_log_us_p50": 400.0,
               "client_log_numpy_torch_us_p50": 20.5, "visible_latency_ms_p99": 251.0}
    verdicts = {g["key"]: g for g in goals(figures)}
    assert verdicts["pipeline_to_raw"]["met"] is False  # at least 0.8
    assert verdicts["worker_cpu_us_per_event"]["met"] is True  # at most 30: the bound itself is met
    assert verdicts["client_log_numpy_torch_us_p50"]["limit"] == 20.0  # a twentieth of this run's wandb.log
    assert verdicts["client_log_numpy_torch_us_p50"]["met"] is False
    assert verdicts["visible_latency_ms_p99"]["met"] is False
    assert verdicts["panel_ms_p95_max"]["met"] is None  # not measured: neither met nor missed
    assert verdicts["client_log_numpy_torch_us_p50"]["goal"] == "<= 1/20 of `wandb_log_us_p50`"
    figures["wandb_log_us_p50"] = 420.0  # a slower machine's wandb.log moves the limit with it
    assert {g["key"]: g for g in goals(figures)}["client_log_numpy_torch_us_p50"]["met"] is True


def test_the_table_shows_every_goal_met_or_missed() -> None:
    assert {g.key for g in GOALS} <= {row[0] for row in ROWS}
    text = table({"pipeline_to_raw": 0.85, "worker_cpu_us_per_event": 37.3})
    assert "| `pipeline_to_raw` | 0.85 |  | >= 0.8: met |" in text
    assert "| `worker_cpu_us_per_event` | 37.30 us |  | <= 30: **missed** |" in text
