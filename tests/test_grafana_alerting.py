"""Grafana's alert rules and webhook contact point (`areal-metrics grafana provision`).

- every rule's SQL runs on the embedded store loaded through the sink's code path, expanded as
  the ClickHouse plugin's backend expands it for the alerting engine (macros only: an alert rule
  has no dashboard variables), and the rule's own threshold picks exactly the runs that should
  page: a running run silent past N minutes (not a finished one, not a busy one), the runs with a
  fresh alert of each kind (not an old one);
- `provision --url` sends its requests to a local HTTP server that records them (no Grafana
  here): the rule group and the contact point are checked against the shapes of Grafana's
  alerting provisioning API (AlertRuleGroup, ProvisionedAlertRule, AlertQuery,
  EmbeddedContactPoint, from Grafana 11's OpenAPI definitions: required fields, enums, uid
  pattern), created on a fresh Grafana and updated on the second push;
- the provisioning file says the same rules, with `$` escaped as Grafana's file provisioning wants.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from areal_metrics.cli import main
from areal_metrics.grafana import alerting
from areal_metrics.grafana.catalog import repo_root
from areal_metrics.grafana.macros import expand_macros
from areal_metrics.grafana.provision import FOLDER_UID, alerting_file
from areal_metrics.grafana.queries import QueryRunner, context_for
from areal_metrics.producers.contract.events import ALERT_KINDS, AlertEvent, Event, RunEvent, StepEvent
from tests.test_grafana_data import loaded_store

NOW = time.time()
STALL_MINUTES = 10.0


def _run(run_id: str, status: str, ts: float) -> RunEvent:
    return RunEvent(run_id=run_id, status=status, ts=ts, world_size=1)  # type: ignore[arg-type]


def _steps(run_id: str, last_ts: float, n: int = 3) -> list[StepEvent]:
    return [StepEvent(run_id=run_id, step=i + 1, epoch=0, reward=0.5, ts=last_ts - 60 * (n - 1 - i)) for i in range(n)]


def _events() -> list[Event]:
    events: list[Event] = []
    # stall: silent 30 minutes while running (fires); busy (1 minute); finished 40 minutes ago;
    # silent three days (out of the rule's window); running with no step yet, started 25 minutes ago
    events += [_run("silent", "running", NOW - 3600), *_steps("silent", NOW - 1800)]
    events += [_run("busy", "running", NOW - 3600), *_steps("busy", NOW - 60)]
    events += [_run("done", "running", NOW - 3600), *_steps("done", NOW - 2400), _run("done", "finished", NOW - 2400)]
    events += [_run("ancient", "running", NOW - 4 * 86400), *_steps("ancient", NOW - 3 * 86400)]
    events += [_run("no-steps", "running", NOW - 1500)]
    # alert kinds: one fresh alert of each kind on "busy", an old non_finite on "done"
    for kind in alerting.KIND_RULES:
        events.append(AlertEvent(run_id="busy", kind=kind, message=f"{kind} now", ts=NOW - 60, severity="warning"))
    events.append(AlertEvent(run_id="done", kind="non_finite", message="long ago", ts=NOW - 7200))
    events.append(AlertEvent(run_id="silent", kind="run_failed", message="another kind", ts=NOW - 30))
    return events


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QueryRunner]:
    # the stall rule reads the engine's now(): the events are dated from when the store is built, not
    # from when the module was imported (a full session reaches this module minutes after collecting it)
    global NOW
    NOW = time.time()
    with loaded_store(tmp_path_factory.mktemp("alerting-store"), _events()) as store:
        yield QueryRunner.of_store(store)


def _firing(rule: alerting.Rule, runner: QueryRunner) -> dict[str, float]:
    end = datetime.fromtimestamp(NOW, timezone.utc) + timedelta(seconds=5)
    sql = expand_macros(rule.sql, context_for(end - timedelta(seconds=rule.window_s), end))
    assert "$" not in sql, sql
    columns, types, rows = runner.run(sql)
    assert columns[-1] == rule.value and columns[0] == "run_id", (rule.uid, columns)
    assert all("String" in t for t in types[:-1]) and "Float" in types[-1], (rule.uid, types)  # labels, then a number
    return {row[0]: row[-1] for row in rows if alerting.fires(rule, row[-1])}


def test_the_rules_cover_the_contract_kinds() -> None:
    # poison_message is added to the contract by the reliability work; the others must be kinds the worker raises
    assert set(alerting.KIND_RULES) - {"poison_message"} <= set(ALERT_KINDS)
    assert {"non_finite", "stalled", "eval_below_threshold", "node_divergence", "poison_message"} <= set(alerting.KIND_RULES)
    uids = [r.uid for r in alerting.rules()]
    assert len(set(uids)) == len(uids)


def test_stall_rule_fires_for_a_silent_running_run_only(runner: QueryRunner) -> None:
    firing = _firing(alerting.stall_rule(STALL_MINUTES), runner)
    assert set(firing) == {"silent", "no-steps"}, firing
    assert 29 <= firing["silent"] <= 31 and 24 <= firing["no-steps"] <= 26
    assert set(_firing(alerting.stall_rule(27), runner)) == {"silent"}  # the threshold is the setting


@pytest.mark.parametrize("kind", list(alerting.KIND_RULES))
def test_kind_rule_fires_for_fresh_alerts_of_its_kind(kind: str, runner: QueryRunner) -> None:
    title, severity = alerting.KIND_RULES[kind]
    assert _firing(alerting.kind_rule(kind, title, severity), runner) == {"busy": 1.0}


# ----------------------------------------------------------- the API's shapes

_UID = {"type": "string", "pattern": r"^[a-zA-Z0-9\-_]+$", "maxLength": 40}
_DURATION = {"type": "string", "pattern": r"^([0-9]+(ms|s|m|h|d|w|y))+$"}
ALERT_QUERY = {
    "type": "object",
    "required": ["refId", "datasourceUid", "model", "relativeTimeRange"],
    "properties": {
        "refId": {"type": "string", "minLength": 1},
        "queryType": {"type": "string"},
        "datasourceUid": {"type": "string", "minLength": 1},
        "model": {"type": "object", "required": ["refId"]},
        "relativeTimeRange": {"type": "object", "required": ["from", "to"], "additionalProperties": False,
                              "properties": {"from": {"type": "integer", "minimum": 0},
                                             "to": {"type": "integer", "minimum": 0}}},
    },
    "additionalProperties": False,
}
PROVISIONED_ALERT_RULE = {
    "type": "object",
    "required": ["orgID", "folderUID", "ruleGroup", "title", "condition", "data", "noDataState", "execErrState", "for"],
    "properties": {
        "uid": _UID, "orgID": {"type": "integer"}, "folderUID": _UID,
        "ruleGroup": {"type": "string", "minLength": 1, "maxLength": 190},
        "title": {"type": "string", "minLength": 1, "maxLength": 190},
        "condition": {"type": "string"}, "data": {"type": "array", "minItems": 1, "items": ALERT_QUERY},
        "noDataState": {"enum": ["Alerting", "NoData", "OK"]}, "execErrState": {"enum": ["OK", "Alerting", "Error"]},
        "for": _DURATION, "isPaused": {"type": "boolean"},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "notification_settings": {"type": "object", "required": ["receiver"],
                                  "properties": {"receiver": {"type": "string", "minLength": 1}}},
    },
    "additionalProperties": False,
}
ALERT_RULE_GROUP = {
    "type": "object",
    "required": ["title", "folderUid", "interval", "rules"],
    "properties": {"title": {"type": "string"}, "folderUid": _UID, "interval": {"type": "integer", "minimum": 10},
                   "rules": {"type": "array", "items": PROVISIONED_ALERT_RULE}},
    "additionalProperties": False,
}
EMBEDDED_CONTACT_POINT = {
    "type": "object",
    "required": ["type", "settings"],
    "properties": {
        "uid": _UID, "name": {"type": "string", "minLength": 1}, "disableResolveMessage": {"type": "boolean"},
        "type": {"enum": ["alertmanager", "dingding", "discord", "email", "googlechat", "kafka", "line", "opsgenie",
                          "pagerduty", "pushover", "sensugo", "slack", "teams", "telegram", "threema", "victorops",
                          "webhook", "wecom"]},
        "settings": {"type": "object", "required": ["url"], "properties": {"url": {"type": "string", "pattern": "^https?://"},
                                                                          "httpMethod": {"enum": ["POST", "PUT"]}}},
    },
    "additionalProperties": False,
}


def _check_group(body: dict[str, Any], receiver: str | None) -> None:
    jsonschema.validate(body, ALERT_RULE_GROUP)
    refs = set()
    for rule in body["rules"]:
        assert rule["folderUID"] == body["folderUid"] and rule["ruleGroup"] == body["title"]
        assert rule["condition"] in {q["refId"] for q in rule["data"]}
        (query,) = [q for q in rule["data"] if q["datasourceUid"] != alerting.EXPRESSION_UID]
        assert query["datasourceUid"] == "areal-clickhouse" and query["model"]["rawSql"]
        (cond,) = [q for q in rule["data"] if q["refId"] == rule["condition"]]
        assert cond["model"]["type"] == "threshold" and cond["model"]["expression"] == query["refId"]
        assert rule.get("notification_settings", {}).get("receiver") == receiver
        refs.add(rule["uid"])
    assert refs == {r.uid for r in alerting.rules()}


class _Recorder(BaseHTTPRequestHandler):
    """Grafana's HTTP API as far as `provision` needs it: GETs of what is absent answer 404."""

    requests: list[tuple[str, str, Any]] = []
    existing: set[str] = set()

    def _answer(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.requests.append((method, self.path, body))
        status, payload = 200, {}
        if method == "GET":
            path = self.path.split("?")[0]
            if path.startswith("/api/v1/provisioning/contact-points"):
                payload = [alerting.contact_point("http://old")] if "contact-point" in self.existing else []
            elif path.startswith("/api/datasources/uid/") and "datasource" not in self.existing:
                status = 404
            elif path.startswith("/api/folders/") and "folder" not in self.existing:
                status = 404
        data = json.dumps(payload if status == 200 else {"message": "not found"}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        self._answer("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._answer("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._answer("PUT")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def grafana() -> Iterator[tuple[str, type[_Recorder]]]:
    handler = type("Recorder", (_Recorder,), {"requests": [], "existing": set()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_provision_posts_the_rule_group_and_the_webhook_contact_point(
        grafana: tuple[str, type[_Recorder]], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    url, recorder = grafana
    monkeypatch.delenv("AREAL_GRAFANA_ALERT_WEBHOOK", raising=False)
    monkeypatch.setenv("AREAL_GRAFANA_STALL_MINUTES", "15")
    hook = "https://hooks.example/areal?token=abc"
    assert main(["grafana", "provision", "--url", url, "--clickhouse-url", "http://u:p@ch:8123",
                 "--webhook", hook]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "alert rules: areal-stall" in out and "webhook contact point created" in out
    writes = [(m, p, b) for m, p, b in recorder.requests if m != "GET"]
    (point,) = [b for m, p, b in writes if (m, p) == ("POST", "/api/v1/provisioning/contact-points")]
    jsonschema.validate(point, EMBEDDED_CONTACT_POINT)
    assert point["settings"]["url"] == hook and point["uid"] == alerting.CONTACT_POINT_UID
    (group,) = [b for m, p, b in writes if (m, p) == ("PUT", f"/api/v1/provisioning/folder/{FOLDER_UID}/rule-groups/areal")]
    _check_group(group, alerting.CONTACT_POINT_NAME)
    stall = next(r for r in group["rules"] if r["uid"] == "areal-stall")
    assert stall["data"][1]["model"]["conditions"][0]["evaluator"] == {"type": "gt", "params": [15.0]}
    # the folder the rules live in is created before them
    paths = [p for m, p, _ in writes]
    assert paths.index("/api/folders") < paths.index(f"/api/v1/provisioning/folder/{FOLDER_UID}/rule-groups/areal")

    # the second push updates the contact point in place; without a webhook, rules go to the default policy
    recorder.requests.clear()
    recorder.existing = {"datasource", "folder", "contact-point"}
    monkeypatch.setenv("AREAL_GRAFANA_ALERT_WEBHOOK", hook)
    assert main(["grafana", "provision", "--url", url, "--clickhouse-url", "http://u:p@ch:8123"]) == 0
    (point,) = [b for m, p, b in recorder.requests if (m, p) == ("PUT", "/api/v1/provisioning/contact-points/areal-webhook")]
    jsonschema.validate(point, EMBEDDED_CONTACT_POINT)
    assert not [p for m, p, _ in recorder.requests if m == "POST" and "contact-points" in p]
    recorder.requests.clear()
    monkeypatch.delenv("AREAL_GRAFANA_ALERT_WEBHOOK")
    assert main(["grafana", "provision", "--url", url, "--clickhouse-url", "http://u:p@ch:8123"]) == 0
    assert "no webhook" in capsys.readouterr().out
    (group,) = [b for m, p, b in recorder.requests if m == "PUT" and "rule-groups" in p]
    _check_group(group, None)
    assert not [p for m, p, _ in recorder.requests if "contact-points" in p]


def test_provision_refuses_a_webhook_that_is_not_http(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["grafana", "provision", "--url", "http://127.0.0.1:9", "--clickhouse-url", "http://d:@c:8123",
                 "--webhook", "hooks.example/x"]) == 2
    assert "--webhook" in capsys.readouterr().err
    assert main(["grafana", "provision", "--url", "http://127.0.0.1:9", "--clickhouse-url", "http://d:@c:8123",
                 "--stall-minutes", "0"]) == 2
    assert "--stall-minutes" in capsys.readouterr().err


def _unescape(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("$$", "$")
    if isinstance(value, dict):
        return {k: _unescape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unescape(v) for v in value]
    return value


def test_the_alerting_file_says_what_the_api_gets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    yaml = pytest.importorskip("yaml")
    committed = repo_root() / "grafana" / "provisioning" / "alerting" / "areal.yaml"
    assert committed.read_text() == alerting_file()
    doc = yaml.safe_load(committed.read_text())
    (file_group,) = doc["groups"]
    api = alerting.group(FOLDER_UID)
    assert file_group["interval"] == f"{api['interval']}s" and file_group["name"] == api["title"]
    for in_file, in_api in zip(file_group["rules"], api["rules"], strict=True):
        assert "$" not in in_file["data"][0]["model"]["rawSql"].replace("$$", "")  # every $ escaped
        assert _unescape(in_file) == {k: v for k, v in in_api.items() if k not in ("orgID", "folderUID", "ruleGroup")}
    assert "contactPoints" not in doc  # the committed file: Grafana's default policy
    # --files with a webhook: a contact point the rules notify, in a file only its owner reads
    assert main(["grafana", "provision", "--files", str(tmp_path), "--clickhouse-url", "http://u:p@ch:8123",
                 "--webhook", "https://hooks.example/x"]) == 0
    written = tmp_path / "alerting" / "areal.yaml"
    assert written.stat().st_mode & 0o777 == 0o600
    doc = yaml.safe_load(written.read_text())
    (point,) = doc["contactPoints"]
    (receiver,) = point["receivers"]
    jsonschema.validate({**receiver, "name": point["name"]}, EMBEDDED_CONTACT_POINT)
    assert all(r["notification_settings"] == {"receiver": point["name"]} for r in doc["groups"][0]["rules"])
