"""Provisioning: the ClickHouse datasource and the dashboard provider, as files and over the API.

One definition, two deliveries:

- files under grafana/provisioning/ that Grafana reads at start (compose
  mounts them); the datasource's connection values are `${VAR}` references
  Grafana fills from its environment (CLICKHOUSE_HOST, CLICKHOUSE_PORT,
  CLICKHOUSE_PROTOCOL, CLICKHOUSE_USER, CLICKHOUSE_PASSWORD), so no secret is
  in a file;
- `push(...)`: the same datasource (same uid, type, jsonData) and the same
  dashboard JSON, sent to a running Grafana with grafana-client
  (`areal-metrics grafana provision --url URL --token TOKEN`);
- `write_provisioning(dir, server, dashboards)`: the files with the
  connection values written in (e.g. the embedded store's loopback endpoint,
  for a Grafana installed on the same machine: `areal-metrics grafana
  provision --files DIR`); the datasource file then holds a password and is
  written with mode 0600.

The alert rules (areal_metrics.grafana.alerting) go out the same two ways: the
file provisioning/alerting/areal.yaml, and `push` PUTs the rule group (and, with a
webhook, creates or updates the contact point the rules notify).

`python -m areal_metrics.grafana` writes the files; a test keeps the
committed ones equal to what this module renders.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlparse

from areal_metrics.grafana import alerting
from areal_metrics.grafana.catalog import FOLDER, all_models, to_dict
from areal_metrics.grafana.clickhouse import DATABASE, DATASOURCE_NAME, DATASOURCE_UID, PLUGIN_ID

FOLDER_UID = "areal"
CONTAINER_DASHBOARDS = "/var/lib/grafana/dashboards/areal"  # where compose mounts grafana/dashboards
ENV = {  # datasource field -> the environment variable Grafana reads it from
    "host": "CLICKHOUSE_HOST",
    "port": "CLICKHOUSE_PORT",
    "protocol": "CLICKHOUSE_PROTOCOL",
    "username": "CLICKHOUSE_USER",
    "password": "CLICKHOUSE_PASSWORD",
}


@dataclass(frozen=True)
class ClickHouseServer:
    """Where Grafana reaches ClickHouse (as seen from Grafana, e.g. `clickhouse` inside compose)."""

    host: str
    port: int
    protocol: str  # "http" | "native"
    username: str
    password: str
    secure: bool = False
    database: str = DATABASE

    @classmethod
    def parse(cls, url: str) -> ClickHouseServer:
        """http(s)://user:pass@host:8123[/db] (HTTP) or clickhouse(s)://user:pass@host:9000[/db] (native)."""
        parsed = urlparse(url)
        schemes = {"http": ("http", False, 8123), "https": ("http", True, 8443),
                   "clickhouse": ("native", False, 9000), "clickhouses": ("native", True, 9440)}
        if parsed.scheme not in schemes or not parsed.hostname:
            raise ValueError(
                f"ClickHouse URL {url!r}: expected http(s)://user:pass@host:8123 or clickhouse://user:pass@host:9000"
            )
        protocol, secure, default_port = schemes[parsed.scheme]
        database = unquote(parsed.path.strip("/").split("/")[0]) or DATABASE
        return cls(parsed.hostname, parsed.port or default_port, protocol, unquote(parsed.username or "default"),
                   unquote(parsed.password or ""), secure, database)


def datasource(server: ClickHouseServer | None = None) -> dict[str, Any]:
    """The datasource as Grafana's API takes it; without a server, with `${VAR}` placeholders (files)."""
    if server is None:
        host, port, protocol, user, password = (f"${{{ENV[k]}}}" for k in ("host", "port", "protocol", "username", "password"))
        secure: Any = False
        database = DATABASE
    else:
        host, port, protocol, user, password = (server.host, server.port, server.protocol, server.username,
                                                server.password)
        secure, database = server.secure, server.database
    return {
        "name": DATASOURCE_NAME,
        "uid": DATASOURCE_UID,
        "type": PLUGIN_ID,
        "access": "proxy",
        "isDefault": True,
        "jsonData": {
            "host": host,
            "port": port,
            "protocol": protocol,
            "secure": secure,
            "username": user,
            "defaultDatabase": database,
        },
        "secureJsonData": {"password": password},
    }


