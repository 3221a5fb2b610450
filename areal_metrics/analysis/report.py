"""The report: PNG figures drawn from ClickHouse (matplotlib, Agg backend).

`write_report(out_dir, runs=None, store=None)` writes (figures.py draws them)

- `accuracy_response_length.png` (figure 1): small multiples, a column per evaluation
  dataset: the full-stage accuracy (cross-node consensus, else the nodes' own results)
  with each round's 95 % interval as error bars (the consensus's `ci_low`/`ci_high`, else
  Wilson from its sample count), one line per run, or with `grouped` one per group (the
  mean of its runs, their 95 % t-interval as the band); the mean response length in a
  row of its own when logged; stale (degraded) and partial rounds marked;
- `reward.png` (figure 2): reward per run, raw (mean over ranks) and smoothed (when the
  stream worker stored it); with `grouped` (`report --group`), per strategy (the runs'
  group, e.g. mt4-grpo) the mean over its runs (seeds) and its 95 % t-interval over the
  runs as the band; the axis reads the runs' `config.reward_label`, else "reward (as logged)";
- `throughput.png` (figure 3): generated tokens per second (the policy's own
  tokens, not prompts, feedback or padding) per run and node over steps, and, with two
  or more rank counts, the total across the ranks by rank count: compared (a 95 %
  t-interval over runs) only with 2+ runs of 10+ steps per rank count;
- `errors.png`: the wrong answers of the full-stage evaluations by error type
  (the workload's grader, per skill: areal_metrics.areal_train.grader), per dataset
  and run, and per evaluation round over all runs (the trend over training; each round
  says how many runs it pools);
- `config.png`: the compared runs' configs side by side (the settings that
  differ, and the strategy, seed and rank count), from the `runs` table, then each
  run's `run.summary` keys (`summary.<key>`) and its `notes`;
- `metric-<key>.png` for each `metrics=` key (`report --metric KEY`): any value a
  run logged, a typed column of the steps or a key of their `metrics`, per run.
- `what_changed.md` (when runs evaluated): the shown prompts whose verdict flipped between
  a run's first and last round (areal_metrics.analysis.eval_details).

`eval_details=True` (`report --eval-details`) adds rows to figure 1, one per metric family:
pass@K, maj@K and greedy accuracy of each round's consensus (`eval_consensus.metrics`).

Reads deduplicated rows (the `v_*` views) through `areal_metrics.sinks.query.connect`, like
every reader, in the configured database (table names are unqualified: the
connection's database). `runs=None` means every run in the store.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_metrics.analysis.eval_details import (
    CHANGES_FILE,
    load_consensus_metrics,
    load_errors_by_round,
    load_flips,
    load_runs_by_round,
    write_what_changed,
)
from areal_metrics.producers.contract.errors import UserError
from areal_metrics.sinks.step_means import MEAN_COLUMNS

RUN_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # the contract's run_id rule: safe inside a SQL literal
FILES = ("accuracy_response_length.png", "reward.png", "throughput.png", "errors.png", "config.png")


@dataclass(frozen=True)
class EvalPoint:
    step: int
    accuracy: float
    response_length: float | None
    state: str  # ok | stale | partial
    ci_low: float | None = None  # the round's 95 % interval (`eval_interval`)
    ci_high: float | None = None


@dataclass
class RunInfo:
    """What the `runs` table (else the steps) says about a run."""

    group: str  # the strategy the run belongs to (its own id when it has none)
    world_size: int
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)  # run.summary (W&B's), as v_runs folds it
    notes: str | None = None  # init(notes=...)


def _runs_filter(runs: Sequence[str] | None) -> str:
    if not runs:
        return "1"
    bad = [r for r in runs if not RUN_ID.fullmatch(r)]
    if bad:
        raise UserError(f"--run {bad[0]!r}: a run id is 1..128 characters of A-Z a-z 0-9 . _ : -")
    return "run_id IN (" + ", ".join(f"'{r}'" for r in runs) + ")"


def _rows(store: Any, sql: str) -> list[tuple[Any, ...]]:
    return list(store.query(sql).rows)


# ---------------------------------------------------------------- the data


def load_evals(store: Any, where: str) -> dict[str, dict[str, list[EvalPoint]]]:
    """dataset -> run -> full-stage points by step: the consensus of each round.

    Falls back to the nodes' own results (their mean weighted by samples) when
    no consensus is stored (the stream worker was not running).
    """
    rows = _rows(store, f"""
        SELECT dataset, run_id, step, argMax(accuracy, ts), argMax(response_length, ts),
               argMax(multiIf(stale, 'stale', partial, 'partial', 'ok'), ts)
        FROM v_eval_consensus
        WHERE {where} AND stage = 'full'
        GROUP BY dataset, run_id, step
        ORDER BY dataset, run_id, step""")
    if not rows:
        rows = _rows(store, f"""
            SELECT dataset, run_id, step, sum(accuracy * n_samples) / sum(n_samples),
                   sum(response_length * n_samples) / sum(n_samples), 'ok'
            FROM v_evals
            WHERE {where} AND status = 'ok' AND stage = 'full' AND n_samples > 0
            GROUP BY dataset, run_id, step
            ORDER BY dataset, run_id, step""")
    intervals = load_eval_intervals(store, where)
    counts = sample_count(store, where) if len(intervals) < len(rows) else {}
    out: dict[str, dict[str, list[EvalPoint]]] = defaultdict(lambda: defaultdict(list))
    for dataset, run, step, acc, length, state in rows:
        low, high = intervals.get((dataset, run, int(step)), (None, None))
        if low is None:
            low, high = eval_interval(float(acc), None, None, counts.get((dataset, run, int(step))))
        out[dataset][run].append(EvalPoint(int(step), float(acc), None if length is None else float(length), state,
                                           low, high))
    return out


def _has_columns(store: Any, table: str, *names: str) -> bool:
    listed = ", ".join(f"'{n}'" for n in names)
    return _rows(store, f"SELECT count() FROM system.columns WHERE database = currentDatabase() "
                        f"AND table = '{table}' AND name IN ({listed})")[0][0] == len(names)


def eval_interval(accuracy: float, ci_low: float | None, ci_high: float | None,
                  n_samples: int | None) -> tuple[float | None, float | None]:
    """A round's 95 % interval: the consensus's own when it carries one, else Wilson from its sample
    count, else none."""
    from areal_metrics.producers.contract.statistics import wilson

    if ci_low is not None and ci_high is not None:
        return ci_low, ci_high
    if n_samples:
        return wilson(accuracy, n_samples)
    return None, None


def load_eval_intervals(store: Any, where: str) -> dict[tuple[str, str, int], tuple[float | None, float | None]]:
    """(dataset, run, step) -> the full-stage consensus's interval: its `ci_low`/`ci_high` columns when
    the store has them, else Wilson from its `n_samples`; rounds with neither are absent."""
    if not _has_columns(store, "eval_consensus", "n_samples"):
        return {}
    ci = "argMax(ci_low, ts), argMax(ci_high, ts)" if _has_columns(store, "eval_consensus", "ci_low", "ci_high") \
        else "NULL, NULL"
    out = {}
    for dataset, run, step, acc, low, high, n in _rows(store, f"""
            SELECT dataset, run_id, step, argMax(accuracy, ts), {ci}, argMax(n_samples, ts)
            FROM v_eval_consensus WHERE {where} AND stage = 'full'
            GROUP BY dataset, run_id, step"""):
        interval = eval_interval(float(acc), low, high, None if n is None else int(n))
        if interval[0] is not None:
            out[(dataset, run, int(step))] = interval
    return out


def sample_count(store: Any, where: str) -> dict[tuple[str, str, int], int]:
    """(dataset, run, step) -> samples behind a full round, from its nodes' events (events written
    before the consensus carried `n_samples`): the set's size when the older layout names it in
    `metrics`, else the largest node's count."""
    return {(d, r, int(s)): int(n) for d, r, s, n in _rows(store, f"""
        SELECT dataset, run_id, step,
               max(if(mapContains(metrics, 'shard_total'), toUInt64(metrics['shard_total']), ifNull(n_samples, 0)))
        FROM v_evals WHERE {where} AND stage = 'full' AND status = 'ok'
        GROUP BY dataset, run_id, step""")}


