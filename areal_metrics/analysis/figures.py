"""The report's drawings (matplotlib, Agg): one function per figure, data in, PNG path out.

The data come from areal_metrics.analysis.report's loaders; nothing here reads a store.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
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


REWARD_LABEL_KEY = "reward_label"  # a run's config may name what its reward is (the workload's trainer does)
DEFAULT_REWARD_LABEL = "reward (as logged)"


def reward_label(info: dict[str, Any], runs: Sequence[str]) -> str:
    """The reward axis's label: the runs' own `config.reward_label` when every drawn run sets the same one,
    else "reward (as logged)": the report says nothing about a reward it did not define."""
    labels = {str(info[r].config.get(REWARD_LABEL_KEY) or "") if r in info else "" for r in runs}
    return labels.pop() if len(labels) == 1 and "" not in labels else DEFAULT_REWARD_LABEL


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


# ------------------------------------------------------------------ figure 1


def plot_evals(evals: dict[str, dict[str, list[Any]]], path: Path,
               details: dict[str, dict[str, list[tuple[int, dict[str, float]]]]] | None = None,
               lr_cuts: dict[str, list[tuple[int, float, int | None]]] | None = None,
               info: dict[str, Any] | None = None, grouped: bool = False,
               lr_applied: dict[str, list[tuple[int, float]]] | None = None) -> Path:
    """Small multiples, one column per dataset: the full-stage accuracy; the mean response length (a row of
    its own, only when some round has one); with `details` (dataset -> run -> (step, metrics), from
    areal_metrics.analysis.eval_details.load_consensus_metrics) one row per metric family: pass@K, maj@K,
    greedy accuracy.

    One line per run with its rounds' 95 % intervals as error bars; `grouped` (with `info`): one line per
    group (the runs' `group`), the mean over its runs and their 95 % t-interval as the band (a group of one
    run keeps its error bars). `lr_cuts` (run -> [(step it applies from, factor, step whose weights it
    restores or None)]: the closed loop's scale_lr commands) are drawn as a dotted vertical line in the
    run's colour on every accuracy panel, labelled horizontally in a band above the data. `lr_applied`
    (run -> [(step, cumulative factor)]: the trainers' acknowledgements) puts a triangle at the foot of each
    accuracy panel where a trainer applied one."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    datasets = sorted(evals)
    runs = sorted({run for per_run in evals.values() for run in per_run})
    units = _units(runs, info, grouped)
    colors = _colors(list(units))
    unit_of = {run: unit for unit, members in units.items() for run in members}
    has_length = any(p.response_length is not None for per_run in evals.values() for pts in per_run.values()
                     for p in pts)
    families = _detail_families(details) if details else []
    rows = 1 + has_length + len(families)
    width = max(8.0, 6.5 * len(datasets))
    fig, axes = plt.subplots(rows, len(datasets), figsize=(width, 3.6 * rows + 1.0), squeeze=False)
    states: set[str] = set()
    cut_drawn = applied_drawn = False
    for col, dataset in enumerate(datasets):
        ax = axes[0][col]
        for unit, members in sorted(units.items()):
            present = [r for r in members if r in evals[dataset]]
            if not present:
                continue
            color = colors[unit]
            if len(present) == 1:
                points = evals[dataset][present[0]]
                ax.plot([p.step for p in points], [100 * p.accuracy for p in points], "-o", color=color, lw=2, ms=4)
                _error_bars(ax, points, color)
            else:
                _band_line(ax, [[(p.step, 100 * p.accuracy) for p in evals[dataset][r]] for r in present], color,
                           marker="o")
            for state, marker in (("stale", "X"), ("partial", "s")):
                marked = [p for r in present for p in evals[dataset][r] if p.state == state]
                if marked:
                    states.add(state)
                    ax.scatter([p.step for p in marked], [100 * p.accuracy for p in marked], marker=marker, s=70,
                               facecolors="none" if state == "partial" else color, edgecolors="black",
                               linewidths=1.1, zorder=5)
        top = max((100 * (p.ci_high if p.ci_high is not None else p.accuracy)
                   for pts in evals[dataset].values() for p in pts), default=0.0)
        cut_drawn |= _lr_cut_marks(ax, lr_cuts or {}, colors, unit_of, max(10.0, top * 1.1),
                                   max((p.step for pts in evals[dataset].values() for p in pts), default=0))
        for run, applied in sorted((lr_applied or {}).items()):
            if run in unit_of and applied:
                applied_drawn = True
                ax.plot([step for step, _ in applied], [0.02] * len(applied), ls="", marker="^", ms=8,
                        color=colors[unit_of[run]], markeredgecolor="black", transform=ax.get_xaxis_transform(),
                        clip_on=False, zorder=6)
        ax.set_title(f"{dataset}: full-stage accuracy")
        ax.set_ylabel("accuracy (%)")
        if has_length:
            ax_len = axes[1][col]
            for unit, members in sorted(units.items()):
                series = [[(p.step, p.response_length) for p in evals[dataset][r] if p.response_length is not None]
                          for r in members if r in evals[dataset]]
                series = [s for s in series if s]
                if series:
                    _band_line(ax_len, series, colors[unit], marker=".")
            ax_len.set_title(f"{dataset}: mean response length")
            ax_len.set_ylabel("tokens")
            ax_len.set_ylim(bottom=0)
            if not ax_len.lines:
                ax_len.text(0.5, 0.5, "no response length logged", ha="center", va="center",
                            transform=ax_len.transAxes, color="gray")
        for row, family in enumerate(families, start=1 + has_length):
            _plot_family(axes[row][col], dataset, family, details or {}, units, colors)
        for row in range(rows):
            _style(axes[row][col])
            axes[row][col].set_xlabel("training step" if row == rows - 1 else "")
    grouped_units = any(len(m) > 1 for m in units.values())
    handles = [Line2D([], [], color=colors[u], lw=2,
                      label=f"{u} ({len(m)} runs)" if grouped and len(m) > 1 else u) for u, m in sorted(units.items())]
    if any(len(m) == 1 for m in units.values()):
        handles.append(Line2D([], [], color="gray", lw=2, marker="o", label="a run: bars 95% interval of a round"))
    if grouped_units:
        handles.append(Patch(color="gray", alpha=0.3, label="a group: mean of its runs, band 95% t-interval"))
    if "stale" in states:
        handles.append(Line2D([], [], ls="", marker="X", color="gray", markeredgecolor="black", ms=9,
                              label="stale round (degraded)"))
    if "partial" in states:
        handles.append(Line2D([], [], ls="", marker="s", markerfacecolor="none", markeredgecolor="black", ms=8,
                              label="partial round"))
    if cut_drawn:
        handles.append(Line2D([], [], color="gray", lw=1.6, ls=":", label="the loop's scale_lr, from its step"))
    if applied_drawn:
        handles.append(Line2D([], [], ls="", marker="^", color="gray", markeredgecolor="black", ms=8,
                              label="scale_lr applied by the trainers (their ack)"))
    return _save_with_legend(fig, path, handles, "Evaluation per dataset: full-stage accuracy"
                             + (" and response length" if has_length else "") + (", pass@k, maj@k" if families else ""))


def _units(runs: Sequence[str], info: dict[str, Any] | None, grouped: bool) -> dict[str, list[str]]:
    """What one line stands for: each run, or (`grouped`) each group of runs."""
    units: dict[str, list[str]] = defaultdict(list)
    for run in runs:
        units[(info[run].group if info and run in info else run) if grouped else run].append(run)
    return dict(units)


def _band_line(ax: Any, series: Sequence[Sequence[tuple[int, float]]], color: Any, marker: str = "") -> None:
    """The mean over the series at each step; with two or more, their 95 % t-interval as the band."""
    steps, mean, low, high = band(series)
    if len(series) > 1:
        ax.fill_between(steps, low, high, color=color, alpha=0.18, lw=0)
    ax.plot(steps, mean, ls="-", marker=marker or None, color=color, lw=2, ms=4)


MAX_CUT_LABELS = 4  # more cuts on one panel: the lines alone, and one line of text that counts them


def _lr_cut_marks(ax: Any, lr_cuts: dict[str, list[tuple[int, float, int | None]]], colors: dict[str, Any],
                  unit_of: dict[str, str], data_top: float, last_step: int) -> bool:
    """The loop's cuts as dotted vertical lines; their labels horizontal, stacked in a band above the data
    (the y limit leaves room for them): no text across the curves. True when any was drawn."""
    cuts = sorted((step, factor, restored, run) for run, per_run in lr_cuts.items() if run in unit_of
                  for step, factor, restored in per_run)
    labels = [f"scale_lr x{factor:g}" + (f", weights of step {restored}" if restored is not None else "")
              for _, factor, restored, _ in cuts]
    shown = labels if len(labels) <= MAX_CUT_LABELS else [f"{len(labels)} scale_lr cuts (dotted lines)"]
    line = 0.065
    ax.set_ylim(-1, min(102 + 100 * line * len(shown), data_top / (1 - line * len(shown) - 0.02)))
    for step, _, _, run in cuts:
        ax.axvline(step, color=colors[unit_of[run]], ls=":", lw=1.6)
    for i, label in enumerate(shown):
        step, _, _, run = cuts[min(i, len(cuts) - 1)]
        right = len(shown) == len(labels) and step > last_step / 2
        x, xcoords = (step, "data") if len(shown) == len(labels) else (0.01, "axes fraction")
        ax.annotate(label, (x, 0.98 - line * i), xycoords=(xcoords, "axes fraction"), va="top",
                    ha="right" if right else "left", fontsize=7, zorder=5,
                    color=colors[unit_of[run]] if len(shown) == len(labels) else "black",
                    xytext=(-3 if right else 3, 0), textcoords="offset points")
    return bool(cuts)


def _detail_families(details: dict[str, dict[str, list[tuple[int, dict[str, float]]]]]) -> list[str]:
    names = {n for per_run in details.values() for pts in per_run.values() for _, m in pts for n in m}
    order = {"pass": 0, "maj": 1, "greedy_accuracy": 2}
    return sorted({_family(n) for n in names}, key=lambda f: (order.get(f, 3), f))


_FAMILY_TITLE = {"pass": "pass@k: some sample right", "maj": "maj@k: the majority answer right",
                 "greedy_accuracy": "greedy accuracy"}
_K_STYLES = ("-", "--", "-.", ":")


def _family(name: str) -> str:
    return name.split("@")[0] if "@" in name else name


def _plot_family(ax: Any, dataset: str, family: str, details: dict[str, dict[str, list[tuple[int, dict[str, float]]]]],
                 units: dict[str, list[str]], colors: dict[str, Any]) -> None:
    """One metric family of each round's consensus (pass@K, maj@K, greedy accuracy): a line per run or group,
    one line style per K when a family has several."""
    per_run = details.get(dataset, {})
    names = sorted({n for pts in per_run.values() for _, m in pts for n in m if _family(n) == family})
    top = 0.0
    for unit, members in sorted(units.items()):
        for k, name in enumerate(names):
            series = [[(step, 100 * m[name]) for step, m in per_run.get(r, []) if name in m] for r in members]
            series = [s for s in series if s]
            if series:
                top = max(top, max(v for s in series for _, v in s))
                steps, mean, low, high = band(series)
                if len(series) > 1:
                    ax.fill_between(steps, low, high, color=colors[unit], alpha=0.18, lw=0)
                ax.plot(steps, mean, ls=_K_STYLES[k % len(_K_STYLES)], marker=".", color=colors[unit], lw=1.8,
                        label=name if unit == min(units) and len(names) > 1 else None)
    ax.set_title(f"{dataset}: {_FAMILY_TITLE.get(family, family)}" + (f" ({', '.join(names)})" if names and names != [family] else ""))
    ax.set_ylabel("share of prompts (%)")
    ax.set_ylim(-1, min(102, max(10.0, top * 1.15)))
    if len(names) > 1:
        ax.legend(fontsize=7, loc="upper left")
    if not ax.lines:
        ax.text(0.5, 0.5, f"no {family} stored for {dataset}", ha="center", va="center", transform=ax.transAxes,
                color="gray")


def _save_with_legend(fig: Any, path: Path, handles: list[Any], title: str) -> Path:
    """A figure-wide legend below the panels, in as many columns as its width holds (nothing clipped)."""
    width, height = (min(a, b) for a, b in zip(fig.get_size_inches(), MAX_FIGURE_INCHES))
    fig.set_size_inches(width, height)
    ncol = max(1, min(len(handles), int(width / LEGEND_COLUMN_INCHES)))
    legend_rows = -(-len(handles) // ncol)
    fig.legend(handles=handles, loc="lower center", ncol=ncol, frameon=False, fontsize=8)
    return _save(fig, path, title, bottom=min(0.4, (legend_rows * 0.19 + 0.1) / height))


LEGEND_COLUMN_INCHES = 3.3  # a legend entry of about 40 characters at 8 points, with its handle


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
    has_smooth = any(smooth.get(r) for runs in groups.values() for r in runs)  # no empty panel without the worker
    panels = 1 + has_smooth + bool(by_tokens)
    fig, axes = plt.subplots(1, panels, figsize=(max(8.0, 7 * panels), 5), sharey=True, squeeze=False)
    axes = list(axes[0])
    ax_raw = axes[0]
    ax_smooth = axes[1] if has_smooth else None
    ax_tokens = axes[-1] if by_tokens else None
    for group, runs in sorted(groups.items()):
        label = f"{group} ({len(runs)} run{'s' if len(runs) > 1 else ''})" if grouped else group
        raws = [moving_average_series(raw[r], 5) for r in runs if raw.get(r)]
        if raws:
            steps, mean, lo, hi = band(raws)
            if len(raws) > 1:
                ax_raw.fill_between(steps, lo, hi, color=colors[group], alpha=0.2, lw=0)
            ax_raw.plot(steps, mean, color=colors[group], lw=2, label=label)
        smooths = [[(s, avg) for s, avg, _, _ in smooth[r]] for r in runs if smooth.get(r)]
        if smooths and ax_smooth is not None:
            steps, mean, lo, hi = band(smooths)
            if len(smooths) > 1:
                ax_smooth.fill_between(steps, lo, hi, color=colors[group], alpha=0.2, lw=0)
            ax_smooth.plot(steps, mean, color=colors[group], lw=2.2, label=label)
        for i, run in enumerate(r for r in runs if r in by_tokens):
            at_step = dict(by_tokens[run])
            points = [(at_step[s], v) for s, v in moving_average_series(raw[run], 5) if s in at_step]
            ax_tokens.plot([t for t, _ in points], [v for _, v in points], color=colors[group], lw=1.4,
                           label=label if i == 0 else None)
    ax_raw.set_title("Reward (mean over ranks, 5-step average)"
                     + (": mean over seeds, band 95% t-interval" if grouped else ""))
    if ax_smooth is not None:
        ax_smooth.set_title("Smoothed reward (stream worker's sliding average)"
                            + (": mean, band 95% t-interval" if grouped else ""))
        ax_smooth.set_xlabel("training step")
    ax_raw.set_xlabel("training step")
    if ax_tokens is not None:
        ax_tokens.set_title("Reward against generated tokens (5-step average, one line per run)")
        ax_tokens.set_xlabel("generated tokens, summed over ranks")
    for ax in axes:
        _style(ax)
    ax_raw.set_ylabel(reward_label(info, [r for runs in groups.values() for r in runs]))
    handles = [line for line in ax_raw.lines if not line.get_label().startswith("_")]  # one legend, below the panels
    return _save_with_legend(fig, path, handles, "Reward of the strategies side by side" if grouped else "Reward per run")


def moving_average_series(points: list[tuple[int, float]], n: int) -> list[tuple[int, float]]:
    steps = [s for s, _ in points]
    return list(zip(steps, moving_average([v for _, v in points], n)))


# ------------------------------------------------------------------ figure 3


def plot_throughput(series: dict[tuple[str, str], list[tuple[int, float]]], info: dict[str, Any], path: Path) -> Path:
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    runs = sorted({run for run, _ in series})
    colors = _colors(runs)
    styles = ["-", "--", ":", "-."]
    sizes = {run for run in info if tagged(info, run, "model_size") and any(r == run for r, _ in series)}
    ranks = len(scaling_rows(series, info)) > 1  # one rank count: nothing to compare, no panel
    ratios = [3] + [2] * (ranks + bool(sizes))
    fig, axes = plt.subplots(1, len(ratios), figsize=(5 + 5 * len(ratios), 7.0), squeeze=False,
                             gridspec_kw={"width_ratios": ratios})
    axes = list(axes[0])
    ax_line = axes[0]
    keys = sorted(series)
    for run, node in keys:
        nodes = sorted(n for r, n in keys if r == run)
        steps, values = zip(*series[(run, node)])
        ax_line.plot(steps, moving_average(values, SMOOTH_STEPS), color=colors[run],
                     ls=styles[nodes.index(node) % len(styles)], lw=1.4)
    ax_line.set_title(f"Per node, over training ({SMOOTH_STEPS}-step moving average): a colour per run, "
                      "a line style per node of the run")
    ax_line.set_xlabel("training step")
    ax_line.set_ylabel("generated tokens / s")
    ax_line.set_ylim(bottom=0)
    most_nodes = max(len({n for r, n in keys if r == run}) for run in runs)
    handles = [Line2D([], [], color=colors[r], lw=2, label=r) for r in runs]
    handles += [Line2D([], [], color="gray", ls=styles[i % len(styles)], label=f"node {i + 1} of a run")
                for i in range(min(most_nodes, len(styles)))] if most_nodes > 1 else []
    ax_line.legend(handles=handles, fontsize=7, ncol=max(1, min(4, -(-len(handles) // 4))), frameon=False,
                   loc="upper center", bbox_to_anchor=(0.5, -0.13))  # below the panel: never on the data
    _style(ax_line)
    if ranks:
        _scaling_bars(axes[1], series, info)
    if sizes:
        _size_bars(axes[-1], series, info, sizes)
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


SCALING_MIN_RUNS, SCALING_MIN_STEPS = 2, 10  # a rank count is compared with at least this many runs of as many steps


@dataclass(frozen=True)
class ScalingRow:
    """One rank count of the scaling panel: each run's tokens/s (summed over its ranks, mean over its steps)."""

    world: int
    run_means: tuple[float, ...]
    steps: tuple[int, ...]  # steps behind each run's mean
    mean: float
    ci_low: float | None  # the 95 % t-interval over the runs; None below SCALING_MIN_RUNS
    ci_high: float | None
    enough: bool  # SCALING_MIN_RUNS runs of SCALING_MIN_STEPS steps or more: comparable with the others


def scaling_rows(series: dict[tuple[str, str], list[tuple[int, float]]], info: dict[str, Any]) -> list[ScalingRow]:
    """Total tokens/s across a run's ranks (mean over steps), by the run's rank count.

    Runs tagged `scaling` (the demo's one-at-a-time runs) are compared alone when there are any:
    runs that shared the cores with others would not compare."""
    from areal_metrics.producers.contract.statistics import t_interval

    scaling = {run for run in info if tagged(info, run, "scaling")}
    totals: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for (run, _node), points in series.items():
        if scaling and run not in scaling:
            continue
        for step, value in points:
            totals[run][step] += value
    by_world: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for run, steps in sorted(totals.items()):
        by_world[info[run].world_size if run in info else 1].append((sum(steps.values()) / len(steps), len(steps)))
    rows = []
    for world, runs in sorted(by_world.items()):
        interval = t_interval([m for m, _ in runs])
        rows.append(ScalingRow(world, tuple(m for m, _ in runs), tuple(n for _, n in runs), interval.mean,
                               interval.ci_low, interval.ci_high,
                               len(runs) >= SCALING_MIN_RUNS and min(n for _, n in runs) >= SCALING_MIN_STEPS))
    return rows


def _scaling_bars(ax: Any, series: dict[tuple[str, str], list[tuple[int, float]]], info: dict[str, Any]) -> None:
    """Tokens/s by rank count: a bar with its 95 % t-interval over runs where there are enough runs and steps
    to compare, else a hatched bar marked "too few to compare"; each run's own mean as a dot; rank counts
    above this machine's cores marked (their ranks share cores: no scaling to read there)."""
    from matplotlib.patches import Patch

    rows = scaling_rows(series, info)
    cores = os.cpu_count() or 1
    for i, row in enumerate(rows):
        if row.enough:
            ax.bar(i, row.mean, color="tab:blue", alpha=0.8,
                   yerr=[[row.mean - row.ci_low], [row.ci_high - row.mean]] if row.ci_low is not None else None,
                   capsize=5, ecolor="black")
        else:
            ax.bar(i, row.mean, facecolor="none", edgecolor="gray", hatch="//", lw=1)
        ax.scatter([i] * len(row.run_means), row.run_means, color="black", s=14, zorder=5)
        ax.annotate(f"{row.mean:.0f}", (i, row.mean), xytext=(0, 3), textcoords="offset points", ha="center",
                    fontsize=8)
    ax.set_xticks(range(len(rows)), [f"{r.world} rank{'s' if r.world > 1 else ''}\n{len(r.run_means)} "
                                     f"run{'s' if len(r.run_means) > 1 else ''}, {min(r.steps)}"
                                     + (f"-{max(r.steps)}" if max(r.steps) > min(r.steps) else "") + " steps"
                                     + (f"\n> {cores} cores" if r.world > cores else "") for r in rows], fontsize=8)
    few = [r for r in rows if not r.enough]
    over = [r.world for r in rows if r.world > cores]
    scaling = any(tagged(info, run, "scaling") for run in info)
    ax.set_title(f"Across rank counts (mean over steps; {'runs tagged scaling' if scaling else 'every run'})"
                 + (f". Too few to compare (hatched): fewer than {SCALING_MIN_RUNS} runs of "
                    f"{SCALING_MIN_STEPS}+ steps" if few else "; bars: 95% t-interval over runs")
                 + (f". {', '.join(map(str, over))} ranks exceed this machine's {cores} cores: they share them"
                    if over else ""), fontsize=10)
    ax.set_ylabel("generated tokens / s, summed over ranks")
    ax.set_ylim(0, max((max(r.run_means + ((r.ci_high,) if r.ci_high else ())) for r in rows), default=1) * 1.15)
    handles = [Patch(color="tab:blue", alpha=0.8, label="comparable: mean, 95% t-interval")] if len(few) < len(rows) \
        else []
    handles += [Patch(facecolor="none", edgecolor="gray", hatch="//", label="too few to compare")] if few else []
    ax.legend(handles=handles + [ax.scatter([], [], color="black", s=14, label="a run")], fontsize=8,
              loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    _style(ax)


# --------------------------------------------------------------- wrong answers


FEW_RUNS_SHARE = 0.5  # a round of fewer runs than this share of the fullest round's is drawn faded and hatched


def plot_errors(errors: dict[str, dict[str, dict[str, float]]], path: Path,
                by_round: dict[str, dict[int, dict[str, float]]] | None = None,
                runs_by_round: dict[str, dict[int, int]] | None = None) -> Path:
    """Wrong answers by error type per run; with `by_round` (dataset -> step -> type -> count) a second row:
    the same shares per evaluation round, so a trend over training shows. `runs_by_round` (dataset -> step ->
    runs): each round's bar says how many runs it pools, and a round of fewer than half the fullest round's
    runs is drawn faded and hatched (it reads as one run's noise, not the trend)."""
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
            counts = [(runs_by_round or {}).get(dataset, {}).get(s) for s in steps]
            most = max((c for c in counts if c), default=0)
            few = [bool(c) and c < FEW_RUNS_SHARE * most for c in counts]
            _stacked_shares(ax, [by_round[dataset][s] for s in steps], kinds, colors, few)
            ax.set_xticks(range(len(steps)), [str(s) + (f"\n{c} run{'s' if c > 1 else ''}" if c else "")
                                              for s, c in zip(steps, counts)], fontsize=7)
            ax.set_xlabel("evaluation round (training step) and the runs it pools")
            ax.set_title(f"{dataset}: error types per round, pooled over runs"
                         + (f" (faded, hatched: under {FEW_RUNS_SHARE:.0%} of the fullest round's {most} runs)"
                            if any(few) else ""))
    handles = axes[0][0].get_legend_handles_labels()[0]  # one entry per error type, below the panels
    return _save_with_legend(fig, path, handles, "Why answers were wrong (full-stage evaluations, by error type)")


def _stacked_shares(ax: Any, groups: Sequence[dict[str, float]], kinds: Sequence[str], colors: dict[str, Any],
                    faded: Sequence[bool] = ()) -> None:
    """One bar per group: each error type's share of the group's wrong answers; `faded` groups light and hatched."""
    bottoms = [0.0] * len(groups)
    totals = [sum(g.values()) or 1.0 for g in groups]
    faded = list(faded) or [False] * len(groups)
    for kind in kinds:
        shares = [100 * g.get(kind, 0.0) / t for g, t in zip(groups, totals)]
        bars = ax.bar(range(len(groups)), shares, bottom=bottoms, color=colors[kind], label=kind)
        for bar, light in zip(bars, faded):
            if light:
                bar.set_alpha(0.35)
                bar.set_hatch("..")
        bottoms = [b + s for b, s in zip(bottoms, shares)]
    ax.set_ylim(0, 100)
    ax.set_ylabel("share of wrong answers (%)")
    _style(ax)


# ----------------------------------------------------------------- configs


def config_table(info: dict[str, Any]) -> tuple[list[str], list[str], list[list[str]]]:
    """(keys, runs, cells): the config keys that differ between the runs and the always-shown ones, then
    every `summary.<key>` of the runs' `run.summary` (their results: shown equal or not) and `notes`."""
    runs = sorted(info)
    configs = {r: {**info[r].config, "world_size": info[r].world_size} for r in runs}
    keys = sorted({k for c in configs.values() for k, v in c.items() if not isinstance(v, (dict, list))})
    differing = [k for k in keys if len({repr(configs[r].get(k)) for r in runs}) > 1]
    shown = [k for k in CONFIG_KEYS if k in keys] + [k for k in differing if k not in CONFIG_KEYS]
    cells = [[_cell(configs[r].get(k)) for r in runs] for k in shown]
    summaries = {r: getattr(info[r], "summary", None) or {} for r in runs}  # RunInfo, or alike
    summary_keys = sorted({k for s in summaries.values() for k, v in s.items() if not isinstance(v, (dict, list))})
    cells += [[_cell(summaries[r].get(k)) for r in runs] for k in summary_keys]
    shown += [f"summary.{k}" for k in summary_keys]
    notes = {r: getattr(info[r], "notes", None) for r in runs}
    if any(notes.values()):
        shown.append("notes")
        cells.append([_cell(notes[r]) for r in runs])
    return shown, runs, cells


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:g}" if isinstance(value, float) else str(value)


CONFIG_ROWS_MAX, CONFIG_RUNS_MAX, CELL_CHARS = 40, 12, 24  # the table stays readable and its figure bounded


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
    note = f" ({', '.join(left_out)} not shown: see `areal-metrics sql 'SELECT run_id, config, summary, notes FROM v_runs'`)" if left_out else ""
    return _save(fig, path, "Compared runs: config side by side (settings that differ, and the main ones), then run.summary and notes" + note)


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
    ax.set_title(f"{key}: mean over ranks per step" + (", mean over each group's runs, band 95% t-interval" if grouped else ""))
    ax.set_xlabel("training step")
    ax.set_ylabel(key)
    _style(ax)
    ax.legend(fontsize=8, loc="best", ncol=1 + len(groups) // 12)
    return _save(fig, path, f"{key} per {'group' if grouped else 'run'}")
