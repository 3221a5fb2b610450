"""The dashboards' JSON: up to date with the code, valid against the SDK's Grafana 11.6 types,
referencing only the provisioned datasource; the provisioning files and the API push agree."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from areal_metrics.cli import main
from areal_metrics.grafana.catalog import BUILDERS, all_models, dashboards_dir, render, repo_root, to_dict
from areal_metrics.grafana.clickhouse import DATASOURCE_UID, PLUGIN_ID
from areal_metrics.grafana.provision import (
    ENV,
    FOLDER_UID,
    ClickHouseServer,
    alerting_file,
    datasource,
    datasource_file,
    provider_file,
    push,
)
from areal_metrics.grafana.validate import problems

PROVISIONING = repo_root() / "grafana" / "provisioning"


def committed(name: str) -> dict[str, Any]:
    return json.loads((dashboards_dir() / f"{name}.json").read_text())


@pytest.mark.parametrize("name", list(BUILDERS))
def test_committed_json_is_what_the_code_builds(name: str) -> None:
    text = (dashboards_dir() / f"{name}.json").read_text()
    assert text == render(all_models()[name]), "run `python -m areal_metrics.grafana` and commit the result"


def test_no_stray_dashboard_files() -> None:
    assert sorted(p.stem for p in dashboards_dir().glob("*.json")) == sorted(BUILDERS)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_dashboard_validates_and_uses_only_the_provisioned_datasource(name: str) -> None:
    assert problems(committed(name)) == []


def test_validation_catches_schema_and_reference_mistakes() -> None:
    good = committed("training")

    def broken(change: Any) -> list[str]:
        data = copy.deepcopy(good)
        change(data)
        return problems(data)

    assert any("gridpos" in p and "dropped" in p for p in broken(lambda d: d["panels"][0].update(gridpos={})))
    assert any("dashboard.refresh" in p and "str" in p for p in broken(lambda d: d.update(refresh=5)))
    assert any("graphTooltip" in p for p in broken(lambda d: d.update(graphTooltip=7)))  # not a cursor sync mode
    assert any("gridPos.w" in p for p in broken(lambda d: d["panels"][0]["gridPos"].update(w="12")))
    assert any("not provisioned" in p for p in broken(lambda d: d["panels"][1].update(
        datasource={"type": PLUGIN_ID, "uid": "elsewhere"})))
    assert any("has type" in p for p in broken(lambda d: d["panels"][1]["targets"][0].update(
        datasource={"type": "prometheus", "uid": DATASOURCE_UID})))
    assert any("$nosuch" in p for p in broken(lambda d: d["panels"][1]["targets"][0].update(
        rawSql="SELECT 1 WHERE x = '$nosuch'")))
    assert any("unique" in p for p in broken(lambda d: d["panels"][1].update(id=d["panels"][0]["id"])))
    assert any("legend" in p or "options" in p for p in broken(lambda d: d["panels"][4]["options"].update(legendd={})))
    assert any("target.rawsql" in p for p in broken(lambda d: d["annotations"]["list"][1]["target"].update(rawsql="x")))


def test_issue_requirements_are_in_the_dashboards() -> None:
    boards = {name: to_dict(model) for name, model in all_models().items()}
    for name, board in boards.items():
        # each board's own variables: the explorer's metric keys, the evaluation board's generations filters
        own = {"explorer": ["metric"], "evaluation": ["gen_step", "verdict", "error_type"],
               "efficiency": ["ranks", "rank_raw_rows", "rank_coarse_rows"]}.get(name, [])
        assert [v["name"] for v in board["templating"]["list"]] == ["group", "tag", "run", "node", "dataset", *own], name
        assert board["refresh"] == "5s", name
        titles = [p["title"] for p in board["panels"]]
        assert len(titles) == len(set(titles)), name
        for panel in board["panels"]:
            assert panel.get("description"), (name, panel["title"])
            if panel["type"] in ("timeseries", "trend"):
                assert panel["fieldConfig"]["defaults"].get("unit"), (name, panel["title"])
    training = " ".join(p["title"] for p in boards["training"]["panels"])
    for words in ("Reward: raw, sliding average and EMA", "entropy", "KL", "Advantages", "Clip ratio", "Learning rate"):
        assert words.lower() in training.lower(), words
    assert "Commands" in [a["name"] for a in boards["training"]["annotations"]["list"]]
    evaluation = boards["evaluation"]
    two_axis = evaluation["panels"][0]
    assert two_axis["type"] == "trend" and two_axis["repeat"] == "dataset" and two_axis["options"]["xField"] == "step"
    right = [o for o in two_axis["fieldConfig"]["overrides"] if o["matcher"]["options"] == "response length"][0]
    assert {"id": "custom.axisPlacement", "value": "right"} in right["properties"]
    band = [p for p in evaluation["panels"] if "95% interval" in p["title"]][0]
    assert band["repeat"] == "run" and "ci_low" in band["targets"][0]["rawSql"]
    high = [o for o in band["fieldConfig"]["overrides"] if o["matcher"]["options"] == "95% high"][0]
    assert {"id": "custom.fillBelowTo", "value": "95% low"} in high["properties"]  # the band
    assert "stale" in json.dumps(evaluation["annotations"]) and "partial" in json.dumps(evaluation["annotations"])
    assert any(p["type"] == "trend" and "Reward by step" in p["title"] for p in boards["runs"]["panels"])
    runs = {p["title"]: p for p in boards["runs"]["panels"]}
    assert "v_runs" in runs["Run lifecycle"]["targets"][0]["rawSql"]
    assert runs["Config side by side"]["transformations"][0]["id"] == "groupingToMatrix"
    assert "v_runs" in boards["runs"]["templating"]["list"][2]["query"]["rawSql"]  # the run picker
    explorer = boards["explorer"]
    assert "mapKeys(metric_counts)" in explorer["templating"]["list"][5]["query"]["rawSql"]  # the keys logged, per step
    assert explorer["panels"][0]["type"] == "trend" and explorer["panels"][0]["repeat"] == "metric"
    assert any(p["title"] == "Generations" and "areal.v_generations" in p["targets"][0]["rawSql"]
               for p in evaluation["panels"])
    efficiency = " ".join(p["title"] for p in boards["efficiency"]["panels"])
    assert "Throughput per node and rank" in efficiency and "latency" in efficiency and "Memory" in efficiency
    assert "commands they caused" in boards["alerts"]["panels"][0]["title"]


# ----------------------------------------------------------------- provisioning


def test_provisioning_files_are_generated_and_committed() -> None:
    assert (PROVISIONING / "datasources" / "clickhouse.yaml").read_text() == datasource_file()
    assert (PROVISIONING / "dashboards" / "areal.yaml").read_text() == provider_file()
    assert (PROVISIONING / "alerting" / "areal.yaml").read_text() == alerting_file()


def test_provisioned_datasource_is_the_one_dashboards_reference() -> None:
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load((PROVISIONING / "datasources" / "clickhouse.yaml").read_text())
    (ds,) = doc["datasources"]
    assert ds["uid"] == DATASOURCE_UID and ds["type"] == PLUGIN_ID
    assert ds["jsonData"]["host"] == "${CLICKHOUSE_HOST}" and ds["secureJsonData"]["password"] == "${CLICKHOUSE_PASSWORD}"
    assert set(ENV.values()) <= {v.strip("${}") for v in [*ds["jsonData"].values(), *ds["secureJsonData"].values()]
                                 if isinstance(v, str)}
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "areal.yaml").read_text())["providers"]
    assert providers[0]["options"]["path"] == "/var/lib/grafana/dashboards/areal"
    # the API push sends the same datasource, with real values instead of ${VAR}
    pushed = datasource(ClickHouseServer.parse("http://areal:secret@clickhouse:8123/areal"))
    assert {k: v for k, v in pushed.items() if k not in ("jsonData", "secureJsonData")} == {
        k: v for k, v in ds.items() if k not in ("jsonData", "secureJsonData", "orgId", "editable", "version")}
    assert pushed["jsonData"] == {"host": "clickhouse", "port": 8123, "protocol": "http", "secure": False,
                                  "username": "areal", "defaultDatabase": "areal"}
    assert pushed["secureJsonData"] == {"password": "secret"}


def test_clickhouse_urls_for_grafana() -> None:
    native = ClickHouseServer.parse("clickhouse://u:p%40ss@ch.example:9000/metrics")
    assert (native.protocol, native.port, native.password, native.database) == ("native", 9000, "p@ss", "metrics")
    assert ClickHouseServer.parse("https://ch.example").port == 8443
    with pytest.raises(ValueError):
        ClickHouseServer.parse("chdb:///var/lib/areal")


class _NotFound(Exception):
    status_code = 404


class _RecordingGrafana:
    """Stands in for grafana_client.GrafanaApi: records calls; `existing` says what Grafana has."""

    def __init__(self, existing: set[str]) -> None:
        self.calls: list[tuple[str, Any]] = []
        outer = self

        class Part:
            def __init__(self, name: str) -> None:
                self.name = name

            def __getattr__(self, method: str) -> Any:
                def call(*args: Any, **kwargs: Any) -> dict[str, Any]:
                    outer.calls.append((f"{self.name}.{method}", args))
                    if method.startswith("get_") and self.name not in existing:
                        raise _NotFound()
                    return {}
                return call

        self.datasource, self.folder, self.dashboard = Part("datasource"), Part("folder"), Part("dashboard")
        self.alertingprovisioning = Part("alertingprovisioning")


def test_push_creates_then_updates() -> None:
    server = ClickHouseServer.parse("http://default:@clickhouse:8123")
    fresh = _RecordingGrafana(existing=set())
    pushed = push(fresh, server)
    assert (pushed.datasource, pushed.folder) == ("created", "created")
    names = [c[0] for c in fresh.calls]
    assert "datasource.create_datasource" in names and "folder.create_folder" in names
    uploads = [c[1][0] for c in fresh.calls if c[0] == "dashboard.update_dashboard"]
    assert [u["dashboard"]["uid"] for u in uploads] == [committed(n)["uid"] for n in BUILDERS]
    assert all(u["overwrite"] and u["folderUid"] == FOLDER_UID for u in uploads)
    assert uploads[0]["dashboard"] == {k: v for k, v in committed("training").items() if k != "id"}
    again = _RecordingGrafana(existing={"datasource", "folder"})
    assert push(again, server).datasource == "updated"
    assert ("datasource.update_datasource_by_uid", (DATASOURCE_UID, datasource(server))) in again.calls


def test_cli_generate_writes_the_committed_files_into_the_folder_named(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["grafana", "generate", "--out", str(tmp_path)]) == 0
    for name in BUILDERS:
        assert (tmp_path / "dashboards" / f"{name}.json").read_text() == (dashboards_dir() / f"{name}.json").read_text()
    committed_provisioning = dashboards_dir().parent / "provisioning"
    for path in committed_provisioning.rglob("*.yaml"):
        assert (tmp_path / "provisioning" / path.relative_to(committed_provisioning)).read_text() == path.read_text()
    assert sorted(p.name for p in (tmp_path / "provisioning").rglob("*.yaml")) == \
        sorted(p.name for p in committed_provisioning.rglob("*.yaml"))


def test_python_m_grafana_writes_into_the_out_folder(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "areal_metrics.grafana", "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=120, check=False, cwd=dashboards_dir().parents[1])
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (tmp_path / "dashboards").glob("*.json")) == sorted(f"{n}.json" for n in BUILDERS)
    assert (tmp_path / "provisioning" / "datasources" / "clickhouse.yaml").is_file()


def test_cli_provision_errors_are_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AREAL_CLICKHOUSE_URL", "chdb:///tmp/nowhere")
    monkeypatch.delenv("AREAL_GRAFANA_CLICKHOUSE_URL", raising=False)
    assert main(["grafana", "provision", "--url", "http://127.0.0.1:9"]) == 1  # no sink serves the embedded store
    assert "pass --clickhouse-url" in capsys.readouterr().err
    assert main(["grafana", "provision", "--url", "http://127.0.0.1:9", "--clickhouse-url", "http://d:@c:8123",
                 "--timeout", "2"]) == 1  # unreachable: 1, as the README says (it was 2)
    err = capsys.readouterr().err
    assert "cannot reach Grafana at http://127.0.0.1:9" in err and len(err.strip().splitlines()) == 1