def load_rewards(store: Any, where: str) -> tuple[dict[str, list[tuple[int, float]]],
                                                  dict[str, list[tuple[int, float, float, int]]]]:
    """(run -> [(step, reward: the rank mean of v_step_means)], run -> [(step, sliding avg, ema, window)])."""
    raw: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for run, step, reward in _rows(store, f"""
            SELECT run_id, step, reward FROM v_step_means WHERE {where} AND reward IS NOT NULL
            ORDER BY run_id, step"""):
        raw[run].append((int(step), float(reward)))
    smooth: dict[str, list[tuple[int, float, float, int]]] = defaultdict(list)
    for run, step, avg, ema, window in _rows(store, f"""
            SELECT run_id, step, argMax(sliding_avg, ts), argMax(ema, ts), argMax(window, ts)
            FROM v_rewards_smoothed WHERE {where} GROUP BY run_id, step ORDER BY run_id, step"""):
        smooth[run].append((int(step), float(avg), float(ema), int(window)))
    return raw, smooth


def load_lr_cuts(store: Any, where: str) -> dict[str, list[tuple[int, float, int | None]]]:
    """run -> [(the step a scale_lr applies from, its factor, the step whose weights it restores or None)]:
    the closed loop's commands."""
    out: dict[str, list[tuple[int, float, int | None]]] = defaultdict(list)
    for run, args in _rows(store, f"""
            SELECT run_id, args FROM v_commands WHERE {where} AND command = 'scale_lr' ORDER BY run_id, ts"""):
        try:
            parsed = json.loads(args)
            restore = parsed.get("restore_step")
            out[run].append((int(parsed["from_step"]), float(parsed["factor"]),
                             None if restore is None else int(restore)))
        except (ValueError, TypeError, KeyError):  # a command without its step (sent by hand): not drawn
            continue
    return out


