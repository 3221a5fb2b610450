"""Grafana alert rules and the webhook contact point, as code: alerts that reach people without
a babysat `areal-metrics alerts --follow` process.

Each rule is one SQL query on the ClickHouse datasource (refId A: a table whose string columns
become the alert's labels, `run_id` first, and whose last column is the number) and a threshold
expression on it (refId C, the rule's condition). Grafana evaluates the group every INTERVAL_S
seconds; a query that returns no rows is `OK` (nothing to say), a query that fails is `Error`.

- one rule per alert kind the stream worker raises (CONTRACT.md's AlertKind: `non_finite`,
  `stalled`, `eval_below_threshold`, `node_divergence`) and `poison_message` (a record that a
  reader could not handle): alerts of that kind per run in the last WINDOW_S seconds, > 0;
- `stall`: a run whose latest status is `running` and that sent no step (nor run event) for
  more than N minutes, read from the steps themselves, so it fires even when the stream worker
  is down.

The same definitions go out twice: `group(...)`/`contact_point(...)` are the bodies of Grafana's
provisioning HTTP API (PUT /api/v1/provisioning/folder/{folder}/rule-groups/{group},
POST/PUT /api/v1/provisioning/contact-points), `alerting_file(...)` is the file Grafana reads
from provisioning/alerting/ at start. tests/test_grafana_alerting.py runs every rule's SQL
against the store and checks both shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from areal_metrics.grafana.clickhouse import DATASOURCE_UID, PLUGIN_ID, Format, view

RULE_GROUP = "areal"
INTERVAL_S = 60
WINDOW_S = 600  # an alert event of the worker keeps its rule firing this long
STALL_WINDOW_S = 86_400  # a run silent for longer than a day is no longer paged about
DEFAULT_STALL_MINUTES = 10.0
CONTACT_POINT_UID = "areal-webhook"
CONTACT_POINT_NAME = "AReaL webhook"
WEBHOOK_ENV = "AREAL_GRAFANA_ALERT_WEBHOOK"  # what the committed file's contact point would read
EXPRESSION_UID = "__expr__"  # Grafana's server-side expressions
ORG_ID = 1

# alert kind -> (title, severity label): the kinds a person should hear of at once
KIND_RULES: dict[str, tuple[str, str]] = {
    "non_finite": ("NaN or infinite reward / loss", "critical"),
    "stalled": ("Run stalled (stream worker)", "warning"),
    "eval_below_threshold": ("Evaluation below threshold", "warning"),
    "node_divergence": ("Node divergence", "warning"),
    "poison_message": ("Poison message (a record no reader could handle)", "critical"),
}


@dataclass(frozen=True)
class Rule:
    uid: str
    title: str
    sql: str  # Grafana's macros ($__timeFilter, $__fromTime) over [now - window_s, now]
    value: str  # the numeric column the threshold reads (the last one)
    op: str  # "gt" | "lt": Grafana's threshold evaluator
    threshold: float
    window_s: int
    summary: str
    severity: str


def kind_rule(kind: str, title: str, severity: str) -> Rule:
    sql = f"""SELECT run_id, toFloat64(count()) AS alerts
FROM {view('alerts')}
WHERE $__timeFilter(ts) AND kind = '{kind}'
GROUP BY run_id
ORDER BY run_id"""
    return Rule(f"areal-{kind.replace('_', '-')}", title, sql, "alerts", "gt", 0, WINDOW_S,
                f"{{{{ $labels.run_id }}}}: {{{{ $values.A }}}} `{kind}` alert(s) in the last {WINDOW_S // 60} "
                "minutes (`areal-metrics alerts --run RUN_ID` lists them)", severity)


def stall_rule(minutes: float) -> Rule:
    """Running runs and the minutes since their last step or run event; fires past `minutes`."""
    sql = f"""SELECT r.run_id AS run_id,
    dateDiff('second', greatest(toDateTime(r.ts), toDateTime(ifNull(s.last, r.ts))), now()) / 60 AS minutes_without_steps
FROM
(
    SELECT run_id, ts FROM {view('runs')} WHERE status = 'running'
) AS r
LEFT JOIN
(
    SELECT run_id, max(ts) AS last FROM {view('steps')} WHERE ts >= $__fromTime GROUP BY run_id
) AS s ON s.run_id = r.run_id
WHERE greatest(toDateTime(r.ts), toDateTime(ifNull(s.last, r.ts))) >= $__fromTime
ORDER BY run_id"""
    return Rule("areal-stall", "Run stalled: no steps", sql, "minutes_without_steps", "gt", float(minutes),
                STALL_WINDOW_S, f"{{{{ $labels.run_id }}}} is running but sent no step for "
                f"{{{{ humanize $values.A.Value }}}} minutes (threshold {minutes:g})", "critical")


def rules(stall_minutes: float = DEFAULT_STALL_MINUTES) -> list[Rule]:
    return [stall_rule(stall_minutes), *(kind_rule(k, t, s) for k, (t, s) in KIND_RULES.items())]


def fires(rule: Rule, value: float) -> bool:
    """The rule's condition on one row's number, as Grafana's threshold expression applies it."""
    return value > rule.threshold if rule.op == "gt" else value < rule.threshold


