"""The report's drawings (matplotlib, Agg): one function per figure, data in, PNG path out.

The data come from areal_metrics.report's loaders; nothing here reads a store.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SMOOTH_STEPS = 10  # throughput per step is noisy (other processes share the cores)
CONFIG_KEYS = ("strategy", "seed", "world_size", "max_turns", "group_size", "batch_prompts", "lr", "steps",
               "eval_size", "eval_samples", "eval_redundancy", "eval_mode")  # shown even when equal


def tagged(info: dict[str, Any], run: str, tag: str) -> bool:
    return run in info and tag in (info[run].config.get("tags") or ())


def tagged_scaling(info: dict[str, Any], run: str) -> bool:
    """A run of the demo's throughput comparisons: across rank counts (tag `scaling`) or model sizes
    (`model_size`); no strategy of the training comparison."""
    return tagged(info, run, "scaling") or tagged(info, run, "model_size")


def _colors(names: Sequence[str]) -> dict[str, Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return {name: cmap(i % 10) for i, name in enumerate(sorted(set(names)))}


def _style(ax: Any) -> None:
    ax.grid(True, alpha=0.3)
    ax.spines[["top"]].set_visible(False)


MAX_FIGURE_INCHES = (24.0, 16.0)  # at DPI: at most 2880 x 1920 px, whatever the number of runs or keys
DPI = 120


def _wrap_titles(fig: Any) -> None:
    """Wrap every axes title (and the figure's) to its width: no title is clipped."""
    import textwrap

    for ax in fig.axes:
        title = ax.get_title()
        if title:
            inches = ax.get_position().width * fig.get_figwidth()
            chars = max(20, int(inches * 72 / (ax.title.get_fontsize() * 0.55)))
            ax.set_title("\n".join(textwrap.wrap(title.replace("\n", " "), chars)))
    if fig._suptitle is not None:
        chars = max(30, int(fig.get_figwidth() * 72 / (fig._suptitle.get_fontsize() * 0.55)))
        fig._suptitle.set_text("\n".join(textwrap.wrap(fig._suptitle.get_text(), chars)))


def _save(fig: Any, path: Path, title: str, bottom: float = 0.0) -> Path:
    import matplotlib.pyplot as plt

    width, height = fig.get_size_inches()
    fig.set_size_inches(min(width, MAX_FIGURE_INCHES[0]), min(height, MAX_FIGURE_INCHES[1]))
    fig.suptitle(title, fontsize=13)
    _wrap_titles(fig)
    lines = fig._suptitle.get_text().count("\n") + 1
    fig.tight_layout(rect=(0, bottom, 1, 1 - min(0.3, 0.05 * lines * 5.0 / fig.get_figheight())))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def moving_average(values: Sequence[float], n: int) -> list[float]:
    """Trailing mean over up to `n` values (shorter at the start), same length as `values`."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= n:
            total -= values[i - n]
        out.append(total / min(i + 1, n))
    return out


def band(series: Sequence[Sequence[tuple[int, float]]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """(steps, mean, low, high) over the series that have each step: the 95 % t-interval over them
    (runs, i.e. seeds), the mean alone where only one series has the step."""
    from areal_metrics.producers.contract.statistics import t_interval

    by_step: dict[int, list[float]] = defaultdict(list)
    for one in series:
        for step, value in one:
            by_step[step].append(value)
    steps = sorted(by_step)
    intervals = [t_interval(by_step[s]) for s in steps]
    return (steps, [i.mean for i in intervals], [i.mean if i.ci_low is None else i.ci_low for i in intervals],
            [i.mean if i.ci_high is None else i.ci_high for i in intervals])


def _clipped(values: Sequence[float], low: float = 0.0, high: float = 1.0) -> list[float]:
    return [min(max(v, low), high) for v in values]


# ------------------------------------------------------------------ figure 1


def plot_evals(evals: dict[str, dict[str, list[Any]]], path: Path,
               details: dict[str, dict[str, list[tuple[int, dict[str, float]]]]] | None = None,
               lr_cuts: dict[str, list[tuple[int, float, int | None]]] | None = None) -> Path:
    """Accuracy and response length per dataset; with `details` (dataset -> run -> (step, metrics), from
    areal_metrics.report_eval_details.load_consensus_metrics) a second row: pass@K, maj@K and greedy accuracy.
    `lr_cuts` (run -> [(step it applies from, factor, step whose weights it restores or None)]: the closed
    loop's scale_lr commands) are drawn as a dotted vertical line in the run's colour on every accuracy
    panel, the factor (and the step restored) beside it."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    datasets = sorted(evals)
    runs = sorted({run for per_run in evals.values() for run in per_run})
    colors = _colors(runs)
    rows = 2 if details else 1
    fig, axes = plt.subplots(rows, len(datasets), figsize=(6.5 * len(datasets), 5.0 * rows), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        right = ax.twinx()
        for run, points in sorted(evals[dataset].items()):
            ax.plot([p.step for p in points], [100 * p.accuracy for p in points], "-o", color=colors[run], lw=2, ms=4)
            _error_bars(ax, points, colors[run])
            lengths = [(p.step, p.response_length) for p in points if p.response_length is not None]
            if lengths:
                right.plot(*zip(*lengths), "--", color=colors[run], lw=1.4, alpha=0.8)
            for state, marker in (("stale", "X"), ("partial", "s")):
                marked = [p for p in points if p.state == state]
                if marked:
                    ax.scatter([p.step for p in marked], [100 * p.accuracy for p in marked], marker=marker, s=90,
                               facecolors="none" if state == "partial" else colors[run], edgecolors="black",
                               linewidths=1.2, zorder=5)
        for run, cuts in sorted((lr_cuts or {}).items()):
            for step, factor, restored in cuts:
                if run in colors:
                    ax.axvline(step, color=colors[run], ls=":", lw=1.6)
                    label = f"scale_lr x{factor:g}" + (f", weights of step {restored}" if restored is not None else "")
                    ax.annotate(label, (step, 0.97), xycoords=("data", "axes fraction"),
                                rotation=90, va="top", ha="right", fontsize=7, color=colors[run], zorder=5,
                                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})
        ax.set_title(f"{dataset}: full-stage accuracy and response length")
        ax.set_xlabel("training step")
        ax.set_ylabel("accuracy (%)  — solid")
        top = max((100 * (p.ci_high if p.ci_high is not None else p.accuracy)
                   for pts in evals[dataset].values() for p in pts), default=0.0)
        ax.set_ylim(-1, min(102, max(10.0, top * 1.15)))
        right.set_ylabel("mean response length (tokens)  — dashed")
        right.set_ylim(bottom=0)
        _style(ax)
    handles = [Line2D([], [], color=colors[r], lw=2, label=r) for r in runs]
    handles += [
        Line2D([], [], color="gray", lw=2, marker="o", label="accuracy, bars: 95% interval (left axis)"),
        Line2D([], [], color="gray", lw=1.4, ls="--", label="response length (right axis)"),
        Line2D([], [], ls="", marker="X", color="gray", markeredgecolor="black", ms=9, label="stale round (degraded)"),
        Line2D([], [], ls="", marker="s", markerfacecolor="none", markeredgecolor="black", ms=8, label="partial round"),
    ]
    if lr_cuts and any(lr_cuts.get(r) for r in runs):
        handles.append(Line2D([], [], color="gray", lw=1.6, ls=":", label="the loop's scale_lr, from its step"))
    if details:
        names = _plot_details(axes[1], datasets, details, colors)
        handles += [Line2D([], [], color="gray", lw=1.6, ls=_DETAIL_STYLE.get(_family(n), ":"), label=n)
                    for n in names]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 4), frameon=False, fontsize=8)
    legend_rows = (len(handles) + 3) // 4
    return _save(fig, path, "Evaluation accuracy and response length per dataset (cross-node consensus)",
                 bottom=0.05 * legend_rows / rows)