def load_lr_applied(store: Any, where: str) -> dict[str, list[tuple[int, float]]]:
    """run -> [(the step from which its trainers applied a scale_lr, their cumulative lr factor)], one per
    command (its first node's step): the trainers' acknowledgements (`v_command_acks`). A store made
    before they existed (schema < 8) gives nothing."""
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    try:
        rows = _rows(store, f"""
            SELECT run_id, min(step), argMin(lr_factor, step) FROM v_command_acks
            WHERE {where} AND command = 'scale_lr' AND status = 'applied' AND step IS NOT NULL
            GROUP BY run_id, command_id ORDER BY run_id, min(step)""")
    except Exception:  # noqa: BLE001 - an older store without the view: the figure without the marks
        return out
    for run, step, factor in rows:
        out[run].append((int(step), float(factor) if factor is not None else float("nan")))
    return out


def load_generated_tokens(store: Any, where: str) -> dict[str, list[tuple[int, float]]]:
    """run -> [(step, generated tokens up to and including the step, summed over ranks)]: the
    compute behind a step, which differs between strategies (mt4 writes more per episode)."""
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for run, step, tokens in _rows(store, f"""
            SELECT run_id, step, tokens_sum FROM v_step_means WHERE {where} AND tokens IS NOT NULL
            ORDER BY run_id, step"""):
        total = (out[run][-1][1] if out[run] else 0.0) + float(tokens)
        out[run].append((int(step), total))
    return out


def load_throughput(store: Any, where: str) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """(run, node) -> [(step, generated tokens/s summed over the node's ranks)]."""
    out: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    for run, node, step, tps in _rows(store, f"""
            SELECT run_id, node, step, sum(throughput) FROM v_steps
            WHERE {where} AND throughput IS NOT NULL
            GROUP BY run_id, node, step ORDER BY run_id, node, step"""):
        out[(run, node)].append((int(step), float(tps)))
    return out


