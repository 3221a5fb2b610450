"""`areal-metrics report`: PNG figures drawn from ClickHouse holding a real recorded run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from areal_metrics.cli import main
from areal_metrics.errors import UserError
from areal_metrics.report import FILES, load_evals, load_rewards, load_throughput, moving_average, write_report
from sinks.query import DirectStore
from tests.test_grafana_data import RUNS, loaded_store

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DirectStore, Path]]:
    directory = tmp_path_factory.mktemp("report-store")
    with loaded_store(directory) as opened:
        yield opened, directory


def _image_size(path: Path) -> tuple[int, int]:
    import matplotlib.image

    height, width = matplotlib.image.imread(path).shape[:2]
    return width, height


def test_report_writes_the_three_figures(store: tuple[DirectStore, Path], tmp_path: Path) -> None:
    written = write_report(tmp_path / "out", None, store[0])
    assert [p.name for p in written] == list(FILES)
    for path in written:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 30_000, path  # a drawn figure, not an empty canvas
        width, height = _image_size(path)
        assert width >= 1200 and height >= 500


def test_figure_data_comes_from_the_store(store: tuple[DirectStore, Path]) -> None:
    where = "1"
    evals = load_evals(store[0], where)
    assert set(evals) == {"add_1digit", "add_2digit"}
    assert set(evals["add_1digit"]) == set(RUNS)
    g4 = evals["add_1digit"]["demo-g4"]
    assert [p.step for p in g4] == list(range(0, 201, 20))
    assert {p.state for p in g4} == {"ok", "stale"}  # the injected failure at step 100
    assert g4[-1].accuracy > g4[0].accuracy  # the policy learned
    raw, smooth = load_rewards(store[0], where)
    assert set(raw) == set(smooth) == set(RUNS)
    assert [s for s, _ in raw["demo-g2"]] == list(range(1, 201))
    assert all(len(v) == 200 for v in smooth.values())
    throughput = load_throughput(store[0], where)
    assert len(throughput) == 4 and all(len(v) == 200 for v in throughput.values())  # 2 runs x 2 nodes


def test_one_run_only(store: tuple[DirectStore, Path]) -> None:
    raw, smooth = load_rewards(store[0], "run_id IN ('demo-g4')")
    assert set(raw) == {"demo-g4"}


def test_cli(store: tuple[DirectStore, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("AREAL_CLICKHOUSE_URL", f"chdb://{store[1]}")
    out = tmp_path / "figures"
    assert main(["report", "--out", str(out), "--run", "demo-g2"]) == 0
    assert capsys.readouterr().out.split() == [str(out / f) for f in FILES]
    assert main(["report", "--out", str(out), "--run", "no-such-run"]) == 2
    assert "no training steps stored for runs no-such-run" in capsys.readouterr().err
    assert main(["report", "--out", str(out), "--run", "bad id;"]) == 2
    assert "a run id is 1..128 characters" in capsys.readouterr().err


def test_bad_run_ids_never_reach_sql() -> None:
    with pytest.raises(UserError):
        write_report(Path("unused"), ["x') OR 1=1 --"], store=object())


def test_moving_average() -> None:
    assert moving_average([2, 4, 6, 8], 2) == [2, 3, 5, 7]
    assert moving_average([1.0], 10) == [1.0]


def test_report_while_the_sink_holds_the_store(store: tuple[DirectStore, Path], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """During `demo` the running sink owns the chdb directory; the report asks its ClickHouse HTTP endpoint."""
    from clickhouse_connect.driver.httpclient import HttpClient

    from sinks.http_server import ClickHouseHTTPServer
    from sinks.query import connect

    url = f"chdb://{store[1]}"
    endpoint = ClickHouseHTTPServer(store[1], "areal")
    endpoint.publish()
    try:
        monkeypatch.setenv("AREAL_CLICKHOUSE_URL", url)
        with connect() as owner_store:
            assert isinstance(owner_store.client, HttpClient)
            written = write_report(tmp_path, ["demo-g4"], owner_store)
        assert [p.name for p in written] == list(FILES)
        evals = load_evals(owner_store, "run_id IN ('demo-g4')")
        assert {p.state for p in evals["add_1digit"]["demo-g4"]} == {"ok", "stale"}
    finally:
        endpoint.close()