_DETAIL_STYLE = {"pass": "-", "maj": "--", "greedy_accuracy": "-."}


def _family(name: str) -> str:
    return name.split("@")[0] if "@" in name else name


def _plot_details(axes: Sequence[Any], datasets: Sequence[str],
                  details: dict[str, dict[str, list[tuple[int, dict[str, float]]]]], colors: dict[str, Any]) -> list[str]:
    """pass@K, maj@K and greedy accuracy of each round's consensus, one line style per metric; their names."""
    names: set[str] = set()
    for ax, dataset in zip(axes, datasets):
        top = 0.0
        for run, points in sorted(details.get(dataset, {}).items()):
            for name in sorted({n for _, m in points for n in m}):
                series = [(step, 100 * m[name]) for step, m in points if name in m]
                top = max(top, *(v for _, v in series))
                ax.plot(*zip(*series), ls=_DETAIL_STYLE.get(_family(name), ":"), marker=".", color=colors.get(run),
                        lw=1.6)
                names.add(name)
        ax.set_title(f"{dataset}: pass@k, maj@k and greedy accuracy")
        ax.set_xlabel("training step")
        ax.set_ylabel("share of prompts (%)")
        ax.set_ylim(-1, min(102, max(10.0, top * 1.15)))
        _style(ax)
    return sorted(names)