def load_errors(store: Any, where: str) -> dict[str, dict[str, dict[str, float]]]:
    """dataset -> run -> error type -> wrong answers of the full stages (summed over nodes and rounds)."""
    out: dict[str, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for dataset, run, key, count in _rows(store, f"""
            SELECT dataset, run_id, key, sum(metrics[key])
            FROM v_evals ARRAY JOIN mapKeys(metrics) AS key
            WHERE {where} AND status = 'ok' AND stage = 'full' AND startsWith(key, 'errors.')
            GROUP BY dataset, run_id, key ORDER BY dataset, run_id, key"""):
        out[dataset][run][key.removeprefix("errors.")] = float(count)
    return out


def load_runs(store: Any, where: str) -> dict[str, RunInfo]:
    """run -> group, rank count, config, summary and notes: its latest attempt in `v_runs`, else what the steps say."""
    info: dict[str, RunInfo] = {}
    for run, world in _rows(store, f"""
            SELECT run_id, max(greatest(ifNull(world_size, 1), ranks)) FROM v_step_means WHERE {where}
            GROUP BY run_id"""):
        info[run] = RunInfo(group=run, world_size=int(world))
    for run, group, world, config, summary, notes in _rows(store, f"""
            SELECT run_id, `group`, world_size, config, summary, notes FROM v_runs WHERE {where}"""):
        known = info.get(run)
        info[run] = RunInfo(group=group or run, world_size=max(int(world), known.world_size if known else 1),
                            config=_json_object(config), summary=_json_object(summary), notes=notes or None)
    return info


def _json_object(text: str | None) -> dict[str, Any]:
    """A stored JSON object column (`config`, `summary`); {} when empty, NULL or not an object."""
    try:
        parsed = json.loads(text) if text else {}
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


STEP_COLUMNS = MEAN_COLUMNS  # the typed columns v_step_means averages over ranks (sinks/step_means.py)


def load_metric(store: Any, where: str, key: str) -> dict[str, list[tuple[int, float]]]:
    """run -> [(step, the key's mean over ranks)]: a typed column's rank mean (v_step_means, the one
    rule), else the key in the steps' `metrics` (plain mean over the ranks that logged it)."""
    if key in STEP_COLUMNS:
        sql, parameters = f"""
            SELECT run_id, step, {key} FROM v_step_means WHERE {where} AND {key} IS NOT NULL
            ORDER BY run_id, step""", None
    else:
        sql, parameters = f"""
            SELECT run_id, step, avg(metrics[{{key:String}}]) FROM v_steps
            WHERE {where} AND mapContains(metrics, {{key:String}})
            GROUP BY run_id, step ORDER BY run_id, step""", {"key": key}
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for run, step, mean in store.query(sql, parameters).rows:
        out[run].append((int(step), float(mean)))
    return out


def metric_file(key: str) -> str:
    """`metric-<key>.png`, the key made a safe file name (`actor/pg_loss` -> `metric-actor_pg_loss.png`)."""
    return "metric-" + (re.sub(r"[^A-Za-z0-9._-]+", "_", key).strip("._") or "key")[:100] + ".png"


def load_fingerprints(store: Any, where: str) -> dict[str, dict[str, set[str]]]:
    """dataset -> run -> the fingerprints of the sets its full stages evaluated."""
    out: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for dataset, run, fp in _rows(store, f"""
            SELECT DISTINCT dataset, run_id, dataset_fingerprint FROM v_evals
            WHERE {where} AND stage = 'full' AND dataset_fingerprint IS NOT NULL"""):
        out[dataset][run].add(fp)
    return out


# ------------------------------------------------------------------- entry


def write_report(out_dir: Path, runs: Sequence[str] | None = None, store: Any = None, *,
                 metrics: Sequence[str] = (), grouped: bool = False, eval_details: bool = False) -> list[Path]:
    """Draw the figures into `out_dir` (created); returns the PNG paths and the "what changed" table.
    Raises UserError without data.

    `metrics`: keys drawn one figure each; `grouped`: runs averaged per group instead of one line per run;
    `eval_details`: figure 1 also draws pass@K, maj@K and greedy accuracy.
    """
    import matplotlib

    matplotlib.use("Agg")
    from areal_metrics.analysis import figures as draw

    where = _runs_filter(runs)
    if store is None:
        from areal_metrics.sinks.query import connect

        with connect() as opened:  # its StoreError says the exit code (1 unreachable, 2 refused) in one line
            return write_report(out_dir, runs, opened, metrics=metrics, grouped=grouped, eval_details=eval_details)
    raw, smooth = load_rewards(store, where)
    evals = load_evals(store, where)
    if not raw and not evals:
        which = f"runs {', '.join(runs)}" if runs else "any run"
        raise UserError(f"no training steps with a reward and no evaluation stored for {which}: nothing to report")
    out_dir.mkdir(parents=True, exist_ok=True)
    info = load_runs(store, where)
    written = []
    if evals:
        details = load_consensus_metrics(store, where) if eval_details else None
        written.append(draw.plot_evals(evals, out_dir / FILES[0], details, load_lr_cuts(store, where),
                                       info, grouped=grouped, lr_applied=load_lr_applied(store, where)))
    if raw:  # a run may log evaluations and other metrics without a reward (AReaL's names, say)
        written.append(draw.plot_rewards(raw, smooth, info, out_dir / FILES[1], grouped=grouped,
                                         tokens=load_generated_tokens(store, where)))
    throughput = load_throughput(store, where)
    if throughput:
        written.append(draw.plot_throughput(throughput, info, out_dir / FILES[2]))
    errors = load_errors(store, where)
    if errors:
        written.append(draw.plot_errors(errors, out_dir / FILES[3], load_errors_by_round(store, where),
                                        load_runs_by_round(store, where)))
    written.append(draw.plot_configs(info, out_dir / FILES[4]))
    if evals:
        written.append(write_what_changed(load_flips(store, where), out_dir / CHANGES_FILE))
    for key in dict.fromkeys(metrics):
        series = load_metric(store, where, key)
        if not series:
            raise UserError(f"--metric {key[:80]!r}: no step of these runs has it (a typed column: "
                            f"{', '.join(STEP_COLUMNS)}; else a key of `metrics`)")
        written.append(draw.plot_metric(key, series, info, out_dir / metric_file(key), grouped=grouped))
    return written
