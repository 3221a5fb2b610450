"""The report speaks of the user's data (issue 44): labels from the runs' own config, no empty axes,
nothing clipped, and figures that a reader can read for the demo's nine runs and for a plain two-rank run.

The runs are built as events (tests/report_runs.py) and loaded through the sink's own path. Each
store is a chdb directory: one module, one store at a time (a process holds one embedded session)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from areal_metrics.analysis.report import load_runs, write_report
from areal_metrics.analysis.figures import DEFAULT_REWARD_LABEL, reward_label
from tests.report_runs import DEMO_LABEL, USER_RUN, demo_like, user_run
from tests.test_grafana_data import loaded_store


@pytest.fixture
def kept(monkeypatch: pytest.MonkeyPatch) -> list:
    """The figures the report draws, kept open after they are saved."""
    import matplotlib.pyplot as plt

    figures: list = []
    monkeypatch.setattr(plt, "close", figures.append)
    return figures


@pytest.fixture(scope="module")
def drawn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[Any]]]:
    """name -> the figures of the demo-like report (grouped, with the evaluation details) and of the user's run."""
    import matplotlib.pyplot as plt

    base = tmp_path_factory.mktemp("legible")
    out: dict[str, list[Any]] = {}
    close = plt.close
    for name, events, options in (("demo", demo_like(), {"grouped": True, "eval_details": True}),
                                  ("user", user_run(), {})):
        figures: list = []
        plt.close = figures.append  # type: ignore[assignment]
        try:
            with loaded_store(base / f"store-{name}", events) as store:
                write_report(base / name, None, store, **options)
                out[name + "-info"] = [load_runs(store, "1")]
        finally:
            plt.close = close  # type: ignore[assignment]
        out[name] = figures
    yield out
    for figures in out.values():
        for fig in figures:
            if hasattr(fig, "canvas"):
                close(fig)


def _figure(figures: list[Any], title: str) -> Any:
    return next(f for f in figures if f._suptitle is not None and title in f._suptitle.get_text())


def test_a_user_runs_reward_axis_reads_as_logged_the_workloads_its_own_label(drawn: dict[str, list[Any]]) -> None:
    user = _figure(drawn["user"], "Reward")
    assert user.axes[0].get_ylabel() == DEFAULT_REWARD_LABEL == "reward (as logged)"
    demo = _figure(drawn["demo"], "Reward")
    assert demo.axes[0].get_ylabel() == DEMO_LABEL  # from the runs' config.reward_label


def test_the_reward_label_is_the_runs_own_only_when_every_drawn_run_names_the_same() -> None:
    from areal_metrics.analysis.report import RunInfo

    info = {"a": RunInfo("a", 1, {"reward_label": "pass rate"}), "b": RunInfo("b", 1, {"reward_label": "pass rate"}),
            "c": RunInfo("c", 1, {"reward_label": "score"}), "d": RunInfo("d", 1, {})}
    assert reward_label(info, ["a", "b"]) == "pass rate"
    assert reward_label(info, ["a", "c"]) == reward_label(info, ["a", "d"]) == reward_label(info, ["x"]) \
        == DEFAULT_REWARD_LABEL


def test_the_workload_names_its_reward_in_the_run_config() -> None:
    from areal_metrics.areal_train import session

    assert session.REWARD_LABEL == DEMO_LABEL  # what the trainer's run_config carries as `reward_label`
    source = Path(session.__file__).read_text()
    assert '"reward_label": REWARD_LABEL' in source