def _error_bars(ax: Any, points: Sequence[Any], color: Any) -> None:
    """Each round's 95 % interval (the consensus's, else Wilson from its sample count) as an error bar."""
    known = [p for p in points if p.ci_low is not None and p.ci_high is not None]
    if known:
        ax.errorbar([p.step for p in known], [100 * p.accuracy for p in known],
                    yerr=[[100 * max(p.accuracy - p.ci_low, 0.0) for p in known],
                          [100 * max(p.ci_high - p.accuracy, 0.0) for p in known]],
                    fmt="none", ecolor=color, elinewidth=1.2, capsize=3, alpha=0.8)


# ------------------------------------------------------------------ figure 2


def plot_rewards(raw: dict[str, list[tuple[int, float]]], smooth: dict[str, list[tuple[int, float, float, int]]],
                 info: dict[str, Any], path: Path, grouped: bool = False,
                 tokens: dict[str, list[tuple[int, float]]] | None = None) -> Path:
    """One line per run; `grouped`: per group (the runs' `group`), the mean over its runs and their band.
    With `tokens` (run -> [(step, generated tokens so far)]), a third panel draws each run's reward
    against the tokens it generated: equal steps are not equal compute."""
    import matplotlib.pyplot as plt

    groups: dict[str, list[str]] = defaultdict(list)
    for run in sorted(set(raw) | set(smooth)):
        if not tagged_scaling(info, run):  # throughput runs are no strategy
            groups[(info[run].group if run in info else run) if grouped else run].append(run)
    colors = _colors(list(groups))
    by_tokens = {run: tokens[run] for runs in groups.values() for run in runs if tokens and tokens.get(run) and raw.get(run)}
    fig, axes = plt.subplots(1, 3 if by_tokens else 2, figsize=(21 if by_tokens else 14, 5), sharey=True)
    ax_raw, ax_smooth = axes[0], axes[1]
    for group, runs in sorted(groups.items()):
        label = f"{group} ({len(runs)} run{'s' if len(runs) > 1 else ''})" if grouped else group
        raws = [moving_average_series(raw[r], 5) for r in runs if raw.get(r)]
        if raws:
            steps, mean, lo, hi = band(raws)
            if len(raws) > 1:
                ax_raw.fill_between(steps, _clipped(lo), _clipped(hi), color=colors[group], alpha=0.2, lw=0)
            ax_raw.plot(steps, mean, color=colors[group], lw=2, label=label)
        smooths = [[(s, avg) for s, avg, _, _ in smooth[r]] for r in runs if smooth.get(r)]
        if smooths:
            steps, mean, lo, hi = band(smooths)
            if len(smooths) > 1:
                ax_smooth.fill_between(steps, _clipped(lo), _clipped(hi), color=colors[group], alpha=0.2, lw=0)
            ax_smooth.plot(steps, mean, color=colors[group], lw=2.2, label=label)
        for i, run in enumerate(r for r in runs if r in by_tokens):
            at_step = dict(by_tokens[run])
            points = [(at_step[s], v) for s, v in moving_average_series(raw[run], 5) if s in at_step]
            axes[2].plot([t for t, _ in points], [v for _, v in points], color=colors[group], lw=1.4,
                         label=label if i == 0 else None)
    ax_raw.set_title("Reward (mean over ranks, 5-step average)"
                     + (": mean over seeds, band 95% t-interval" if grouped else ""))
    ax_smooth.set_title(("Smoothed reward (stream worker's sliding average)"
                         + (": mean, band 95% t-interval" if grouped else "")) if smooth else
                        "Smoothed reward: none stored (stream worker not running?)")
    for ax in (ax_raw, ax_smooth):
        ax.set_xlabel("training step")
    if by_tokens:
        axes[2].set_title("Reward against generated tokens (5-step average, one line per run)")
        axes[2].set_xlabel("generated tokens, summed over ranks")
    for ax in axes:
        _style(ax)
        if ax.lines:
            ax.legend(fontsize=8, loc="upper left")
    ax_raw.set_ylabel("reward (right answers, discounted per extra attempt)")
    return _save(fig, path, "Reward of the strategies side by side" if grouped else "Reward per run")


