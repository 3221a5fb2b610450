"""clickhouse-go v2 (the driver inside Grafana's ClickHouse data source) over the holder's HTTP endpoint.

`tests/go/chgo` is a small Go program on clickhouse-go v2, configured as the
Grafana data source configures it (database/sql, protocol HTTP, gzip). The
test builds it (GOFLAGS=-mod=mod: modules from the Go module proxy, cached in
GOMODCACHE, by default ~/go/pkg/mod, and GOCACHE; a warm rebuild takes seconds,
the first one minutes), gives it the DSN and a JSON file of queries, and
compares what it read with what clickhouse-connect reads through the same
endpoint: column names, row counts, every value.

The queries are every dashboard panel's, variable's and annotation's SQL,
expanded as Grafana expands it (areal_metrics.grafana.queries / areal_metrics.grafana.macros), on the
recorded demo run; plus the steps table and a CREATE TABLE through the DSN
that `areal-metrics status --json` prints while a real stack runs.
Skipped, saying so, only where `go` is not installed. AREAL_TEST_CLICKHOUSE_GO=v2.40.1
(the release inside the Grafana plugin 4.10.2 that compose pins) builds against another
clickhouse-go release (`go mod edit` + `go mod tidy` in a copy of the module).
"""

from __future__ import annotations

import datetime as dt
import decimal
import ipaddress
import json
import math
import os
import shutil
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import clickhouse_connect
import pytest

from areal_metrics.grafana.catalog import BUILDERS, build
from areal_metrics.grafana.macros import expand
from areal_metrics.grafana.queries import (
    QueryRunner,
    context_for,
    dashboard_queries,
    expansions,
    resolve_variables,
)
from areal_metrics.sinks.query import DirectStore, Target
from tests.test_clickhouse_http import Served, served  # noqa: F401 - `served`: the demo store behind the endpoint
from tests.test_grafana_data import RUNS, fixture_events, fixture_span

pytestmark = pytest.mark.timeout(1200)
MODULE = Path(__file__).parent / "go" / "chgo"
GO_VERSION_ENV = "AREAL_TEST_CLICKHOUSE_GO"  # e.g. v2.40.1: build the program against that release instead


@pytest.fixture(scope="session")
def chgo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    go = shutil.which("go")
    if go is None:
        pytest.skip("the Go toolchain (`go`) is not installed: the clickhouse-go v2 checks need it")
    work = tmp_path_factory.mktemp("chgo")
    binary, module = work / "chgo", MODULE
    env = {**os.environ, "GOFLAGS": "-mod=mod"}
    steps = [[go, "build", "-o", str(binary), "."]]
    version = os.environ.get(GO_VERSION_ENV)
    if version:  # another clickhouse-go, e.g. the one inside a given Grafana plugin release
        module = shutil.copytree(MODULE, work / "module")
        steps[:0] = [[go, "mod", "edit", f"-require=github.com/ClickHouse/clickhouse-go/v2@{version}"], [go, "mod", "tidy"]]
    for step in steps:
        done = subprocess.run(step, cwd=module, env=env, capture_output=True, text=True, timeout=1100)
        assert done.returncode == 0, f"{' '.join(step)} in {module} failed:\n{done.stderr[-3000:]}"
    return binary