def _outside(fig: Any) -> list[str]:
    """The texts and legends of a drawn figure whose window extent leaves the figure."""
    from matplotlib.legend import Legend
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    ticks = {id(t) for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)
             for tick in axis.get_major_ticks() + axis.get_minor_ticks() for t in (tick.label1, tick.label2)}
    drawn_ticks = [t for ax in fig.axes for axis in (ax.xaxis, ax.yaxis) 
                   if ax.axison and axis.get_visible() for tick in axis._update_ticks()
                   for t in (tick.label1, tick.label2)]  # the ticks inside the view: those matplotlib draws
    bad = []
    for artist in [a for a in fig.findobj(lambda a: isinstance(a, (Text, Legend))) if id(a) not in ticks] + drawn_ticks:
        if not artist.get_visible() or (isinstance(artist, Text) and not artist.get_text().strip()):
            continue
        extent = artist.get_window_extent(renderer)
        if not (box.x0 - 1 <= extent.x0 and extent.x1 <= box.x1 + 1 and box.y0 - 1 <= extent.y0
                and extent.y1 <= box.y1 + 1):
            bad.append(artist.get_text() if isinstance(artist, Text) else f"legend of {len(artist.texts)} entries")
    return bad


@pytest.mark.parametrize("name", ["demo", "user"])
def test_no_text_or_legend_leaves_its_figure(drawn: dict[str, list[Any]], name: str) -> None:
    assert len(drawn[name]) >= 4
    for fig in drawn[name]:
        assert _outside(fig) == [], fig._suptitle.get_text()


@pytest.mark.parametrize("name", ["demo", "user"])
def test_no_axes_is_empty(drawn: dict[str, list[Any]], name: str) -> None:
    for fig in drawn[name]:
        for ax in fig.axes:
            if ax.axison:  # the config table's axes is switched off
                assert ax.lines or ax.collections or ax.patches or ax.images, (fig._suptitle.get_text(),
                                                                                ax.get_title(), ax.get_ylabel())


def test_a_reward_outside_zero_one_keeps_its_band_and_no_worker_means_no_smoothed_panel(tmp_path: Path,
                                                                                        kept: list) -> None:
    from areal_metrics.analysis.report import RunInfo
    from areal_metrics.analysis.figures import plot_rewards

    raw = {"a": [(s, 2.0 + s) for s in range(6)], "b": [(s, 4.0 + s) for s in range(6)]}
    info = {r: RunInfo("g", 2, {}) for r in raw}
    plot_rewards(raw, {}, info, tmp_path / "r.png", grouped=True)
    [ax] = kept[-1].axes  # the raw reward alone: no "none stored" panel
    [band] = ax.collections
    lows = band.get_paths()[0].vertices[:, 1]
    assert lows.max() > 4.0 and lows.min() < 0.0  # a t-band over two seeds, not cut to [0, 1]


def _tput(runs: dict[str, tuple[int, int]]) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """run -> (ranks, steps): each rank 1000 / ranks tokens/s, a little noise by run."""
    return {(run, f"n{r}"): [(s, 1000.0 / ranks + (hash(run) % 7) + s % 3) for s in range(steps)]
            for run, (ranks, steps) in runs.items() for r in range(ranks)}


def test_rank_counts_are_compared_only_with_enough_runs_and_steps_and_with_intervals(tmp_path: Path,
                                                                                   kept: list) -> None:
    import os

    from areal_metrics.analysis.report import RunInfo
    from areal_metrics.analysis.figures import SCALING_MIN_STEPS, plot_throughput, scaling_rows
    from areal_metrics.producers.contract.statistics import t_interval

    demo = {"t1": (1, 4), "t2": (2, 4), "t4": (4, 4)}  # the demo's: one 4-step run per rank count
    info = {r: RunInfo("throughput", w, {"tags": ["scaling"]}) for r, (w, _) in demo.items()}
    rows = scaling_rows(_tput(demo), info)
    assert [r.world for r in rows] == [1, 2, 4] and not any(r.enough for r in rows)
    plot_throughput(_tput(demo), info, tmp_path / "demo.png")
    ax = kept[-1].axes[1]
    assert all(bar.get_hatch() == "//" for bar in ax.patches)  # drawn as "too few to compare"
    assert "Too few to compare" in ax.get_title()
    if os.cpu_count() and os.cpu_count() < 4:
        assert "exceed this machine's" in ax.get_title() and "> " in ax.get_xticklabels()[-1].get_text()

    enough = {f"a{w}-{i}": (w, SCALING_MIN_STEPS + 2) for w in (1, 2) for i in range(3)}
    info = {r: RunInfo("throughput", w, {}) for r, (w, _) in enough.items()}
    rows = scaling_rows(_tput(enough), info)
    assert all(r.enough for r in rows)
    expected = t_interval(list(rows[0].run_means))
    assert (rows[0].ci_low, rows[0].ci_high) == (expected.ci_low, expected.ci_high)
    plot_throughput(_tput(enough), info, tmp_path / "enough.png")
    ax = kept[-1].axes[1]
    assert [bar.get_hatch() for bar in ax.patches] == [None, None]
    from matplotlib.container import BarContainer

    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    assert len(bars) == 2 and all(c.errorbar is not None for c in bars)  # each with its t-interval

    plot_throughput(_tput({"one": (2, 30)}), {"one": RunInfo("one", 2, {})}, tmp_path / "one.png")
    assert len(kept[-1].axes) == 1  # one rank count: nothing to compare, no panel