def moving_average_series(points: list[tuple[int, float]], n: int) -> list[tuple[int, float]]:
    steps = [s for s, _ in points]
    return list(zip(steps, moving_average([v for _, v in points], n)))


# ------------------------------------------------------------------ figure 3


def plot_throughput(series: dict[tuple[str, str], list[tuple[int, float]]], info: dict[str, Any], path: Path) -> Path:
    import matplotlib.pyplot as plt

    runs = sorted({run for run, _ in series})
    colors = _colors(runs)
    styles = ["-", "--", ":", "-."]
    sizes = {run for run in info if tagged(info, run, "model_size") and any(r == run for r, _ in series)}
    fig, axes = plt.subplots(1, 3 if sizes else 2, figsize=(19 if sizes else 14, 5.5),
                             gridspec_kw={"width_ratios": [3, 2, 2] if sizes else [3, 2]})
    ax_line, ax_bar = axes[0], axes[1]
    keys = sorted(series)
    for run, node in keys:
        nodes = sorted(n for r, n in keys if r == run)
        steps, values = zip(*series[(run, node)])
        ax_line.plot(steps, moving_average(values, SMOOTH_STEPS), color=colors[run],
                     ls=styles[nodes.index(node) % len(styles)], lw=1.4, label=f"{run} · {node}")
    ax_line.set_title(f"Per node, over training ({SMOOTH_STEPS}-step moving average)")
    ax_line.set_xlabel("training step")
    ax_line.set_ylabel("generated tokens / s")
    ax_line.set_ylim(bottom=0)
    ax_line.legend(fontsize=7, ncol=2)
    _style(ax_line)
    _scaling_bars(ax_bar, series, info)
    if sizes:
        _size_bars(axes[2], series, info, sizes)
    return _save(fig, path, "Throughput: generated tokens per second (the policy's tokens, no padding)")


def size_points(series: dict[tuple[str, str], list[tuple[int, float]]], info: dict[str, Any],
                runs: set[str]) -> list[tuple[int, float, int]]:
    """(parameters, tokens/s summed over a run's nodes and averaged over its steps, ranks), smallest first."""
    points = []
    for run in runs:
        per_step: dict[int, float] = defaultdict(float)
        for (r, _node), pts in series.items():
            if r == run:
                for step, value in pts:
                    per_step[step] += value
        params = info[run].config.get("n_parameters")
        if per_step and isinstance(params, (int, float)):
            points.append((int(params), sum(per_step.values()) / len(per_step), info[run].world_size))
    return sorted(points)


def _size_bars(ax: Any, series: dict[tuple[str, str], list[tuple[int, float]]], info: dict[str, Any],
               runs: set[str]) -> None:
    """Tokens/s (mean over steps) of the runs tagged `model_size`, by the policy's parameter count."""
    points = size_points(series, info, runs)
    bars = ax.bar(range(len(points)), [tps for _, tps, _ in points], color="tab:green", alpha=0.8)
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(points)), [f"{p / 1e6:.2f}M params" for p, _, _ in points])
    ranks = sorted({w for _, _, w in points})
    ax.set_title(f"Across model sizes ({', '.join(map(str, ranks))} rank{'s' if ranks != [1] else ''}, "
                 "untrained policies,\nruns tagged model_size)")
    ax.set_ylabel("generated tokens / s")
    _style(ax)