# -------------------------------------------------------------------- files


def _yaml(value: Any, indent: int = 0) -> str:
    """A small YAML emitter for our provisioning files (mappings, lists, scalars); JSON quoting for strings."""
    pad = " " * indent
    if isinstance(value, Mapping):
        lines = []
        for key, item in value.items():
            if isinstance(item, (Mapping, list)) and item:
                lines.append(f"{pad}{key}:\n{_yaml(item, indent + 2)}")
            else:
                lines.append(f"{pad}{key}: {_scalar(item)}")
        return "\n".join(lines)
    if isinstance(value, list):
        lines = []
        for item in value:
            body = _yaml(item, indent + 2)
            lines.append(f"{pad}- {body.lstrip()}")
        return "\n".join(lines)
    return pad + _scalar(value)


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, (Mapping, list)):
        return json.dumps(value)
    return json.dumps(str(value))  # a JSON string is a valid YAML double-quoted scalar


def datasource_file(server: ClickHouseServer | None = None) -> str:
    doc = {"apiVersion": 1, "datasources": [{**datasource(server), "orgId": 1, "editable": False, "version": 1}]}
    if server is None:
        origin = "Generated by `python -m areal_metrics.grafana`; connection values come from Grafana's environment."
    else:
        origin = (f"Generated by `areal-metrics grafana provision --files`; it reads {server.protocol}://"
                  f"{server.host}:{server.port}/{server.database} as {server.username}.")
    header = f"# The ClickHouse datasource of the AReaL dashboards (uid areal-clickhouse).\n# {origin}\n"
    return header + _yaml(doc) + "\n"


def provider_file(dashboards: str = CONTAINER_DASHBOARDS) -> str:
    doc = {
        "apiVersion": 1,
        "providers": [
            {
                "name": "areal",
                "orgId": 1,
                "folder": FOLDER,
                "folderUid": FOLDER_UID,
                "type": "file",
                "disableDeletion": True,
                "allowUiUpdates": False,
                "updateIntervalSeconds": 10,
                "options": {"path": dashboards, "foldersFromFilesStructure": False},
            }
        ],
    }
    header = "# Loads grafana/dashboards/*.json (mounted at the path below) into the folder AReaL.\n# Generated by `python -m areal_metrics.grafana`.\n"
    return header + _yaml(doc) + "\n"


def alerting_file(stall_minutes: float = alerting.DEFAULT_STALL_MINUTES, webhook: str | None = None) -> str:
    doc = alerting.alerting_document(FOLDER, FOLDER_UID, stall_minutes, webhook)
    where = f"a webhook contact point ({CONTACT_POINT_NAME!r}) receives them" if webhook else (
        "they go to Grafana's default notification policy (`areal-metrics grafana provision --webhook URL` "
        "adds a webhook contact point)")
    header = ("# The AReaL alert rules (NaN, stall, evaluation below threshold, node divergence, poison messages);\n"
              f"# {where}. Generated by `python -m areal_metrics.grafana`; `$$` is a literal `$` for Grafana.\n")
    return header + _yaml(doc) + "\n"


CONTACT_POINT_NAME = alerting.CONTACT_POINT_NAME


def webhook_file(url: str = f"${{{alerting.WEBHOOK_ENV}}}") -> str:
    """The contact point and policy file for a Grafana of its own; by default the URL comes from
    Grafana's environment (the Helm chart mounts it with the webhook from a Secret)."""
    header = ("# Every AReaL alert to a webhook contact point (replaces this Grafana's notification policies).\n"
              "# Generated by areal_metrics.grafana.provision.webhook_file(); tests/test_helm_chart.py holds the chart's copy to it.\n")
    return header + _yaml(alerting.webhook_document(url)) + "\n"


