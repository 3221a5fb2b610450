"""Checks a dashboard JSON must pass before Grafana sees it.

- Round trip through the SDK's typed models (Grafana 11.6 schema): parsing
  the JSON into `Dashboard` and serialising it again gives the same JSON, so
  no key is unknown to the schema, misspelt or of the wrong shape (a
  `"gridpos"` or a string `"refresh": 5` would not survive). ClickHouse
  targets round-trip through our `ClickHouseQuery` variant; annotation targets
  (which the SDK types only for Grafana's built-in store) through the same.
- Every datasource reference points at a provisioned datasource uid (or at
  Grafana's own built-in annotation source), with the plugin type it has.
- Panel ids are unique, variables referenced in SQL exist.

`problems(dashboard_json)` returns readable strings; empty means valid.
"""

from __future__ import annotations

import copy
import enum
import json
import re
import types
import typing
from collections.abc import Iterator
from typing import Any

from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard

from areal_metrics.grafana.clickhouse import DATASOURCE_UID, PLUGIN_ID, ClickHouseQuery, register

GRAFANA_BUILTIN = {"uid": "-- Grafana --", "type": "grafana"}
PROVISIONED = {DATASOURCE_UID: PLUGIN_ID}
_BUILTIN_VARIABLES = {"__from", "__to", "__interval", "__interval_ms", "__range", "__range_s", "__range_ms"}
_VARIABLE_USE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\$(\w+)|\[\[(\w+)")


def _plain(obj: Any) -> Any:
    return json.loads(json.dumps(obj, cls=JSONEncoder))


def _without_annotation_targets(data: dict[str, Any]) -> dict[str, Any]:
    stripped = copy.deepcopy(data)
    for item in stripped.get("annotations", {}).get("list", []):
        item.pop("target", None)
    return stripped


def round_trip_problems(data: dict[str, Any]) -> list[str]:
    """Differences between `data` and `Dashboard.from_json(data)` serialised again, and type errors."""
    register()
    problems: list[str] = []
    original = _without_annotation_targets(data)
    model = dashboard.Dashboard.from_json(copy.deepcopy(original))
    again = _plain(model)
    problems.extend(f"{path}: {what}" for path, what in _diff(original, again, "dashboard"))
    problems.extend(type_problems(model, "dashboard"))
    for i, item in enumerate(data.get("annotations", {}).get("list", [])):
        if "target" in item:
            target = item["target"]
            back = _plain(ClickHouseQuery.from_json(target))
            problems.extend(f"{path}: {what}" for path, what in _diff(target, back, f"annotations[{i}].target"))
    return problems


def type_problems(obj: Any, path: str) -> list[str]:
    """Values that do not have the type the SDK model declares (from_json does not check them)."""
    out: list[str] = []
    try:
        hints = typing.get_type_hints(type(obj))
    except Exception:  # noqa: BLE001 - not an SDK model
        return out
    for name, hint in hints.items():
        if name.startswith("_") or not hasattr(obj, name):
            continue
        out.extend(_check_type(getattr(obj, name), hint, f"{path}.{_json_name(obj, name)}"))
    return out


def _json_name(obj: Any, attr: str) -> str:
    """The JSON key of an SDK attribute (id_val -> id, grid_pos -> gridPos)."""
    base = attr[:-4] if attr.endswith("_val") else attr
    head, *rest = base.split("_")
    return head + "".join(part.title() for part in rest)


def _check_type(value: Any, hint: Any, path: str) -> list[str]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (Any, object) or value is None and (hint is type(None) or type(None) in args):
        return []
    if origin is typing.Union or isinstance(hint, types.UnionType):
        options = [a for a in args if a is not type(None)]
        results = [_check_type(value, a, path) for a in options]
        return [] if any(not r for r in results) else results[0]
    if origin is typing.Literal:
        return [] if value in args else [f"{path}: {value!r} is not one of {list(args)}"]
    if origin is list:
        if not isinstance(value, list):
            return [f"{path}: expected a list, got {type(value).__name__}"]
        return [p for i, item in enumerate(value) for p in _check_type(item, args[0], f"{path}[{i}]")]
    if origin is dict:
        return [] if isinstance(value, dict) else [f"{path}: expected an object, got {type(value).__name__}"]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        allowed = [e.value for e in hint]
        return [] if value in allowed else [f"{path}: {value!r} is not one of {allowed}"]
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return [] if ok else [f"{path}: expected a number, got {type(value).__name__} {value!r}"]
    if hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return [] if ok else [f"{path}: expected an integer, got {type(value).__name__} {value!r}"]
    if hint in (str, bool):
        ok = isinstance(value, hint)
        return [] if ok else [f"{path}: expected {hint.__name__}, got {type(value).__name__} {value!r}"]
    if isinstance(hint, type):
        if isinstance(value, dict) and hasattr(hint, "from_json"):
            value = hint.from_json(value)  # some SDK decoders keep nested models as plain objects
        if not isinstance(value, hint):
            return [f"{path}: expected {hint.__name__}, got {type(value).__name__}"]
        return type_problems(value, path)
    return []


def _diff(a: Any, b: Any, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in b:
                yield f"{path}.{key}", "dropped by the schema (unknown or misplaced key)"
            elif key not in a:
                yield f"{path}.{key}", f"added by the schema ({b[key]!r})"
            else:
                yield from _diff(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            yield path, f"length {len(a)} became {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _diff(x, y, f"{path}[{i}]")
    elif a != b or type(a) is not type(b):
        yield path, f"{a!r} became {b!r}"


def datasource_refs(data: Any, path: str = "dashboard") -> Iterator[tuple[str, Any]]:
    """Every `datasource` value anywhere in the dashboard, with where it is."""
    if isinstance(data, dict):
        for key, value in data.items():
            here = f"{path}.{key}"
            if key == "datasource":
                yield here, value
            yield from datasource_refs(value, here)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from datasource_refs(value, f"{path}[{i}]")


def datasource_problems(data: dict[str, Any], provisioned: dict[str, str] | None = None) -> list[str]:
    provisioned = provisioned or PROVISIONED
    out = []
    for where, ref in datasource_refs(data):
        if ref == GRAFANA_BUILTIN:
            continue
        if not isinstance(ref, dict) or "uid" not in ref:
            out.append(f"{where}: datasource {ref!r} is not a {{type, uid}} reference")
            continue
        uid, kind = ref.get("uid"), ref.get("type")
        if uid not in provisioned:
            out.append(f"{where}: datasource uid {uid!r} is not provisioned (known: {', '.join(provisioned)})")
        elif kind != provisioned[uid]:
            out.append(f"{where}: datasource {uid!r} has type {kind!r}, provisioned as {provisioned[uid]!r}")
    return out


def sql_texts(data: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, rawSql) of every panel target, variable query and annotation."""
    for panel in data.get("panels", []):
        for target in panel.get("targets", []):
            yield f"panel {panel.get('title')!r} target {target.get('refId')}", target.get("rawSql", "")
    for var in data.get("templating", {}).get("list", []):
        query = var.get("query")
        if isinstance(query, dict):
            yield f"variable {var.get('name')!r}", query.get("rawSql", "")
    for item in data.get("annotations", {}).get("list", []):
        target = item.get("target")
        if isinstance(target, dict) and "rawSql" in target:
            yield f"annotation {item.get('name')!r}", target["rawSql"]


def structure_problems(data: dict[str, Any]) -> list[str]:
    out = []
    ids = [p.get("id") for p in data.get("panels", [])]
    if len(ids) != len(set(ids)) or None in ids:
        out.append(f"panel ids must be present and unique, got {ids}")
    names = {v.get("name") for v in data.get("templating", {}).get("list", [])}
    for where, sql in sql_texts(data):
        for match in _VARIABLE_USE.finditer(sql):
            name = match.group(1) or match.group(2) or match.group(3)
            if name.startswith("__"):
                continue  # plugin macros ($__timeFilter...) and Grafana built-ins
            if name not in names:
                out.append(f"{where}: uses ${name}, which is not a dashboard variable")
        if not sql.strip():
            out.append(f"{where}: empty SQL")
    for panel in data.get("panels", []):
        repeat = panel.get("repeat")
        if repeat and repeat not in names:
            out.append(f"panel {panel.get('title')!r}: repeats over unknown variable {repeat!r}")
    return out


def problems(data: dict[str, Any], provisioned: dict[str, str] | None = None) -> list[str]:
    """Everything wrong with one dashboard's JSON; empty when it is valid."""
    return round_trip_problems(data) + datasource_problems(data, provisioned) + structure_problems(data)
