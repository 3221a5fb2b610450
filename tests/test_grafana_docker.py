"""Real Grafana and real ClickHouse in containers: provisioning works, every panel gets data.

- ClickHouse server, loaded with the recorded real run through the sink's code path;
- Grafana 11.6 with the ClickHouse plugin and our provisioning mounted (files path):
  the datasource and the five dashboards appear;
- a second Grafana without provisioning, filled by `areal-metrics grafana provision`
  (the API path); then every panel query, expanded as the browser would, is sent to
  Grafana's /api/ds/query and must come back without error, with rows and the
  fields the panel reads.

Needs Docker (and the network, to pull images and the plugin); skipped elsewhere.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from base64 import b64encode
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from areal_metrics.grafana.catalog import BUILDERS, build, repo_root
from areal_metrics.grafana.clickhouse import DATASOURCE_UID, PLUGIN_ID, PLUGIN_VERSION, Format
from areal_metrics.grafana.macros import frontend
from areal_metrics.grafana.queries import QueryRunner, context_for, dashboard_queries, expansions, resolve_variables
from tests.test_grafana_data import fixture_events, fixture_span, load_events

pytestmark = [pytest.mark.docker, pytest.mark.timeout(900)]

GRAFANA_IMAGE = "grafana/grafana:11.6.0"
CLICKHOUSE_IMAGE = "clickhouse/clickhouse-server:24.8"
CH_USER, CH_PASSWORD = "areal", "areal"
LABEL_COLUMNS = {"run_id", "series", "worker", "kind"}  # become series labels in time-series frames


def _docker_or_skip() -> None:
    try:
        import docker

        docker.from_env().ping()
    except Exception as exc:  # noqa: BLE001 - any reason means: no Docker here
        pytest.skip(f"Docker is not available: {' '.join(str(exc).split())[:200]}")


@pytest.fixture(scope="module")
def stack() -> Iterator[dict[str, Any]]:
    _docker_or_skip()
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.network import Network

    with Network() as network:
        clickhouse = (
            DockerContainer(CLICKHOUSE_IMAGE)
            .with_network(network)
            .with_network_aliases("clickhouse")
            .with_envs(CLICKHOUSE_DB="areal", CLICKHOUSE_USER=CH_USER, CLICKHOUSE_PASSWORD=CH_PASSWORD,
                       CLICKHOUSE_DEFAULT_ACCESS_MANAGEMENT="1")
            .with_exposed_ports(8123)
        )
        common_env = {
            "GF_INSTALL_PLUGINS": f"{PLUGIN_ID} {PLUGIN_VERSION}",
            "GF_SECURITY_ADMIN_USER": "admin",
            "GF_SECURITY_ADMIN_PASSWORD": "admin",
            "CLICKHOUSE_HOST": "clickhouse",
            "CLICKHOUSE_PORT": "9000",
            "CLICKHOUSE_PROTOCOL": "native",
            "CLICKHOUSE_USER": CH_USER,
            "CLICKHOUSE_PASSWORD": CH_PASSWORD,
        }
        provisioned = (
            DockerContainer(GRAFANA_IMAGE)
            .with_network(network)
            .with_envs(**common_env)
            .with_volume_mapping(str(repo_root() / "grafana" / "provisioning"), "/etc/grafana/provisioning", "ro")
            .with_volume_mapping(str(repo_root() / "grafana" / "dashboards"), "/var/lib/grafana/dashboards/areal", "ro")
            .with_exposed_ports(3000)
        )
        bare = DockerContainer(GRAFANA_IMAGE).with_network(network).with_envs(**common_env).with_exposed_ports(3000)
        with clickhouse, provisioned, bare:
            host, port = clickhouse.get_container_host_ip(), clickhouse.get_exposed_port(8123)
            _wait(lambda: urllib.request.urlopen(f"http://{host}:{port}/ping", timeout=2))
            ch_url = f"http://{CH_USER}:{CH_PASSWORD}@{host}:{port}/areal"
            from areal_metrics.sinks.query import Target, open_client

            client = open_client(Target.parse(ch_url), readonly=False, use_database=False)
            load_events(client, fixture_events())
            yield {
                "clickhouse_client": client,
                "provisioned": f"http://{provisioned.get_container_host_ip()}:{provisioned.get_exposed_port(3000)}",
                "bare": f"http://{bare.get_container_host_ip()}:{bare.get_exposed_port(3000)}",
            }
            client.close()


def _wait(probe: Any, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            probe()
            return
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                raise
            time.sleep(2)


def _api(base: str, path: str, body: dict[str, Any] | None = None) -> Any:
    request = urllib.request.Request(
        base + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Basic " + b64encode(b"admin:admin").decode()},
        method="GET" if body is None else "POST",
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def _wait_for_grafana(base: str) -> None:
    _wait(lambda: _api(base, "/api/health"))
    _wait(lambda: _api(base, f"/api/plugins/{PLUGIN_ID}/settings"))


def test_provisioning_files_give_the_datasource_and_every_dashboard(stack: dict[str, Any]) -> None:
    base = stack["provisioned"]
    _wait_for_grafana(base)
    _wait(lambda: _api(base, f"/api/datasources/uid/{DATASOURCE_UID}"), timeout=60)
    ds = _api(base, f"/api/datasources/uid/{DATASOURCE_UID}")
    assert ds["type"] == PLUGIN_ID and ds["jsonData"]["host"] == "clickhouse"
    health = _api(base, f"/api/datasources/uid/{DATASOURCE_UID}/health")
    assert health["status"] == "OK", health
    for name in BUILDERS:
        uid = build(name).uid
        _wait(lambda: _api(base, f"/api/dashboards/uid/{uid}"), timeout=60)
        assert _api(base, f"/api/dashboards/uid/{uid}")["meta"]["provisioned"] is True


def test_cli_provision_then_every_panel_gets_data_from_grafana(stack: dict[str, Any]) -> None:
    from areal_metrics.cli import main

    base = stack["bare"]
    _wait_for_grafana(base)
    url = base.replace("http://", "http://admin:admin@")
    assert main(["grafana", "provision", "--url", url,
                 "--clickhouse-url", f"clickhouse://{CH_USER}:{CH_PASSWORD}@clickhouse:9000/areal"]) == 0
    assert main(["grafana", "provision", "--url", url,  # a second push updates in place
                 "--clickhouse-url", f"clickhouse://{CH_USER}:{CH_PASSWORD}@clickhouse:9000/areal"]) == 0

    start, end = fixture_span(fixture_events())
    start, end = start - timedelta(minutes=5), end + timedelta(minutes=5)
    client = stack["clickhouse_client"]

    def run(sql: str) -> tuple[list[str], list[str], list[tuple[Any, ...]]]:
        result = client.query(sql)
        return list(result.column_names), [t.name for t in result.column_types], list(result.result_rows)

    failures = []
    for name in BUILDERS:
        model = build(name)
        ctx = resolve_variables(model, QueryRunner(run), context_for(start, end))
        for q in dashboard_queries(model):
            if q.kind == "variable":
                continue
            for label, scoped in expansions(q, ctx):
                sql = frontend(q.sql, scoped)
                body = {
                    "from": str(int(start.timestamp() * 1000)),
                    "to": str(int(end.timestamp() * 1000)),
                    "queries": [{"refId": "A", "datasource": {"type": PLUGIN_ID, "uid": DATASOURCE_UID},
                                 "editorType": "sql", "rawSql": sql, "format": int(q.format),
                                 "intervalMs": int(scoped.interval / timedelta(milliseconds=1)),
                                 "maxDataPoints": 1000}],
                }
                try:
                    result = _api(base, "/api/ds/query", body)["results"]["A"]
                except urllib.error.HTTPError as exc:
                    failures.append(f"{name} {q.where} {label}: HTTP {exc.code} {exc.read()[:300]!r}")
                    continue
                problem = _frame_problem(q, result)
                if problem:
                    failures.append(f"{name} {q.where} {label}: {problem}\n{sql}")
    assert not failures, "\n\n".join(failures)


def _frame_problem(q: Any, result: dict[str, Any]) -> str | None:
    if result.get("error"):
        return f"error: {result['error']}"
    frames = result.get("frames") or []
    rows = sum(len((f.get("data") or {}).get("values", [[]])[0] or []) for f in frames)
    if rows == 0:
        return "no rows"
    names = {field["name"] for f in frames for field in f["schema"]["fields"]}
    wanted = set(q.expects)
    if q.format is Format.TIME_SERIES:
        wanted -= LABEL_COLUMNS  # long rows become one series per label value
    missing = wanted - names
    return f"missing fields {sorted(missing)}; got {sorted(names)}" if missing else None