def write_provisioning(directory: Path, server: ClickHouseServer | None = None,
                       dashboards: str = CONTAINER_DASHBOARDS, *, webhook: str | None = None,
                       stall_minutes: float = alerting.DEFAULT_STALL_MINUTES) -> list[Path]:
    """The datasource, dashboard-provider and alerting files under `directory` (a Grafana provisioning
    folder); with `webhook`, the alert rules notify a webhook contact point."""
    files = {
        directory / "datasources" / "clickhouse.yaml": datasource_file(server),
        directory / "dashboards" / "areal.yaml": provider_file(dashboards),
        directory / "alerting" / "areal.yaml": alerting_file(stall_minutes, webhook),
    }
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if (server is not None and path.name == "clickhouse.yaml") or (webhook and "alerting" in path.parts):
            # the password; a webhook URL often holds a token
            path.touch(mode=0o600)
            path.chmod(0o600)
        path.write_text(text)
    return list(files)


# ---------------------------------------------------------------------- API


class GrafanaApiLike(Protocol):
    """The part of grafana_client.GrafanaApi that `push` uses."""

    datasource: Any
    folder: Any
    dashboard: Any
    alertingprovisioning: Any


@dataclass
class Pushed:
    datasource: str  # "created" | "updated"
    folder: str
    dashboards: list[str]
    alert_rules: list[str]
    contact_point: str | None = None  # "created" | "updated" | None (no webhook)


def _status(exc: Exception) -> int | None:
    return getattr(exc, "status_code", None)


def push(api: GrafanaApiLike, server: ClickHouseServer, *, webhook: str | None = None,
         stall_minutes: float = alerting.DEFAULT_STALL_MINUTES) -> Pushed:
    """Create or update the datasource, the folder, every dashboard (overwrite), the webhook contact
    point (with `webhook`) and the alert rule group (replaced as a whole)."""
    ds = datasource(server)
    try:
        api.datasource.get_datasource_by_uid(DATASOURCE_UID)
    except Exception as exc:  # noqa: BLE001 - grafana-client raises per status; 404 means absent
        if _status(exc) != 404:
            raise
        api.datasource.create_datasource(ds)
        ds_state = "created"
    else:
        api.datasource.update_datasource_by_uid(DATASOURCE_UID, ds)
        ds_state = "updated"
    try:
        api.folder.get_folder(FOLDER_UID)
        folder_state = "exists"
    except Exception as exc:  # noqa: BLE001
        if _status(exc) != 404:
            raise
        api.folder.create_folder(FOLDER, uid=FOLDER_UID)
        folder_state = "created"
    names = []
    for name, model in all_models().items():
        body = to_dict(model)
        body.pop("id", None)
        api.dashboard.update_dashboard(
            {"dashboard": body, "folderUid": FOLDER_UID, "overwrite": True, "message": "areal-metrics grafana provision"}
        )
        names.append(str(body.get("uid")))
    point_state = None
    if webhook:
        point = alerting.contact_point(webhook)
        found = api.alertingprovisioning.get_contactpoints(name=alerting.CONTACT_POINT_NAME) or []
        if any(isinstance(p, Mapping) and p.get("uid") == alerting.CONTACT_POINT_UID for p in found):
            api.alertingprovisioning.update_contactpoint(alerting.CONTACT_POINT_UID, point)
            point_state = "updated"
        else:
            api.alertingprovisioning.create_contactpoint(point)
            point_state = "created"
    rule_group = alerting.group(FOLDER_UID, stall_minutes, alerting.CONTACT_POINT_NAME if webhook else None)
    api.alertingprovisioning.update_rule_group(FOLDER_UID, alerting.RULE_GROUP, rule_group)
    return Pushed(ds_state, folder_state, names, [r["uid"] for r in rule_group["rules"]], point_state)
