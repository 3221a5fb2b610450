"""`areal-metrics report`: PNG figures drawn from ClickHouse holding a real recorded workload.

The recording (tests/data/workload_events.jsonl, from tests/data/make_workload_events.py):
mt4-grpo and mt2-grpo, two seeds each, 2 ranks; 1- and 4-rank throughput runs; the
stream worker's derived events. Loaded through the sink's own code path.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import scipy.stats

from areal_metrics.cli import main
from areal_metrics.errors import UserError
from areal_metrics.analysis.report import (
    FILES,
    load_errors,
    load_evals,
    load_fingerprints,
    load_rewards,
    load_runs,
    load_throughput,
    write_report,
)
from areal_metrics.analysis.eval_details import CHANGES_FILE
from areal_metrics.analysis.figures import band, config_table, moving_average
from areal_metrics.producers.contract.events import Event, parse_event
from areal_metrics.sinks.query import DirectStore
from tests.test_grafana_data import loaded_store

RECORDING = Path(__file__).parent / "data" / "workload_events.jsonl"
STRATEGY_RUNS = ("wl-mt4-s1", "wl-mt4-s2", "wl-mt2-s1", "wl-mt2-s2")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def recorded() -> list[Event]:
    return [parse_event(line) for line in RECORDING.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DirectStore, Path]]:
    directory = tmp_path_factory.mktemp("report-store")
    with loaded_store(directory, recorded()) as opened:
        yield opened, directory


def _image_size(path: Path) -> tuple[int, int]:
    import matplotlib.image

    height, width = matplotlib.image.imread(path).shape[:2]
    return width, height


def test_report_writes_every_figure(store: tuple[DirectStore, Path], tmp_path: Path) -> None:
    written = write_report(tmp_path / "out", None, store[0])
    assert [p.name for p in written] == [*FILES, CHANGES_FILE]
    for path in written[:len(FILES)]:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 20_000, path  # a drawn figure, not an empty canvas
        width, height = _image_size(path)
        assert width >= 900 and height >= 300, path


def test_figure_data_comes_from_the_store(store: tuple[DirectStore, Path]) -> None:
    evals = load_evals(store[0], "1")
    assert set(evals) == {"math_id", "math_hard"}
    assert set(evals["math_id"]) == set(STRATEGY_RUNS)  # the throughput runs do not evaluate
    states = {p.state for p in evals["math_id"]["wl-mt4-s1"]}
    assert "stale" in states  # the failed third round: degraded mode repeated the last good result
    for run in STRATEGY_RUNS:
        assert [p.step for p in evals["math_hard"][run]][0] == 0
        assert all(p.response_length and p.response_length > 0 for p in evals["math_hard"][run])
    raw, smooth = load_rewards(store[0], "1")
    assert set(STRATEGY_RUNS) <= set(raw) and set(STRATEGY_RUNS) <= set(smooth)
    assert [s for s, _ in raw["wl-mt2-s1"]] == list(range(1, 21))
    info = load_runs(store[0], "1")
    assert {info[r].group for r in STRATEGY_RUNS} == {"mt4-grpo", "mt2-grpo"}
    assert (info["wl-tput-1r"].world_size, info["wl-tput-4r"].world_size, info["wl-mt4-s1"].world_size) == (1, 4, 2)
    assert info["wl-mt4-s1"].config["max_turns"] == 4
    throughput = load_throughput(store[0], "1")
    assert {run for run, _ in throughput} == {*STRATEGY_RUNS, "wl-tput-1r", "wl-tput-4r"}
    assert len([node for run, node in throughput if run == "wl-tput-4r"]) == 4
    errors = load_errors(store[0], "1")
    kinds = {k for per_run in errors.values() for counts in per_run.values() for k in counts}
    assert kinds == {"truncated", "format", "off_by_one", "carry", "arithmetic"}
    fingerprints = load_fingerprints(store[0], "1")
    for dataset in ("math_id", "math_hard"):  # both strategies evaluated the same sets
        assert len(set().union(*fingerprints[dataset].values())) == 1


def test_the_config_table_shows_what_differs(store: tuple[DirectStore, Path]) -> None:
    info = load_runs(store[0], "run_id IN ('wl-mt4-s1', 'wl-mt2-s2')")
    keys, runs, cells = config_table(info)
    assert runs == ["wl-mt2-s2", "wl-mt4-s1"]
    rows = dict(zip(keys, cells))
    assert rows["max_turns"] == ["2", "4"] and rows["seed"] == ["2", "1"] and rows["strategy"] == ["mt2-grpo", "mt4-grpo"]
    assert "lr" in rows  # always shown, equal or not


def test_one_run_only(store: tuple[DirectStore, Path]) -> None:
    raw, _ = load_rewards(store[0], "run_id IN ('wl-mt4-s2')")
    assert set(raw) == {"wl-mt4-s2"}


def test_cli(store: tuple[DirectStore, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("AREAL_CLICKHOUSE_URL", f"chdb://{store[1]}")
    out = tmp_path / "figures"
    assert main(["report", "--out", str(out), "--run", "wl-mt2-s1", "--run", "wl-mt4-s1"]) == 0
    assert capsys.readouterr().out.split() == [str(out / f) for f in (*FILES, CHANGES_FILE)]
    assert main(["report", "--out", str(out), "--run", "no-such-run"]) == 2
    assert "no training steps with a reward and no evaluation stored for runs no-such-run" in capsys.readouterr().err
    assert main(["report", "--out", str(out), "--run", "bad id;"]) == 2
    assert "a run id is 1..128 characters" in capsys.readouterr().err


def test_bad_run_ids_never_reach_sql() -> None:
    with pytest.raises(UserError):
        write_report(Path("unused"), ["x') OR 1=1 --"], store=object())


def test_moving_average_and_band() -> None:
    assert moving_average([2, 4, 6, 8], 2) == [2, 3, 5, 7]
    assert moving_average([1.0], 10) == [1.0]
    steps, mean, low, high = band([[(1, 0.0), (2, 1.0)], [(1, 1.0)]])
    assert (steps, mean) == ([1, 2], [0.5, 1.0])
    # two seeds: t(1) times the standard error, far wider than min..max
    half = scipy.stats.t.ppf(0.975, 1) * (0.5 ** 0.5) / (2 ** 0.5)
    assert abs(low[0] - (0.5 - half)) < 1e-9 and abs(high[0] - (0.5 + half)) < 1e-9
    assert (low[1], high[1]) == (1.0, 1.0)  # one seed: no interval to draw


def test_report_while_the_sink_holds_the_store(store: tuple[DirectStore, Path], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """During `demo` the running sink owns the chdb directory; the report asks its ClickHouse HTTP endpoint."""
    from clickhouse_connect.driver.httpclient import HttpClient

    from areal_metrics.sinks.http.server import ClickHouseHTTPServer
    from areal_metrics.sinks.query import connect

    url = f"chdb://{store[1]}"
    endpoint = ClickHouseHTTPServer(store[1], "areal")
    endpoint.publish()
    try:
        monkeypatch.setenv("AREAL_CLICKHOUSE_URL", url)
        with connect() as owner_store:
            assert isinstance(owner_store.client, HttpClient)
            written = write_report(tmp_path, ["wl-mt4-s1"], owner_store)
            assert [p.name for p in written] == [*FILES, CHANGES_FILE]
            assert "stale" in {p.state for p in load_evals(owner_store, "run_id IN ('wl-mt4-s1')")["math_id"]["wl-mt4-s1"]}
            assert load_errors(owner_store, "run_id IN ('wl-mt4-s1')")  # the Map column through the endpoint
    finally:
        endpoint.close()


@pytest.fixture
def kept(monkeypatch: pytest.MonkeyPatch) -> list:
    """The figures the report draws, kept open after they are saved (to measure what was drawn)."""
    import matplotlib.pyplot as plt

    figures: list = []
    monkeypatch.setattr(plt, "close", figures.append)
    return figures


def test_any_logged_key_is_drawn_per_run(store: tuple[DirectStore, Path], tmp_path: Path, kept: list) -> None:
    from areal_metrics.analysis.report import load_metric, metric_file

    written = write_report(tmp_path, ["wl-mt2-s1", "wl-mt4-s1"], store[0], metrics=["kl", "first_attempt_accuracy"])
    assert [p.name for p in written[-2:]] == [metric_file("kl"), metric_file("first_attempt_accuracy")]
    assert metric_file("actor/pg_loss") == "metric-actor_pg_loss.png"
    series = load_metric(store[0], "run_id IN ('wl-mt2-s1')", "first_attempt_accuracy")
    rows = store[0].query("SELECT step, avg(metrics['first_attempt_accuracy']) FROM v_steps "
                          "WHERE run_id = 'wl-mt2-s1' GROUP BY step ORDER BY step").rows
    assert series == {"wl-mt2-s1": [(int(s), float(v)) for s, v in rows]} and len(rows) == 20
    [metric_axes] = kept[-1].axes
    assert sorted(line.get_label() for line in metric_axes.lines) == ["wl-mt2-s1", "wl-mt4-s1"]  # one per run
    with pytest.raises(UserError, match="--metric 'no/such/key'"):
        write_report(tmp_path, None, store[0], metrics=["no/such/key"])


def test_reward_is_one_line_per_run_unless_grouped(store: tuple[DirectStore, Path], tmp_path: Path,
                                                   kept: list) -> None:
    from areal_metrics.analysis import figures as draw

    raw, smooth = load_rewards(store[0], "1")
    info = load_runs(store[0], "1")
    draw.plot_rewards(raw, smooth, info, tmp_path / "per-run.png")
    draw.plot_rewards(raw, smooth, info, tmp_path / "grouped.png", grouped=True)
    per_run, grouped = (sorted(line.get_label() for line in fig.axes[0].lines) for fig in kept)
    assert set(STRATEGY_RUNS) <= set(per_run) and per_run == sorted(set(raw) | set(smooth))
    assert {"mt2-grpo (2 runs)", "mt4-grpo (2 runs)"} <= set(grouped) and len(grouped) < len(per_run)


def test_reward_against_generated_tokens_is_a_third_panel_of_cumulative_sums(
        store: tuple[DirectStore, Path], tmp_path: Path, kept: list) -> None:
    from areal_metrics.analysis import figures as draw
    from areal_metrics.analysis.report import load_generated_tokens

    tokens = load_generated_tokens(store[0], "run_id = 'wl-mt4-s1'")
    rows = store[0].query("SELECT step, sum(tokens) FROM v_steps WHERE run_id = 'wl-mt4-s1' AND tokens IS NOT NULL "
                          "GROUP BY step ORDER BY step").rows
    assert rows and tokens["wl-mt4-s1"][-1] == (int(rows[-1][0]), float(sum(float(t) for _, t in rows)))
    assert all(a[1] < b[1] for a, b in zip(tokens["wl-mt4-s1"], tokens["wl-mt4-s1"][1:]))  # cumulative
    raw, smooth = load_rewards(store[0], "1")
    info = load_runs(store[0], "1")
    draw.plot_rewards(raw, smooth, info, tmp_path / "tokens.png", grouped=True,
                      tokens=load_generated_tokens(store[0], "1"))
    axes = kept[-1].axes
    assert len(axes) == 3 and axes[2].get_xlabel() == "generated tokens, summed over ranks"
    mt4 = [line for line in axes[2].lines if line.get_color() == axes[0].lines[
        [line.get_label() for line in axes[0].lines].index("mt4-grpo (2 runs)")].get_color()]
    assert len(mt4) == 2 and tokens["wl-mt4-s1"][-1][1] in {max(line.get_xdata()) for line in mt4}


def test_titles_are_whole_and_figures_bounded(store: tuple[DirectStore, Path], tmp_path: Path, kept: list) -> None:
    from types import SimpleNamespace

    from areal_metrics.analysis import figures as draw

    write_report(tmp_path / "out", None, store[0])
    one = load_evals(store[0], "1")["math_id"]  # one dataset: the narrowest figure 1 (its title was clipped)
    draw.plot_evals({"a_long_dataset_name_of_one_run": one}, tmp_path / "one.png")
    many = {f"run-{i:02d}": SimpleNamespace(world_size=1, config={f"key_{k}": f"{i}-{k}" for k in range(150)})
            for i in range(30)}
    path = draw.plot_configs(many, tmp_path / "config.png")
    width, height = _image_size(path)
    assert width <= draw.MAX_FIGURE_INCHES[0] * draw.DPI and height <= draw.MAX_FIGURE_INCHES[1] * draw.DPI
    for fig in kept:
        renderer = fig.canvas.get_renderer()
        box = fig.bbox
        for text in [ax.title for ax in fig.axes if ax.get_title()] + [fig._suptitle]:
            extent = text.get_window_extent(renderer)
            assert box.x0 - 1 <= extent.x0 and extent.x1 <= box.x1 + 1, text.get_text()
            assert extent.y1 <= box.y1 + 1, text.get_text()


def test_the_model_size_panel_orders_runs_by_parameters_and_sums_a_runs_nodes(tmp_path) -> None:
    from areal_metrics.analysis.report import RunInfo
    from areal_metrics.analysis.figures import plot_throughput, size_points

    info = {f"size-{w}": RunInfo(group="throughput", world_size=1,
                                 config={"tags": ["demo", "model_size"], "n_parameters": params})
            for w, params in ((256, 1_600_000), (64, 103_000), (128, 400_000))}
    info["tput-2r"] = RunInfo(group="throughput", world_size=2, config={"tags": ["demo", "scaling"]})
    series = {("size-64", "vm-r0"): [(0, 900.0), (1, 1100.0)], ("size-128", "vm-r0"): [(0, 600.0)],
              ("size-256", "vm-r0"): [(0, 200.0)], ("tput-2r", "vm-r0"): [(0, 500.0)],
              ("tput-2r", "vm-r1"): [(0, 450.0)]}
    sizes = {r for r in info if r.startswith("size-")}
    assert size_points(series, info, sizes) == [(103_000, 1000.0, 1), (400_000, 600.0, 1), (1_600_000, 200.0, 1)]
    two_nodes = {("size-64", "a"): [(0, 300.0)], ("size-64", "b"): [(0, 200.0)]}
    assert size_points(two_nodes, info, {"size-64"}) == [(103_000, 500.0, 1)]  # a run's nodes add up
    wide, narrow = tmp_path / "with.png", tmp_path / "without.png"
    plot_throughput(series, info, wide)
    plot_throughput({k: v for k, v in series.items() if not k[0].startswith("size-")}, info, narrow)
    from PIL import Image

    assert Image.open(wide).size[0] > Image.open(narrow).size[0]  # the third panel is there



def test_the_loops_scale_lr_is_marked_on_figure_1_at_the_step_it_applies_from(
        store: tuple[DirectStore, Path], tmp_path: Path, kept: list) -> None:
    from areal_metrics.analysis.report import load_lr_cuts

    cuts = load_lr_cuts(store[0], "1")
    rows = store[0].query("SELECT run_id, args FROM v_commands WHERE command = 'scale_lr' ORDER BY run_id, ts").rows
    assert rows and sum(len(v) for v in cuts.values()) == len(rows)
    assert cuts["wl-mt4-s1"][0] == (2, 0.5, None)  # args.from_step and args.factor of its first command, no rollback
    write_report(tmp_path, ["wl-mt4-s1"], store[0])
    figure = next(f for f in kept if f.axes and "full-stage accuracy" in f.axes[0].get_title())
    vertical = [line for line in figure.axes[0].lines if line.get_linestyle() == ":" and len(set(line.get_xdata())) == 1]
    assert sorted(line.get_xdata()[0] for line in vertical) == sorted(step for step, _, _ in cuts["wl-mt4-s1"])
    assert any(t.get_text() == "scale_lr x0.5" for t in figure.axes[0].texts)


def test_a_scale_lr_that_restores_weights_is_read_and_labelled_with_the_step(
        store: tuple[DirectStore, Path], tmp_path: Path, kept: list) -> None:
    from types import SimpleNamespace

    from areal_metrics.analysis.report import load_evals, load_lr_cuts
    from areal_metrics.analysis.figures import plot_evals

    rows = [("r", '{"factor": 0.1, "from_step": 12, "restore_step": 8}'), ("r", '{"factor": 2.0, "from_step": 20}'),
            ("r", '{"factor": 0.5}')]  # the last, sent by hand without its step: not drawn
    commands = SimpleNamespace(query=lambda sql, *a, **k: SimpleNamespace(rows=rows, result_rows=rows))
    assert load_lr_cuts(commands, "1") == {"r": [(12, 0.1, 8), (20, 2.0, None)]}
    plot_evals(load_evals(store[0], "run_id = 'wl-mt4-s1'"), tmp_path / "f.png", None,
               {"wl-mt4-s1": [(12, 0.1, 8), (20, 2.0, None)]})
    figure = next(f for f in kept if f.axes and "full-stage accuracy" in f.axes[0].get_title())
    labels = {t.get_text() for t in figure.axes[0].texts}
    assert {"scale_lr x0.1, weights of step 8", "scale_lr x2"} <= labels


def test_the_scale_lr_the_trainers_applied_is_marked_at_its_step_on_figure_1(
        store: tuple[DirectStore, Path], tmp_path: Path, kept: list) -> None:
    """`v_command_acks` (one command applied by two nodes at step 12, a second one at 20) -> a triangle per
    command at the foot of each accuracy panel; a store without the view gives no marks."""
    from types import SimpleNamespace

    from areal_metrics.analysis.report import load_evals, load_lr_applied
    from areal_metrics.analysis.figures import plot_evals

    rows = [("wl-mt4-s1", 12, 0.5), ("wl-mt4-s1", 20, 1.0)]
    acks = SimpleNamespace(query=lambda sql, *a, **k: SimpleNamespace(rows=rows))
    assert load_lr_applied(acks, "1") == {"wl-mt4-s1": [(12, 0.5), (20, 1.0)]}
    assert load_lr_applied(store[0], "1") == {}  # the workload store has no acknowledgements
    missing = SimpleNamespace(query=lambda sql, *a, **k: (_ for _ in ()).throw(RuntimeError("no v_command_acks")))
    assert load_lr_applied(missing, "1") == {}  # a store older than schema 8
    plot_evals(load_evals(store[0], "run_id = 'wl-mt4-s1'"), tmp_path / "f.png", None, None,
               lr_applied=load_lr_applied(acks, "1"))
    figure = next(f for f in kept if f.axes and "full-stage accuracy" in f.axes[0].get_title())
    marks = [line for line in figure.axes[0].lines if line.get_marker() == "^"]
    assert len(marks) == 1 and list(marks[0].get_xdata()) == [12, 20]
    assert any(t.get_text() == "scale_lr applied by the trainers (their ack)" for t in figure.legends[0].texts)