# -------------------------------------------------------------------- payloads


def rule_body(rule: Rule, folder_uid: str, receiver: str | None) -> dict[str, Any]:
    """One rule as Grafana's provisioning API takes it (ProvisionedAlertRule)."""
    body: dict[str, Any] = {
        "uid": rule.uid,
        "orgID": ORG_ID,
        "folderUID": folder_uid,
        "ruleGroup": RULE_GROUP,
        "title": rule.title,
        "condition": "C",
        "data": [
            {
                "refId": "A",
                "queryType": "table",
                "relativeTimeRange": {"from": rule.window_s, "to": 0},
                "datasourceUid": DATASOURCE_UID,
                "model": {
                    "refId": "A",
                    "datasource": {"type": PLUGIN_ID, "uid": DATASOURCE_UID},
                    "editorType": "sql",
                    "queryType": "table",
                    "format": int(Format.TABLE),
                    "rawSql": rule.sql,
                    "intervalMs": 1000,
                    "maxDataPoints": 43200,
                },
            },
            {
                "refId": "C",
                "queryType": "",
                "relativeTimeRange": {"from": 0, "to": 0},
                "datasourceUid": EXPRESSION_UID,
                "model": {
                    "refId": "C",
                    "datasource": {"type": EXPRESSION_UID, "uid": EXPRESSION_UID},
                    "type": "threshold",
                    "expression": "A",
                    "conditions": [{"evaluator": {"type": rule.op, "params": [rule.threshold]}}],
                },
            },
        ],
        "noDataState": "OK",
        "execErrState": "Error",
        "for": "0s",
        "isPaused": False,
        "annotations": {"summary": rule.summary},
        "labels": {"source": "areal-metrics", "severity": rule.severity},
    }
    if receiver:
        body["notification_settings"] = {"receiver": receiver}
    return body


def group(folder_uid: str, stall_minutes: float = DEFAULT_STALL_MINUTES,
          receiver: str | None = None) -> dict[str, Any]:
    """The rule group as PUT /api/v1/provisioning/folder/{folder_uid}/rule-groups/{RULE_GROUP} takes it."""
    return {
        "title": RULE_GROUP,
        "folderUid": folder_uid,
        "interval": INTERVAL_S,
        "rules": [rule_body(r, folder_uid, receiver) for r in rules(stall_minutes)],
    }


def contact_point(url: str) -> dict[str, Any]:
    """The webhook contact point as POST/PUT /api/v1/provisioning/contact-points takes it."""
    return {
        "uid": CONTACT_POINT_UID,
        "name": CONTACT_POINT_NAME,
        "type": "webhook",
        "settings": {"url": url, "httpMethod": "POST"},
        "disableResolveMessage": False,
    }


def _escaped(value: Any) -> Any:
    """Grafana expands $VAR in provisioning files; `$$` is a literal `$` (the SQL's macros)."""
    if isinstance(value, str):
        return value.replace("$", "$$")
    if isinstance(value, dict):
        return {k: _escaped(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escaped(v) for v in value]
    return value


def alerting_document(folder: str, folder_uid: str, stall_minutes: float = DEFAULT_STALL_MINUTES,
                      webhook: str | None = None) -> dict[str, Any]:
    """provisioning/alerting/areal.yaml as a mapping: the rule group, and the contact point when a
    webhook is given (`webhook` is written as is: `${VAR}` makes Grafana read it from its environment)."""
    receiver = CONTACT_POINT_NAME if webhook else None
    rule_docs = []
    for body in group(folder_uid, stall_minutes, receiver)["rules"]:
        doc = {k: v for k, v in body.items() if k not in ("orgID", "folderUID", "ruleGroup")}
        rule_docs.append(_escaped(doc))
    doc: dict[str, Any] = {
        "apiVersion": 1,
        "groups": [{"orgId": ORG_ID, "name": RULE_GROUP, "folder": folder, "interval": f"{INTERVAL_S}s",
                    "rules": rule_docs}],
    }
    if webhook:
        doc["contactPoints"] = _contact_points(webhook)
    return doc


def _contact_points(webhook: str) -> list[dict[str, Any]]:
    point = contact_point(webhook)
    return [{"orgId": ORG_ID, "name": CONTACT_POINT_NAME, "receivers": [{k: v for k, v in point.items() if k != "name"}]}]


def webhook_document(webhook: str) -> dict[str, Any]:
    """A provisioning file for a Grafana of its own (the Helm chart's): the webhook contact point and
    a notification policy tree that sends every alert to it (it replaces the tree of that Grafana)."""
    return {
        "apiVersion": 1,
        "contactPoints": _contact_points(webhook),
        "policies": [{"orgId": ORG_ID, "receiver": CONTACT_POINT_NAME,
                      "group_by": ["grafana_folder", "alertname", "run_id"]}],
    }
