"""The verbs' errors as the README says them (issue 44, item 4).

- The sink's ClickHouse endpoint: a query with a syntax error is answered with an error that
  quotes the user's SQL, not the endpoint's `formatQuerySingleLine(...)` wrapper.
- The thin install (`pip install areal-metrics`, simulated by a meta-path blocker that makes
  every extra's module fail to import): each verb exits 2 with one line naming its extra.
- `grafana provision` to a Grafana that does not answer exits 1 (unreachable), not 2.
- `grafana check` on a plain user run: panels of columns nobody logged are "no data yet", not
  failures (exit 0); a query of the wrong shape still fails.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import time
import tomllib
from datetime import datetime, timezone
from pathlib import Path

import pytest

from areal_metrics.cli import VERBS
from areal_metrics.extras import EXTRA_OF, VERB_NEEDS, from_import_error
from areal_metrics.grafana.queries import DashboardQuery, Format, QueryRunner, check_query, context_for
from areal_metrics.stack.kafka_broker import free_port
from tests.support import ROOT
from tests.test_clickhouse_http import Served, served  # noqa: F401 - the module's fixture: the real endpoint


def test_a_syntax_error_quotes_the_users_query_not_the_wrapper(served: Served) -> None:  # noqa: F811
    r = served.http({"query": "SELEC 1\n"})
    text = r.data.decode()
    assert r.status == 400 and r.getheader("X-ClickHouse-Exception-Code") == "62", text
    assert "formatQuerySingleLine" not in text, text
    assert text.startswith("Code: 62. DB::Exception: Syntax error") and ": in query: SELEC 1 (version" in text, text


# ------------------------------------------------------------------ the thin install

# What `pip install areal-metrics` lacks: every module of the extras the verbs import.
BLOCKER = """
import sys
BLOCKED = {blocked!r}
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, Blocker())
from areal_metrics.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(("argv", "extra"), [
    (["report", "--out", "r"], "stack"),
    (["watch", "--duration", "1"], "stack"),
    (["grafana", "check"], "stack"),
    (["grafana", "provision", "--files", "g"], "stack"),
    (["grafana", "generate", "--out", "g"], "stack"),
    (["sql", "SELECT 1"], "stack"),
    (["compare", "a", "b"], "stack"),
    (["replay"], "stack"),
    (["train"], "train"),
    (["up"], "stack"),
])
def test_each_verb_of_the_thin_install_names_the_extra_it_needs(argv: list[str], extra: str, tmp_path: Path) -> None:
    """Exit 2, one line naming the extra and how to install it, no traceback (they died with
    ModuleNotFoundError tracebacks, or said "No module named 'clickhouse_connect'" alone)."""
    env = {**os.environ, "AREAL_HOME": str(tmp_path / "home"), "AREAL_KAFKA_BOOTSTRAP": "127.0.0.1:1"}
    env.pop("AREAL_CLICKHOUSE_URL", None)
    code = BLOCKER.format(blocked=sorted(EXTRA_OF))
    out = subprocess.run([sys.executable, "-c", code, *argv], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    [line] = out.stderr.splitlines()
    assert line.startswith(f"areal-metrics {argv[0]}: error: ") and f"`{extra}` extra" in line, line
    assert f"pip install 'areal-metrics[{extra}" in line, line


def test_a_module_missing_deeper_in_a_verb_names_its_extra_too() -> None:
    found = from_import_error(ModuleNotFoundError("No module named 'chdb'", name="chdb"), "sql")
    assert found is not None and found.exit_code == 2 and "`stack` extra (missing: chdb)" in str(found)
    assert from_import_error(ModuleNotFoundError("No module named 'nope'", name="nope"), "sql") is None  # a bug: raised


def test_each_module_named_is_in_the_extra_named() -> None:
    """EXTRA_OF against pyproject.toml: the distribution that installs each module is in that extra."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dists = importlib.metadata.packages_distributions()
    for module, extra in EXTRA_OF.items():
        wanted = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in extras[extra]}
        assert {d.lower().replace("_", "-") for d in dists[module]} & wanted, (module, extra)
    assert set(VERB_NEEDS) <= {*VERBS, *(f"grafana {a}" for a in ("provision", "generate", "check"))}


# ------------------------------------------------------------------ grafana


def test_grafana_provision_to_an_unreachable_grafana_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    from areal_metrics.cli import main

    url = f"http://127.0.0.1:{free_port()}"
    assert main(["grafana", "provision", "--url", url, "--clickhouse-url", "http://u:p@127.0.0.1:8123",
                 "--timeout", "5"]) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"areal-metrics grafana: error: cannot reach Grafana at {url}"), line


class _Runner(QueryRunner):
    def __init__(self, answers: dict[str, tuple[list[str], list[str], list[tuple]]]) -> None:
        super().__init__(lambda sql: answers[sql])


def test_an_empty_panel_is_no_data_yet_and_a_broken_one_a_failure() -> None:
    ctx = context_for(datetime(2026, 1, 1, tzinfo=timezone.utc), datetime(2026, 1, 2, tzinfo=timezone.utc))
    dt = "DateTime64(3, 'UTC')"
    answers = {"nothing": (["time", "kl"], [dt, "Float64"], []),
               "null kl": (["time", "kl"], [dt, "Nullable(Float64)"], [(datetime.now(), None)]),
               "data": (["time", "kl"], [dt, "Float64"], [(datetime.now(), 0.1)]),
               "wrong": (["time", "x"], [dt, "Float64"], [(datetime.now(), 0.1)])}
    outcomes = {sql: check_query(DashboardQuery(sql, sql, Format.TIME_SERIES, ("time", "kl"), "panel", numeric=("kl",)),
                                 _Runner(answers), ctx)[0] for sql in answers}
    assert {sql: (o.problem is None, o.empty) for sql, o in outcomes.items()} == {
        "nothing": (False, True), "null kl": (False, True), "data": (True, False), "wrong": (False, False)}


def test_grafana_check_on_a_plain_user_run_reports_no_data_yet_and_exits_0(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A run that logged a reward and a loss leaves most panels empty (no evaluations, no kl...): not failures."""
    from areal_metrics.cli import main
    from areal_metrics.producers.contract.events import RunEvent, StepEvent
    from tests.test_grafana_data import write_events

    now = time.time()
    events = [RunEvent(run_id="mine", status="running", ts=now - 60)]
    events += [StepEvent(run_id="mine", step=s, epoch=0, reward=0.1 * s, metrics={"my/loss": 1.0 / (s + 1)},
                         ts=now - 50 + s) for s in range(10)]
    write_events(tmp_path / "store", events)
    monkeypatch.setenv("AREAL_CLICKHOUSE_URL", f"chdb://{tmp_path / 'store'}")
    assert main(["grafana", "check", "--since", "1h"]) == 0
    captured = capsys.readouterr()
    assert "no data yet" in captured.out and "FAILED" not in captured.out, captured.out[-3000:]
    assert re.search(r"\d+ queries: [1-9]\d* with data, [1-9]\d* no data yet .*, 0 failed", captured.err), captured.err
