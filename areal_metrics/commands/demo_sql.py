"""What `demo` prints at the end: tables from SQL over ClickHouse, and the checks the demo stands for.

Checks (each printed as passed or NOT passed, never hidden):
- a `scale_lr` was caused by evaluation (its reason names the evaluation);
- per dataset, every compared run evaluated the same set (one dataset fingerprint);
- every run's full-stage accuracy on every dataset moved: neither always 0 nor always 1.
"""

from __future__ import annotations

from typing import Any

TRAINING_SQL = """
SELECT s.run_id AS run, uniqExact(s.step) AS steps, max(s.attempt) AS attempt,
       round(avgIf(s.reward, s.step <= 10), 3) AS reward_first_10,
       round(avgIf(s.reward, s.step > max_step - 10), 3) AS reward_last_10,
       round(avgIf(s.response_length, s.step <= 10), 1) AS length_first_10,
       round(avgIf(s.response_length, s.step > max_step - 10), 1) AS length_last_10,
       round(avg(s.throughput), 0) AS gen_tokens_per_s_per_rank
FROM v_steps AS s
INNER JOIN (SELECT run_id, max(step) AS max_step FROM v_steps GROUP BY run_id) AS m USING (run_id)
WHERE s.run_id IN {runs:Array(String)}
GROUP BY s.run_id ORDER BY s.run_id
"""

EVAL_SQL = """
SELECT c.run_id AS run, c.dataset AS dataset, count() AS full_rounds,
       round(argMin(c.accuracy, c.step), 3) AS first, round(argMax(c.accuracy, c.step), 3) AS last,
       round(min(c.accuracy), 3) AS min, round(max(c.accuracy), 3) AS max, countIf(c.stale) AS stale,
       round(min(c.agreement), 3) AS min_agreement, any(s.skipped) AS full_skipped
FROM v_eval_consensus AS c
LEFT JOIN (SELECT run_id, dataset, uniqExact(step) AS skipped FROM v_evals
           WHERE stage = 'full' AND status = 'skipped' GROUP BY run_id, dataset) AS s
       ON s.run_id = c.run_id AND s.dataset = c.dataset
WHERE c.run_id IN {runs:Array(String)} AND c.stage = 'full'
GROUP BY c.run_id, c.dataset ORDER BY c.run_id, c.dataset
"""

LOOP_SQL = """
SELECT run_id AS run, what, kind, n FROM (
    SELECT run_id, 'command' AS what, command AS kind, count() AS n
    FROM v_commands WHERE run_id IN {runs:Array(String)} GROUP BY run_id, command
    UNION ALL
    SELECT run_id, 'alert' AS what, kind, count() AS n
    FROM v_alerts WHERE run_id IN {runs:Array(String)} GROUP BY run_id, kind
)
ORDER BY run, what, kind
"""

SCALE_LR_SQL = """
SELECT run_id, args, reason FROM v_commands
WHERE run_id IN {runs:Array(String)} AND command = 'scale_lr' ORDER BY ts
"""

FINGERPRINT_SQL = """
SELECT dataset, groupUniqArray(dataset_fingerprint) AS fingerprints, uniqExact(run_id) AS runs
FROM v_evals WHERE run_id IN {runs:Array(String)} AND stage = 'full' AND dataset_fingerprint IS NOT NULL
GROUP BY dataset ORDER BY dataset
"""


def checks(store: Any, runs: list[str]) -> list[tuple[bool, str]]:
    """(passed, what) of each check the demo stands for."""
    params = {"runs": runs}
    out: list[tuple[bool, str]] = []
    scale = store.query(SCALE_LR_SQL, params).rows
    by_eval = [r for r in scale if "evaluation" in r[2]]
    out.append((bool(by_eval), f"scale_lr caused by evaluation: {len(by_eval)} of {len(scale)} scale_lr commands"
                + (f" (e.g. {by_eval[0][0]}: {by_eval[0][2][:160]})" if by_eval else "")))
    for dataset, fingerprints, n in store.query(FINGERPRINT_SQL, params).rows:
        out.append((len(fingerprints) == 1 and n == len(runs),
                    f"{dataset}: {n} of {len(runs)} runs evaluated, {len(fingerprints)} fingerprint(s) "
                    f"{', '.join(f[:12] for f in fingerprints)}"))
    columns, rows = store.query(EVAL_SQL, params)
    at = {c: i for i, c in enumerate(columns)}
    for row in rows:
        lo, hi = row[at["min"]], row[at["max"]]
        out.append((hi > 0 and lo < 1, f"{row[at['run']]} {row[at['dataset']]}: full-stage accuracy from {lo} to "
                                       f"{hi} over {row[at['full_rounds']]} rounds"))
    return out


def print_summary(settings: Any, runs: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    from areal_metrics.sinks.query import connect

    console = Console(width=max(Console().width, 140))
    with connect(settings) as store:
        for title, sql in (("training", TRAINING_SQL), ("evaluation (majority vote, full stage)", EVAL_SQL),
                           ("closed loop", LOOP_SQL)):
            result = store.query(sql, {"runs": runs})
            table = Table(title=f"{title}  [SQL over ClickHouse]")
            for column in result.columns:
                table.add_column(column)
            for row in result.rows:
                table.add_row(*(str(v) for v in row))
            console.print(table)
        for passed, what in checks(store, runs):
            console.print(f"[{'green' if passed else 'red'}]{'passed' if passed else 'NOT passed'}[/]: {what}")