def _scaling_bars(ax: Any, series: dict[tuple[str, str], list[tuple[int, float]]], info: dict[str, Any]) -> None:
    """Total tokens/s across a run's ranks (mean over steps), grouped by the run's rank count.

    Runs tagged `scaling` (the demo's one-at-a-time runs) are compared alone when there are any:
    runs that shared the cores with others would not compare.
    """
    scaling = {run for run in info if tagged(info, run, "scaling")}
    totals: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for (run, _node), points in series.items():
        if scaling and run not in scaling:
            continue
        for step, value in points:
            totals[run][step] += value
    by_world: dict[int, list[float]] = defaultdict(list)
    per_node: dict[int, list[float]] = defaultdict(list)
    for run, steps in totals.items():
        world = info[run].world_size if run in info else 1
        mean = sum(steps.values()) / len(steps)
        by_world[world].append(mean)
        per_node[world].append(mean / world)
    worlds = sorted(by_world)
    means = [sum(by_world[w]) / len(by_world[w]) for w in worlds]
    bars = ax.bar(range(len(worlds)), means, color="tab:blue", alpha=0.8, label="total across the ranks")
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.plot(range(len(worlds)), [sum(per_node[w]) / len(per_node[w]) for w in worlds], "D", color="tab:orange",
            label="per node (rank)")
    cores = os.cpu_count() or 1
    ax.set_xticks(range(len(worlds)), [f"{w} rank{'s' if w > 1 else ''}\n({len(by_world[w])} runs)"
                                       + ("\n> cores" if w > cores else "") for w in worlds])
    ax.set_title(f"Across rank counts on {cores} cores (mean over steps and runs"
                 + (",\nruns tagged scaling)" if scaling else ")"))
    ax.set_ylabel("generated tokens / s")
    ax.legend(fontsize=8)
    _style(ax)


# --------------------------------------------------------------- wrong answers


def plot_errors(errors: dict[str, dict[str, dict[str, float]]], path: Path,
                by_round: dict[str, dict[int, dict[str, float]]] | None = None) -> Path:
    """Wrong answers by error type per run; with `by_round` (dataset -> step -> type -> count) a second row:
    the same shares per evaluation round, so a trend over training shows."""
    import matplotlib.pyplot as plt

    datasets = sorted(errors)
    kinds = sorted({k for per_run in errors.values() for counts in per_run.values() for k in counts})
    colors = _colors(kinds)
    rows = 2 if by_round else 1
    fig, axes = plt.subplots(rows, len(datasets), figsize=(6.5 * len(datasets), 5.2 * rows), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        runs = sorted(errors[dataset])
        _stacked_shares(ax, [errors[dataset][r] for r in runs], kinds, colors)
        ax.set_xticks(range(len(runs)), runs, fontsize=7, rotation=30, ha="right")
        ax.set_title(f"{dataset}: wrong answers by error type")
    if by_round:
        for ax, dataset in zip(axes[1], datasets):
            steps = sorted(by_round.get(dataset, {}))
            _stacked_shares(ax, [by_round[dataset][s] for s in steps], kinds, colors)
            ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=8)
            ax.set_xlabel("evaluation round (training step), all runs")
            ax.set_title(f"{dataset}: error types per round")
    axes[0][0].legend(fontsize=8, loc="lower left")
    return _save(fig, path, "Why answers were wrong (full-stage evaluations, the workload's grader)")


def _stacked_shares(ax: Any, groups: Sequence[dict[str, float]], kinds: Sequence[str], colors: dict[str, Any]) -> None:
    """One bar per group: each error type's share of the group's wrong answers."""
    bottoms = [0.0] * len(groups)
    totals = [sum(g.values()) or 1.0 for g in groups]
    for kind in kinds:
        shares = [100 * g.get(kind, 0.0) / t for g, t in zip(groups, totals)]
        ax.bar(range(len(groups)), shares, bottom=bottoms, color=colors[kind], label=kind)
        bottoms = [b + s for b, s in zip(bottoms, shares)]
    ax.set_ylim(0, 100)
    ax.set_ylabel("share of wrong answers (%)")
    _style(ax)


