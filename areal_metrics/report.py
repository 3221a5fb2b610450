"""The report figures: PNGs drawn from ClickHouse (matplotlib, Agg backend).

`write_report(out_dir, runs=None, store=None)` writes

- `accuracy_response_length.png`: per evaluation dataset, accuracy (left axis)
  and mean response length (right axis) over training steps, one colour per
  run; degraded (stale) and partial rounds are marked;
- `reward.png`: reward of the runs side by side over steps: raw (mean over
  ranks), sliding-window average and EMA (from the stream worker);
- `throughput.png`: tokens per second per run and node, over steps and on
  average.

Reads deduplicated rows (the `v_*` views) through `sinks.query.connect`, like
every reader, in the configured database (table names are unqualified: the
connection's database). `runs=None` means every run in the store.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_metrics.errors import UserError

RUN_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # the contract's run_id rule: safe inside a SQL literal
FILES = ("accuracy_response_length.png", "reward.png", "throughput.png")


@dataclass(frozen=True)
class EvalPoint:
    step: int
    accuracy: float
    response_length: float | None
    state: str  # ok | stale | partial


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
    """dataset -> run -> points by step: the consensus, full stage where a round has one.

    Falls back to the nodes' own results (mean over nodes) when no consensus
    is stored (the stream worker was not running).
    """
    rows = _rows(store, f"""
        SELECT dataset, run_id, step,
               argMax(accuracy, (stage = 'full', ts)),
               argMax(response_length, (stage = 'full', ts)),
               argMax(multiIf(stale, 'stale', partial, 'partial', 'ok'), (stage = 'full', ts))
        FROM v_eval_consensus
        WHERE {where}
        GROUP BY dataset, run_id, step
        ORDER BY dataset, run_id, step""")
    if not rows:
        rows = _rows(store, f"""
            SELECT dataset, run_id, step, avg(accuracy), avg(response_length), 'ok'
            FROM
            (
                SELECT dataset, run_id, step, node,
                       argMax(accuracy, (stage = 'full', ts)) AS accuracy,
                       argMax(response_length, (stage = 'full', ts)) AS response_length
                FROM v_evals
                WHERE {where} AND status = 'ok'
                GROUP BY dataset, run_id, step, node
            )
            GROUP BY dataset, run_id, step
            ORDER BY dataset, run_id, step""")
    out: dict[str, dict[str, list[EvalPoint]]] = defaultdict(lambda: defaultdict(list))
    for dataset, run, step, acc, length, state in rows:
        out[dataset][run].append(EvalPoint(int(step), float(acc), None if length is None else float(length), state))
    return out


def load_rewards(store: Any, where: str) -> tuple[dict[str, list[tuple[int, float]]], dict[str, list[tuple[int, float, float, int]]]]:
    """(run -> [(step, mean raw reward)], run -> [(step, sliding avg, ema, window)])."""
    raw: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for run, step, reward in _rows(store, f"""
            SELECT run_id, step, avg(reward) FROM v_steps
            WHERE {where} AND reward IS NOT NULL GROUP BY run_id, step ORDER BY run_id, step"""):
        raw[run].append((int(step), float(reward)))
    smooth: dict[str, list[tuple[int, float, float, int]]] = defaultdict(list)
    for run, step, avg, ema, window in _rows(store, f"""
            SELECT run_id, step, argMax(sliding_avg, ts), argMax(ema, ts), argMax(window, ts)
            FROM v_rewards_smoothed WHERE {where} GROUP BY run_id, step ORDER BY run_id, step"""):
        smooth[run].append((int(step), float(avg), float(ema), int(window)))
    return raw, smooth


def load_throughput(store: Any, where: str) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """(run, node) -> [(step, tokens/s summed over the node's ranks)]."""
    out: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    for run, node, step, tps in _rows(store, f"""
            SELECT run_id, node, step, sum(throughput) FROM v_steps
            WHERE {where} AND throughput IS NOT NULL
            GROUP BY run_id, node, step ORDER BY run_id, node, step"""):
        out[(run, node)].append((int(step), float(tps)))
    return out


# ------------------------------------------------------------------ figures


def _colors(runs: Sequence[str]) -> dict[str, Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return {run: cmap(i % 10) for i, run in enumerate(sorted(runs))}


def _style(ax: Any) -> None:
    ax.grid(True, alpha=0.3)
    ax.spines[["top"]].set_visible(False)


def plot_evals(evals: dict[str, dict[str, list[EvalPoint]]], path: Path) -> Path:
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    datasets = sorted(evals)
    runs = sorted({run for per_run in evals.values() for run in per_run})
    colors = _colors(runs)
    fig, axes = plt.subplots(1, len(datasets), figsize=(6.5 * len(datasets), 4.8), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        right = ax.twinx()
        for run, points in sorted(evals[dataset].items()):
            steps = [p.step for p in points]
            ax.plot(steps, [100 * p.accuracy for p in points], "-o", color=colors[run], lw=2, ms=4)
            lengths = [(p.step, p.response_length) for p in points if p.response_length is not None]
            if lengths:
                right.plot(*zip(*lengths), "--", color=colors[run], lw=1.4, alpha=0.8)
            for state, marker in (("stale", "X"), ("partial", "s")):
                marked = [p for p in points if p.state == state]
                if marked:
                    ax.scatter([p.step for p in marked], [100 * p.accuracy for p in marked], marker=marker, s=90,
                               facecolors="none" if state == "partial" else colors[run], edgecolors="black",
                               linewidths=1.2, zorder=5)
        ax.set_title(f"{dataset}: quality and generation behaviour")
        ax.set_xlabel("training step")
        ax.set_ylabel("accuracy (%)  — solid")
        top = max((100 * p.accuracy for pts in evals[dataset].values() for p in pts), default=0.0)
        ax.set_ylim(-1, min(102, max(10.0, top * 1.15)))  # room to read small accuracies, never above 100 %
        right.set_ylabel("mean response length (tokens)  — dashed")
        right.set_ylim(bottom=0)
        _style(ax)
    handles = [Line2D([], [], color=colors[r], lw=2, label=r) for r in runs]
    handles += [
        Line2D([], [], color="gray", lw=2, marker="o", label="accuracy (left axis)"),
        Line2D([], [], color="gray", lw=1.4, ls="--", label="response length (right axis)"),
        Line2D([], [], ls="", marker="X", color="gray", markeredgecolor="black", ms=9, label="stale round (degraded)"),
        Line2D([], [], ls="", marker="s", markerfacecolor="none", markeredgecolor="black", ms=8, label="partial round"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), frameon=False)
    fig.suptitle("Evaluation accuracy and response length per dataset over training (cross-node consensus)",
                 fontsize=13)
    fig.tight_layout(rect=(0, 0.09, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_rewards(raw: dict[str, list[tuple[int, float]]], smooth: dict[str, list[tuple[int, float, float, int]]],
                 path: Path) -> Path:
    import matplotlib.pyplot as plt

    runs = sorted(set(raw) | set(smooth))
    colors = _colors(runs)
    fig, (ax_raw, ax_smooth) = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    for run in runs:
        if raw.get(run):
            steps, values = zip(*raw[run])
            ax_raw.plot(steps, values, color=colors[run], lw=1, alpha=0.8, label=f"{run} raw")
        if smooth.get(run):
            steps, avgs, emas, windows = zip(*smooth[run])
            ax_raw.plot(steps, avgs, color=colors[run], lw=2.2, label=f"{run} sliding avg ({windows[-1]} steps)")
            ax_smooth.plot(steps, emas, color=colors[run], lw=2.4, label=f"{run} EMA")
            ax_smooth.plot(steps, avgs, color=colors[run], lw=1.2, ls="--", alpha=0.8,
                           label=f"{run} sliding avg")
    ax_raw.set_title("Raw reward (mean over ranks) and its sliding average")
    ax_smooth.set_title("Smoothed reward: EMA and sliding average" if smooth else
                        "Smoothed reward: none stored (stream worker not running?)")
    for ax in (ax_raw, ax_smooth):
        ax.set_xlabel("training step")
        _style(ax)
        if ax.lines:
            ax.legend(fontsize=8, loc="upper left")
    ax_raw.set_ylabel("reward (fraction of correct answers)")
    fig.suptitle("Reward of the runs side by side", fontsize=13)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


SMOOTH_STEPS = 10  # throughput per step is noisy (other processes share the cores)


def moving_average(values: Sequence[float], n: int) -> list[float]:
    """Trailing mean over up to `n` values (shorter at the start), same length as `values`."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= n:
            total -= values[i - n]
        out.append(total / min(i + 1, n))
    return out


def plot_throughput(series: dict[tuple[str, str], list[tuple[int, float]]], path: Path) -> Path:
    import matplotlib.pyplot as plt

    runs = sorted({run for run, _ in series})
    colors = _colors(runs)
    styles = ["-", "--", ":", "-."]
    fig, (ax_line, ax_bar) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [3, 2]})
    keys = sorted(series)
    for (run, node) in keys:
        nodes = sorted(n for r, n in keys if r == run)
        steps, values = zip(*series[(run, node)])
        ax_line.plot(steps, moving_average(values, SMOOTH_STEPS), color=colors[run],
                     ls=styles[nodes.index(node) % len(styles)], lw=1.6, label=f"{run} · {node}")
    ax_line.set_title(f"Throughput over training ({SMOOTH_STEPS}-step moving average)")
    ax_line.set_xlabel("training step")
    ax_line.set_ylabel("throughput (tokens/s)")
    ax_line.set_ylim(bottom=0)
    ax_line.legend(fontsize=8)
    _style(ax_line)
    means = [sum(v for _, v in series[k]) / len(series[k]) for k in keys]
    labels = [f"{run}\n{node}" for run, node in keys]
    bars = ax_bar.bar(range(len(keys)), means, color=[colors[run] for run, _ in keys])
    ax_bar.bar_label(bars, fmt="%.0f", fontsize=8)
    ax_bar.set_xticks(range(len(keys)), labels, fontsize=8, rotation=30, ha="right")  # long run ids stay apart
    ax_bar.set_title("Mean throughput per run and node")
    ax_bar.set_ylabel("throughput (tokens/s)")
    ax_bar.set_xlabel("run and node")
    _style(ax_bar)
    fig.suptitle("Throughput per run and node", fontsize=13)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------- entry


def write_report(out_dir: Path, runs: Sequence[str] | None = None, store: Any = None) -> list[Path]:
    """Draw the figures into `out_dir` (created); returns the PNG paths. Raises UserError without data."""
    import matplotlib

    matplotlib.use("Agg")
    where = _runs_filter(runs)
    if store is None:
        from sinks.query import StoreError, connect

        try:
            with connect() as opened:
                return write_report(out_dir, runs, opened)
        except StoreError as exc:
            raise UserError(str(exc)) from None
    raw, smooth = load_rewards(store, where)
    if not raw:
        which = f"runs {', '.join(runs)}" if runs else "any run"
        raise UserError(f"no training steps stored for {which}: nothing to report")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [plot_rewards(raw, smooth, out_dir / "reward.png")]
    evals = load_evals(store, where)
    if evals:
        written.insert(0, plot_evals(evals, out_dir / "accuracy_response_length.png"))
    throughput = load_throughput(store, where)
    if throughput:
        written.append(plot_throughput(throughput, out_dir / "throughput.png"))
    return written