def run_go(chgo: Path, dsn: str, queries: list[dict[str, str]], tmp_path: Path) -> list[dict[str, Any]]:
    file = tmp_path / f"queries-{uuid.uuid4().hex[:6]}.json"
    file.write_text(json.dumps(queries))
    r = subprocess.run([str(chgo), "-dsn", dsn, "-queries", str(file)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert [x["name"] for x in out] == [q["name"] for q in queries]
    return out


# ------------------------------------------------------------- comparing


def normal(value: Any) -> Any:
    """A clickhouse-connect value as the Go program prints it (JSON; times in UTC RFC 3339)."""
    if isinstance(value, dt.datetime):
        value = value if value.tzinfo else value.replace(tzinfo=dt.UTC)
        text = value.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f").rstrip("0").rstrip(".")
        return text + "Z"
    if isinstance(value, dt.date):
        return value.isoformat() + "T00:00:00Z"
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return {math.inf: "+Inf", -math.inf: "-Inf"}.get(value, "NaN")
    if isinstance(value, decimal.Decimal):
        return format(value.normalize(), "f")  # as shopspring/decimal writes it: 1.5, 100
    if isinstance(value, (uuid.UUID, ipaddress.IPv4Address, ipaddress.IPv6Address)):
        return str(value)
    if isinstance(value, bytes):  # FixedString: clickhouse-go scans it into a string
        return value.decode("utf-8", "replace")
    if isinstance(value, (list, tuple)):
        return [normal(v) for v in value]
    if isinstance(value, dict):
        return {str(k): normal(v) for k, v in value.items()}
    return value


def same(go_value: Any, py_value: Any) -> bool:
    if isinstance(go_value, float) or isinstance(py_value, float):
        if isinstance(go_value, (int, float)) and isinstance(py_value, (int, float)):
            return math.isclose(go_value, py_value, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(go_value, list) and isinstance(py_value, list):
        return len(go_value) == len(py_value) and all(same(g, p) for g, p in zip(go_value, py_value))
    if isinstance(go_value, dict) and isinstance(py_value, dict):
        return go_value.keys() == py_value.keys() and all(same(go_value[k], py_value[k]) for k in go_value)
    return go_value == py_value


def differences(go: dict[str, Any], columns: list[str], rows: list[tuple[Any, ...]]) -> list[str]:
    out = []
    if go.get("error"):
        return [f"clickhouse-go error: {go['error']}"]
    if (go["columns"] or []) != columns and rows:
        out.append(f"columns {go['columns']} != {columns}")
    if len(go["rows"]) != len(rows):
        out.append(f"{len(go['rows'])} rows != {len(rows)}")
    for i, (g, p) in enumerate(zip(go["rows"], rows)):
        for name, gv, pv in zip(columns, g, p):
            if not same(gv, normal(pv)):
                out.append(f"row {i} column {name}: go {gv!r} != connect {normal(pv)!r}")
                break
        if len(out) > 3:
            break
    return out


# ------------------------------------------------------------ the panels


def reader_store(served: Served) -> DirectStore:
    return DirectStore(Target.parse(f"chdb://{served.server.path}"), served.client(), write=False)


def panel_queries(runner: QueryRunner) -> list[dict[str, Any]]:
    """Every query of every dashboard, expanded: all runs (All nodes, datasets), then one run, one node."""
    start, end = fixture_span(fixture_events())
    span = (start - timedelta(minutes=5), end + timedelta(minutes=5))
    picks = {
        "all": None,
        "one": lambda var, options: (RUNS[1],) if var == "run" else (options[0],),
    }
    out = []
    for name in BUILDERS:
        model = build(name)
        for label, choose in picks.items():
            ctx = resolve_variables(model, runner, context_for(*span), choose)
            for q in dashboard_queries(model):
                for scope, scoped in expansions(q, ctx):
                    sql = expand(q.sql, scoped)
                    assert "$" not in sql, sql
                    out.append({"name": f"{name}/{label} {q.where} {scope}".strip(), "sql": sql,
                                "expects": list(q.expects), "kind": q.kind})
    return out


def test_every_dashboard_query_reads_the_same_through_clickhouse_go(chgo: Path, served: Served,
                                                                     tmp_path: Path) -> None:
    store = reader_store(served)
    try:
        queries = panel_queries(QueryRunner.of_store(store))
        expected = {q["name"]: store.query(q["sql"]) for q in queries}
    finally:
        store.close()
    assert len(queries) > 80  # five dashboards, two variable choices, repeated panels
    results = run_go(chgo, served.server.dsn(), [{"name": q["name"], "sql": q["sql"]} for q in queries], tmp_path)
    problems = {}
    for q, go in zip(queries, results):
        mine = expected[q["name"]]
        found = differences(go, mine.columns, mine.rows)
        if not go["rows"] and q["name"].split("/")[1].startswith("all"):
            found.append("no rows")  # with every run selected each query has data in the demo run
        missing = [c for c in q["expects"] if go["rows"] and c not in go["columns"]]
        if missing:
            found.append(f"missing the panel's columns {missing}")
        if found:
            problems[q["name"]] = found + [q["sql"][:300]]
    assert not problems, json.dumps(problems, indent=1)[:6000]
    assert sum(len(r["rows"]) for r in results) > 1000


def test_types_and_errors_through_clickhouse_go(chgo: Path, served: Served, tmp_path: Path) -> None:
    queries = [
        {"name": "steps", "sql": "SELECT * FROM areal.steps FINAL ORDER BY run_id, step, rank LIMIT 300"},
        {"name": "evals", "sql": "SELECT * FROM areal.v_evals ORDER BY run_id, step, node, dataset"},
        {"name": "types", "sql": "SELECT NULL AS n, [1.5, 2] AS arr, toDecimal64(1.5, 3) AS d, "
                                 "CAST('a' AS Enum8('a' = 1)) AS e, toUUID('00000000-0000-0000-0000-000000000001') AS u, "
                                 "toLowCardinality(toNullable('q')) AS lcn, map('a', [1.5]) AS m, toIPv4('1.2.3.4') AS ip, "
                                 "toDate('2024-01-02') AS day, true AS b, toFixedString('ab', 3) AS fs, "
                                 "toDateTime64('2024-01-02 03:04:05.678', 3, 'UTC') AS t64 FROM numbers(3)"},
        {"name": "big", "sql": "SELECT number, toString(number) AS s FROM numbers(200000)"},
        {"name": "empty", "sql": "SELECT step FROM areal.steps WHERE 0"},
        {"name": "create", "sql": "CREATE TABLE areal.from_go (a UInt8) ENGINE = Memory"},
        {"name": "insert", "sql": "INSERT INTO areal.steps (event_id, run_id) VALUES ('x', 'y')"},
        {"name": "syntax", "sql": "SELEC 1"},
    ]
    out = {r["name"]: r for r in run_go(chgo, served.server.dsn(), queries, tmp_path)}
    store = reader_store(served)
    try:
        for name in ("steps", "evals", "types", "big"):
            mine = store.query(next(q["sql"] for q in queries if q["name"] == name))
            assert not differences(out[name], mine.columns, mine.rows), (name, differences(out[name], mine.columns, mine.rows))
    finally:
        store.close()
    assert len(out["big"]["rows"]) == 200000 and out["big"]["rows"][-1] == [199999, "199999"]
    assert out["empty"]["rows"] == [] and not out["empty"].get("error")
    assert out["create"]["code"] == 164 and "readonly" in out["create"]["error"]
    assert out["insert"]["code"] == 164
    assert out["syntax"]["code"] == 62
    writer = run_go(chgo, served.server.dsn("writer"), [{"name": "w", "sql": "SELECT getSetting('readonly')"}], tmp_path)
    assert writer[0]["rows"] == [["0"]] or writer[0]["rows"] == [[0]], writer


# ------------------------------------------------------- the stack running


def cli(*args: str, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "areal_metrics", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def wait_for_dsn(env: dict[str, str], timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        status = json.loads(cli("status", "--json", env=env).stdout)
        if status.get("clickhouse_http"):
            return status
        assert time.monotonic() < deadline, f"no clickhouse_http in status --json: {status}"
        time.sleep(1)


@pytest.mark.broker
def test_with_the_stack_running_the_status_dsn_reads_steps_and_cannot_create(chgo: Path, tmp_path: Path) -> None:
    """`up` (broker + sink holding the embedded store); only the DSN of `status --json` is handed on."""
    env = {**os.environ, "AREAL_HOME": str(tmp_path / "home"), "AREAL_TOPIC_PREFIX": "gohttp."}
    for name in ("AREAL_KAFKA_BOOTSTRAP", "AREAL_CLICKHOUSE_URL"):
        env.pop(name, None)
    try:
        up = cli("up", "--no-worker", env=env)
        assert up.returncode == 0, up.stderr
        status = wait_for_dsn(env)
        dsn = status["clickhouse_http"]
        assert dsn.startswith("http://reader:") and dsn.endswith("/areal") and "@127.0.0.1:" in dsn
        steps = "".join(json.dumps({"type": "step", "run_id": "live-go", "step": i, "epoch": 0, "reward": i / 10}) + "\n"
                        for i in range(25))
        published = subprocess.run([sys.executable, "-m", "areal_metrics", "publish", "--fill", "-"], input=steps,
                                   env={**env, "AREAL_KAFKA_BOOTSTRAP": status["kafka_bootstrap"]},
                                   capture_output=True, text=True, timeout=120)
        assert published.returncode == 0, published.stderr

        connect_client = clickhouse_connect.get_client(dsn=dsn)  # clickhouse-connect, from the DSN alone
        deadline = time.monotonic() + 90
        while connect_client.command("SELECT count() FROM steps FINAL WHERE run_id = 'live-go'") < 25:
            assert time.monotonic() < deadline, "the sink did not store the steps"
            time.sleep(0.5)
        rows = connect_client.query("SELECT step, reward FROM steps FINAL WHERE run_id = 'live-go' ORDER BY step").result_rows
        assert [r[0] for r in rows] == list(range(25))
        with pytest.raises(Exception) as refused:
            connect_client.command("CREATE TABLE areal.from_connect (a UInt8) ENGINE = Memory")
        assert getattr(refused.value, "code", None) == 164

        out = run_go(chgo, dsn, [
            {"name": "steps", "sql": "SELECT step, reward FROM steps FINAL WHERE run_id = 'live-go' ORDER BY step"},
            {"name": "create", "sql": "CREATE TABLE areal.from_go (a UInt8) ENGINE = Memory"},
        ], tmp_path)
        assert [r[0] for r in out[0]["rows"]] == list(range(25)) and out[0]["columns"] == ["step", "reward"]
        assert not differences(out[0], ["step", "reward"], rows)
        assert out[1]["code"] == 164
        assert connect_client.command("EXISTS TABLE areal.from_go") == 0
    finally:
        down = cli("down", env=env)
        assert down.returncode == 0, down.stderr


def test_every_alert_rules_query_reads_the_same_through_clickhouse_go(chgo: Path, served: Served,
                                                                       tmp_path: Path) -> None:
    """Grafana's alert rules (areal_metrics.grafana.alerting) as the plugin's backend runs them for the
    alerting engine: macros expanded over the recorded run's span, no dashboard variables."""
    from areal_metrics.grafana import alerting
    from areal_metrics.grafana.macros import expand_macros

    start, end = fixture_span(fixture_events())
    ctx = context_for(start - timedelta(minutes=5), end + timedelta(minutes=5))
    queries = [{"name": rule.uid, "sql": expand_macros(rule.sql, ctx)} for rule in alerting.rules()]
    assert all("$" not in q["sql"] for q in queries)
    store = reader_store(served)
    try:
        expected = {q["name"]: store.query(q["sql"]) for q in queries}
    finally:
        store.close()
    results = run_go(chgo, served.server.dsn(), queries, tmp_path)
    problems = {q["name"]: found for q, go in zip(queries, results)
                if (found := differences(go, expected[q["name"]].columns, expected[q["name"]].rows))}
    assert not problems, problems
    assert all(r["columns"][0] == "run_id" for r in results if r["rows"])
    # the recorded run raised eval_below_threshold alerts: that rule reads them through the driver too
    (evals,) = [r for q, r in zip(queries, results) if q["name"] == "areal-eval-below-threshold"]
    assert evals["rows"]