def test_the_throughput_legend_is_below_its_panel_not_on_the_data(drawn: dict[str, list[Any]]) -> None:
    fig = _figure(drawn["demo"], "Throughput")
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent(renderer)
    assert legend.y1 <= ax.get_window_extent(renderer).y0  # under the axes, outside its data area
    assert len(ax.get_legend().texts) < len(ax.lines)  # runs and node styles, not one entry per line


def test_the_error_trend_says_how_many_runs_each_round_pools_and_fades_the_thin_rounds(
        drawn: dict[str, list[Any]]) -> None:
    fig = _figure(drawn["demo"], "Why answers were wrong")
    trend = [ax for ax in fig.axes if "error types per round" in ax.get_title()]
    assert len(trend) == 2
    for ax in trend:
        ticks = [t.get_text() for t in ax.get_xticklabels()]
        # the demo-like runs: 8 runs evaluate at 0, 8, ... 40; the vote run alone at 12 and 36 (and not at 8, 16, ...)
        assert ticks[:4] == ["0\n8 runs", "8\n7 runs", "12\n1 run", "16\n7 runs"]
        hatched = {round(bar.get_x() + bar.get_width() / 2) for bar in ax.patches if bar.get_hatch() == ".."}
        assert hatched == {ticks.index("12\n1 run"), ticks.index("36\n1 run")}


def test_figure_1_for_nine_runs_draws_a_line_per_group_in_small_multiples_and_no_rotated_text(
        drawn: dict[str, list[Any]]) -> None:
    fig = _figure(drawn["demo"], "Evaluation per dataset")
    groups = {i.group for i in drawn["demo-info"][0].values() if i.group != "throughput"}
    assert len(groups) == 4  # mt4-grpo and mt2-grpo (3 seeds each), vote, lr-regression: 8 runs that evaluate
    titles = [ax.get_title() for ax in fig.axes]
    for family in ("pass@k", "maj@k", "greedy accuracy", "mean response length", "full-stage accuracy"):
        assert sum(family in t for t in titles) == 2, family  # a panel per dataset, one family each
    for ax in fig.axes:
        data = [line for line in ax.lines if len(set(line.get_xdata())) > 1  # not the scale_lr verticals
                and line.get_linestyle() not in ("None", "")]  # nor the error bars' caps
        assert len(data) <= len(groups), ax.get_title()
        assert len({tuple(line.get_color()) if not isinstance(line.get_color(), str) else line.get_color()
                    for line in data}) == len(data)  # one colour per group in a panel: no style to tell apart
        assert all(t.get_rotation() == 0 for t in ax.texts)
    accuracy = next(ax for ax in fig.axes if "full-stage accuracy" in ax.get_title())
    assert len(accuracy.collections) >= 2  # the bands of the two 3-seed groups (fill_between)
    assert any(t.get_text() == "scale_lr x0.1, weights of step 8" for t in accuracy.texts)