# ----------------------------------------------------------------- configs


def config_table(info: dict[str, Any]) -> tuple[list[str], list[str], list[list[str]]]:
    """(keys, runs, cells): the keys that differ between the runs, and the always-shown ones."""
    runs = sorted(info)
    configs = {r: {**info[r].config, "world_size": info[r].world_size} for r in runs}
    keys = sorted({k for c in configs.values() for k, v in c.items() if not isinstance(v, (dict, list))})
    differing = [k for k in keys if len({repr(configs[r].get(k)) for r in runs}) > 1]
    shown = [k for k in CONFIG_KEYS if k in keys] + [k for k in differing if k not in CONFIG_KEYS]
    cells = [[_cell(configs[r].get(k)) for r in runs] for k in shown]
    return shown, runs, cells


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:g}" if isinstance(value, float) else str(value)


CONFIG_ROWS_MAX, CONFIG_RUNS_MAX, CELL_CHARS = 40, 10, 24  # the table stays readable and its figure bounded


def plot_configs(info: dict[str, Any], path: Path) -> Path:
    import matplotlib.pyplot as plt

    keys, runs, cells = config_table(info)
    hidden_keys, hidden_runs = max(0, len(keys) - CONFIG_ROWS_MAX), max(0, len(runs) - CONFIG_RUNS_MAX)
    keys, runs = keys[:CONFIG_ROWS_MAX], runs[:CONFIG_RUNS_MAX]
    cells = [[_short(c) for c in row[:CONFIG_RUNS_MAX]] for row in cells[:CONFIG_ROWS_MAX]]
    fig, ax = plt.subplots(figsize=(max(8.0, 2.2 * len(runs) + 3), 0.3 * (len(keys) + 1) + 1.2))
    ax.axis("off")
    if keys:
        table = ax.table(cellText=cells, rowLabels=[_short(k) for k in keys], colLabels=[_short(r) for r in runs],
                         cellLoc="center", bbox=(0.12, 0, 0.88, 1))
        table.auto_set_font_size(False)
        table.set_fontsize(8)
    else:
        ax.text(0.5, 0.5, "no run configs stored", ha="center")
    left_out = [f"{n} more {what}" for n, what in ((hidden_keys, "keys"), (hidden_runs, "runs")) if n]
    note = f" ({', '.join(left_out)} not shown: see `areal-metrics sql 'SELECT run_id, config FROM v_runs'`)" if left_out else ""
    return _save(fig, path, "Compared runs: config side by side (settings that differ, and the main ones)" + note)


def _short(text: str) -> str:
    return text if len(text) <= CELL_CHARS else text[:CELL_CHARS - 1] + "…"


# ------------------------------------------------------------ any metric


def plot_metric(key: str, series: dict[str, list[tuple[int, float]]], info: dict[str, Any], path: Path,
                grouped: bool = False) -> Path:
    """`report --metric KEY`: the key over training steps, one line per run (`grouped`: mean and band per group)."""
    import matplotlib.pyplot as plt

    groups: dict[str, list[str]] = defaultdict(list)
    for run in sorted(series):
        groups[(info[run].group if run in info else run) if grouped else run].append(run)
    colors = _colors(list(groups))
    fig, ax = plt.subplots(figsize=(10, 5))
    for group, runs in sorted(groups.items()):
        steps, mean, lo, hi = band([series[r] for r in runs])
        if len(runs) > 1:
            ax.fill_between(steps, lo, hi, color=colors[group], alpha=0.2, lw=0)
        ax.plot(steps, mean, color=colors[group], lw=1.8,
                label=f"{group} ({len(runs)} runs)" if grouped else group)
    ax.set_title(f"{key}: mean over ranks per step" + (", mean over each group's runs, band min-max" if grouped else ""))
    ax.set_xlabel("training step")
    ax.set_ylabel(key)
    _style(ax)
    ax.legend(fontsize=8, loc="best", ncol=1 + len(groups) // 12)
    return _save(fig, path, f"{key} per {'group' if grouped else 'run'}")
